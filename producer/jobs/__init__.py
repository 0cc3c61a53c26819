"""``redbatch run``'s file job: input sources read a block at a time, the job's ledger, output
sinks, and its summary."""
