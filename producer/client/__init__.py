"""The library: ``Client`` and ``AsyncClient``, two drivers of one engine (``plans``)."""
