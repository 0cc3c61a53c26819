"""Pre- and post-processing: a handler's hooks loaded, run on threads of their own, each
request's failure its own (contract section 6)."""
