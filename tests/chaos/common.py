"""What every part of the harness shares: where the repository is, the names the worker is run
under, the fault points, and the one polling wait."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from producer.protocol.keys import dead_key, request_stream

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "redbatch"
MODEL = "chaos"
CRASH_VALUE = 31337.0  # a float no healthy request holds: the crash pill's marker
POINTS = ("after_read", "after_inference", "before_finish", "after_finish")
STREAM = request_stream(PREFIX, MODEL)
DEAD = dead_key(PREFIX, MODEL)


class ScenarioTimeout(RuntimeError):
    """Raised when a condition a scenario waits for does not hold before its deadline."""


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    """Poll ``cond`` until true; for state that only Redis or /proc can tell, with no event."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise ScenarioTimeout(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)
