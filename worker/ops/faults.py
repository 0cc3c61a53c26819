"""Fault points for the fault-injection suite: built by the CLI from the environment, or absent.

Like FreeBSD's fail points or TiKV's ``fail-rs``, the worker names the places where a crash
matters (``Events.point``), and a test run chooses what happens there, without a special build:

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
them: a worker killed during the script leaves either all three done or none. Nothing here
reads the environment: ``FaultPoints.from_env`` is given it, once, by the CLI.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Mapping, Sequence

import numpy as np

from worker.events import Events, Ran

__all__ = ["POINTS", "FaultPoints", "parse"]

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


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class FaultPoints(Events):
    """The armed points, the crash pill and the execution log of one worker process."""

    def __init__(
        self,
        points: Mapping[str, float],
        crash_value: float | None = None,
        exec_log: str | None = None,
        seed: str = "0",
        pid: int | None = None,
    ) -> None:
        self.points = dict(points)
        self.crash_value = crash_value
        self.exec_log = exec_log
        self.pid = os.getpid() if pid is None else pid
        self._rng = random.Random(f"{seed}-{self.pid}")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> FaultPoints | None:
        """The fault points ``env`` asks for (``REDBATCH_FAULTS``, ``REDBATCH_FAULTS_SEED``,
        ``REDBATCH_EXEC_LOG``); None when it asks for none. Raises ValueError for a bad spec."""
        points, crash = parse(env.get("REDBATCH_FAULTS", ""))
        exec_log = env.get("REDBATCH_EXEC_LOG") or None
        if not points and crash is None and exec_log is None:
            return None
        return cls(points, crash, exec_log, env.get("REDBATCH_FAULTS_SEED", "0"))

    def point(self, name: str) -> None:
        """SIGKILL the process when ``name`` is armed and the dice say so."""
        prob = self.points.get(name)
        if prob is not None and (prob >= 1.0 or self._rng.random() < prob):
            _die()

    def run_starts(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Inside inference: die when any float input holds the crash value."""
        if self.crash_value is None:
            return
        for arr in feeds.values():
            if arr.dtype.kind == "f" and bool(np.any(arr == self.crash_value)):
                _die()

    def executed(self, requests: Sequence[Ran]) -> None:
        """Record requests that ran on the model (one line each, appended and flushed)."""
        if self.exec_log is None:
            return
        lines = "".join(f"{request.rid} {self.pid}\n" for request in requests)
        fd = os.open(self.exec_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)
