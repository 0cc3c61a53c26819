"""Redis's bulk-string limit, ``proto-max-bulk-len``: the longest body or reply it takes.

A bulk string over it makes Redis drop the connection, losing every command queued on it
(../shared/FACTS.md), so the client refuses bodies over it before sending and the worker bounds
its replies by it. Both read it with ``CONFIG GET`` where their user may, and otherwise assume
Redis's default.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BULK_KEY", "REDIS_DEFAULT_BULK_BYTES", "parse_bulk_limit"]

#: The setting's name, as ``CONFIG GET`` takes and answers it.
BULK_KEY = "proto-max-bulk-len"
#: Redis's own default ``proto-max-bulk-len``: assumed when ``CONFIG GET`` is refused.
REDIS_DEFAULT_BULK_BYTES = 512 * 1024 * 1024


def parse_bulk_limit(answer: Any) -> int | None:
    """``proto-max-bulk-len`` from a ``CONFIG GET`` answer (redis-py's dict, or a flat list of
    name and value); None when it is not there."""
    if isinstance(answer, dict):
        pairs = list(answer.items())
    elif isinstance(answer, list):
        pairs = list(zip(answer[::2], answer[1::2], strict=False))
    else:
        return None
    for key, value in pairs:
        name = key.decode() if isinstance(key, bytes) else str(key)
        if name == BULK_KEY:
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    return None
