"""The read side: lanes (one per shard) read entries, admit them against the schema, and keep
leases on what they hold; reclaim takes what crashed workers left."""
