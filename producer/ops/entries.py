"""What the operator's reports read off Redis replies, shared by ``status`` and its lanes: bytes
as text (shown as stored) and an entry's age from its id."""

from __future__ import annotations

from typing import Any

__all__ = ["entry_age_s", "redis_text"]


def redis_text(value: Any) -> str:
    """Bytes from Redis as text; bytes that are not UTF-8 become ``\\xNN``, so that a report
    shows what is stored rather than a replacement character."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)


def entry_age_s(entry_id: str, now_s: float) -> float:
    """Age of a stream entry from the millisecond time in its id."""
    try:
        ms = int(entry_id.split("-", 1)[0])
    except ValueError:
        return 0.0
    return max(0.0, now_s - ms / 1000.0)
