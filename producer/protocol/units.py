"""Quantities written for people, one way everywhere: errors, logs and reports agree."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(nbytes: float) -> str:
    """A size in binary units: ``512 B``, ``3.4 KiB``, ``9.7 MiB``, ``1.5 GiB``."""
    sign, size = ("-" if nbytes < 0 else ""), abs(nbytes)
    if size < 1024:
        return f"{sign}{size:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024 or unit == "GiB":
            break
    return f"{sign}{size:.1f} {unit}"
