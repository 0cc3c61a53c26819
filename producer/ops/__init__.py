"""What operators see and do: queue status, the live watch view, dead-letter replay, shard
placement and retirement."""
