"""Fault points for the fault-injection suite: off (and free) unless the environment turns them on.

Like FreeBSD's fail points or TiKV's ``fail-rs``, the worker names the places where a crash
matters, and a test run chooses what happens there, without a special build:

``REDBATCH_FAULTS``
    Comma-separated ``point=action`` pairs. Points: ``after_read`` (entries read, not yet
    decoded), ``after_inference`` (batch run, replies not yet handed to the writer),
    ``before_finish`` (where the batch is written, just before the reply/ack/delete script),
    ``after_finish`` (just after it). Actions: ``kill`` (SIGKILL this process) or
    ``kill:P`` (SIGKILL with probability P per hit, seeded by ``REDBATCH_FAULTS_SEED`` and
    the pid). The special pair ``crash_value=X`` SIGKILLs the process inside inference when
    any input element equals the float X: a "crash pill" request.
``REDBATCH_EXEC_LOG``
    A file to which the worker appends one line ``RID PID`` per request it ran on the model,
    so a test can count duplicate executions across workers that were killed.

The reply, acknowledgement and deletion are one atomic script, so there is no point between
them: a worker killed during the script leaves either all three done or none.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterable, Mapping

import numpy as np

__all__ = ["ACTIVE", "POINTS", "crash_if_pill", "executed", "hit", "parse"]

POINTS = ("after_read", "after_inference", "before_finish", "after_finish")


def parse(spec: str) -> tuple[dict[str, float], float | None]:
    """``"after_read=kill:0.1,crash_value=666"`` -> ({point: probability}, crash value)."""
    points: dict[str, float] = {}
    crash: float | None = None
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, action = part.partition("=")
        if name == "crash_value":
            crash = float(action)
            continue
        if name not in POINTS:
            raise ValueError(f"REDBATCH_FAULTS: unknown point {name!r}; known: {', '.join(POINTS)}")
        kind, _, prob = action.partition(":")
        if kind != "kill":
            raise ValueError(f"REDBATCH_FAULTS: unknown action {action!r} for {name}; use kill[:P]")
        points[name] = float(prob) if prob else 1.0
    return points, crash


_POINTS, _CRASH_VALUE = parse(os.environ.get("REDBATCH_FAULTS", ""))
_EXEC_LOG = os.environ.get("REDBATCH_EXEC_LOG") or None
#: True when any fault point or the execution log is on; call sites check it first.
ACTIVE = bool(_POINTS or _CRASH_VALUE is not None or _EXEC_LOG)
_rng = random.Random(f"{os.environ.get('REDBATCH_FAULTS_SEED', '0')}-{os.getpid()}")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def hit(point: str) -> None:
    """Called at a named point: SIGKILLs the process when the point is armed and the dice say so."""
    prob = _POINTS.get(point)
    if prob is not None and (prob >= 1.0 or _rng.random() < prob):
        _die()


def crash_if_pill(feeds: Mapping[str, np.ndarray]) -> None:
    """Inside inference: die when any float input holds the crash value."""
    if _CRASH_VALUE is None:
        return
    for arr in feeds.values():
        if arr.dtype.kind == "f" and bool(np.any(arr == _CRASH_VALUE)):
            _die()


def executed(rids: Iterable[str]) -> None:
    """Record requests that ran on the model (one line each, appended and flushed)."""
    if _EXEC_LOG is None:
        return
    pid = os.getpid()
    lines = "".join(f"{rid} {pid}\n" for rid in rids)
    fd = os.open(_EXEC_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, lines.encode())
    finally:
        os.close(fd)
