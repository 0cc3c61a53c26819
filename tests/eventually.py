"""``eventually``: wait for state that offers no event to wait on (a Redis key, a pending list,
a gauge), polling with a deadline. Where an event exists, tests wait on the event instead."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["eventually"]


def eventually(
    check: Callable[[], object], timeout_s: float = 20.0, what: str = "the condition"
) -> None:
    """Return once ``check()`` is true; fail the test, naming ``what``, after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pause_s = 0.005
    while not check():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout_s:g} s"
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, 0.05)
