"""Several models in one worker process (contract section 8): a ``Worker`` per model, one device
and one session budget for them all, and a config read again on SIGHUP."""
