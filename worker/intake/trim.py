"""Handing memory freed after a hostile read back to the system.

Python frees a refused entry's bytes as soon as its read is admitted, but glibc's ``malloc``
keeps what it freed for later use unless the block was mapped on its own: its threshold for that
grows (up to 32 MiB) after each large block freed, so a flood of entries carrying tens of MB
leaves the worker's resident memory tens of MB higher for good (``scripts/hostile_memory.py``
measures it). ``malloc_trim(0)`` returns the free pages of every arena. It costs a walk of the
heap, so the reader calls it only after a read whose refused entries carried more than
``TRIM_AFTER_BYTES``, which honest traffic never sends. Elsewhere than glibc it does nothing.

A connection's reply parser (hiredis) keeps the buffer a large reply was read into until the
next reply on that connection arrives, which for a connection left idle in the pool is never;
so the idle connections are dropped first (the next call reconnects, once).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

import redis

__all__ = ["TRIM_AFTER_BYTES", "release_freed"]

log = logging.getLogger(__name__)

#: Refused bytes in one read past which the freed memory is handed back.
TRIM_AFTER_BYTES = 8 << 20


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


_TRIM = _malloc_trim()


def release_freed(client: redis.Redis) -> bool:
    """Drop ``client``'s idle connections (and their parsers' buffers), then return the C heap's
    free pages to the system; False where the C library cannot."""
    try:
        client.connection_pool.disconnect(inuse_connections=False)
    except Exception:  # best effort: a failure here must never stop the reading thread
        log.debug("could not drop idle connections", exc_info=True)
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
