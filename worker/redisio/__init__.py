"""Redis I/O for a model's request stream: reads, the finish step, claims, cancels, and retries
through outages."""
