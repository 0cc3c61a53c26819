"""What the worker tells operators: metrics and health endpoints, the validation record, the
memory alarm, logging set-up, and fault points for the reliability suite."""
