"""Talking to Redis: commands packed by hand, which node serves a shard, a model's shard list,
retries through outages, memory readings, and connection settings."""
