"""Pre- and post-processing: a handler's hooks loaded, run on threads of their own, each
request's failure its own (docs/protocol.md section 11)."""
