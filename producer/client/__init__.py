"""The library: ``Client`` and ``AsyncClient``, thin I/O shells over plans written once."""
