"""Whether the worker is getting anywhere: for ``/healthz`` and for a stop during an outage.

A worker that holds requests while Redis refuses or cannot be reached looks alive (its threads
run, its retries log nothing between outage lines), yet it answers nothing, and its leases keep
other workers from taking what it holds. ``Progress`` hears the events that mean the path moved
(a batch written, entries read, a model run starting or ending, a hook call, a turn of a wait
on Redis memory) and says how long it has been since the last one; a model run or hook call in
progress counts as moving (a hung one is ``Stuck``'s or the hook pool's to judge). The service
(worker/service.py) fails ``/healthz`` past ``claim_idle_ms`` of that while it holds work, and
after a stop signal gives up on Redis past a short grace.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence

from producer.redisio.topology import Topology
from worker.events import Events
from worker.intake.leases import Stuck

__all__ = ["GiveUpAfter", "Progress", "RunClock", "cut_connections"]


class Progress(Events):
    """The time of the worker's last step forward (monotonic), from its events."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last = clock()
        self.running = False  # a model run is in progress (``RunClock``)
        # whether pipeline hook calls are in progress (a hung one is the hook pool's to judge)
        self.hooks_busy: Callable[[], bool] = lambda: False

    def moved(self) -> None:
        self.last = self.clock()

    def stalled_s(self) -> float:
        """Seconds since the last step forward; 0 while a model run or a hook call is in
        progress."""
        if self.running or self.hooks_busy():
            return 0.0
        return max(self.clock() - self.last, 0.0)

    def stalled(self, claim_idle_ms: int, held: int | bool) -> str | None:
        """Why /healthz fails when the worker holds work (``held`` entries, or True for work
        not yet counted in leases) and has not moved for longer than ``claim_idle_ms``."""
        stalled_s = self.stalled_s()
        if not held or stalled_s <= claim_idle_ms / 1000.0:
            return None
        return (
            f"no progress for {stalled_s:.0f} s while holding {int(held)} entries "
            f"(claim_idle_ms {claim_idle_ms}): Redis refuses or cannot be reached"
        )

    def batch_done(
        self,
        codes: Iterable[str],
        queued_s: Sequence[float],
        decode_s: Iterable[float],
        runs: Iterable[tuple[int, float]],
        write_s: float,
        classes: Sequence[str] = (),
    ) -> None:
        self.moved()

    def point(self, name: str) -> None:
        if name in ("after_read", "memory_hold"):  # a read, or a wait on Redis memory
            self.moved()

    def hook_ran(self, stage: str, requests: int, wall_s: float, cpu_s: float) -> None:
        self.moved()


class RunClock(Stuck):
    """``Stuck`` that also tells ``progress`` when a model run starts and ends."""

    def __init__(self, max_run_s: float, progress: Progress) -> None:
        super().__init__(max_run_s)
        self.progress = progress

    def run_started(self) -> None:
        super().run_started()
        self.progress.running = True
        self.progress.moved()

    def run_ended(self) -> None:
        super().run_ended()
        self.progress.running = False
        self.progress.moved()


class GiveUpAfter(threading.Thread):
    """After a stop signal: calls ``give_up(first)`` once the worker has not moved for
    ``grace_s``, then again every ``repeat_s`` (each call cuts the Redis calls begun since),
    until ``done`` is set; and ``abandon()``, if given, when ``done`` is still not set
    ``abandon_s`` after the first (a thread that waits on a call no cut reaches)."""

    def __init__(
        self,
        progress: Progress,
        grace_s: float,
        give_up: Callable[[bool], None],
        done: threading.Event,
        abandon: Callable[[], None] | None = None,
        repeat_s: float = 0.5,
        abandon_s: float = 1.0,
    ) -> None:
        super().__init__(name="redbatch-stop-grace", daemon=True)
        self.progress = progress
        self.grace_s = grace_s
        self.give_up = give_up
        self.done = done
        self.abandon = abandon
        self.repeat_s = repeat_s
        self.abandon_s = abandon_s

    def run(self) -> None:
        while not self.done.wait(0.1):
            if self.progress.stalled_s() > self.grace_s:
                break
        else:
            return
        gave_up = time.monotonic()
        first = True
        while not self.done.is_set():
            self.give_up(first)
            first = False
            self.done.wait(self.repeat_s)
            if self.abandon is not None and time.monotonic() - gave_up > self.abandon_s:
                self.abandon()
                return


def cut_connections(topology: Topology) -> None:
    """Close every connection of the worker's pools, also those in use: a call waiting on a
    paused Redis would otherwise hold its thread for the socket timeout. The pools reconnect
    on their next use."""
    pools = {id(p): p for p in (topology.seed.connection_pool, *topology.pools())}
    for pool in pools.values():
        pool.disconnect(inuse_connections=True)
