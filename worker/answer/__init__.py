"""The answer side: the batcher, the run on the model with failures isolated, replies encoded,
and the writer that finishes batches in Redis."""
