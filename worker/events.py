"""The worker's events: what the metrics count and where the fault points strike.

The stages call a few named events (``batch_done``, ``redis_down``, ``point("after_read")``) on
one object instead of taking a callback per concern. ``Events`` is the interface and its own
null object: every method does nothing, so an implementation overrides only what it observes
(``worker.ops.metrics.Metrics``, ``worker.ops.faults.FaultPoints``) and ``Fanout`` hands each event
to several. A worker without fault points gets the metrics alone, so a fault point on the hot path
costs one call to an empty method.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np

__all__ = ["NO_EVENTS", "Events", "Fanout", "Ran"]


class Ran(Protocol):
    """A request that ran on the model, as ``executed`` sees it."""

    @property
    def rid(self) -> str: ...


class Events:
    """The events of the worker's path; each method here does nothing."""

    # -- counted by the metrics ---------------------------------------------------------------

    def batch_done(
        self,
        codes: Iterable[str],
        queued_s: Sequence[float],
        decode_s: Iterable[float],
        runs: Iterable[tuple[int, float]],
        write_s: float,
        classes: Sequence[str] = (),
    ) -> None:
        """A batch is in Redis: the codes of the answers written there, each request's wait and
        decode time, each run's rows and seconds, the write's seconds, and each request's
        class (beside ``queued_s``; none given: every one ``normal``)."""

    def redis_down(self, during: str) -> None:
        """Redis became unreachable (or full) while ``during`` (an ``OutageRetry``'s name)."""

    def stream_damaged(self, shard: str, kind: str, lost: int) -> None:
        """Shard ``shard``'s stream was damaged under the workers (``kind``: deleted, trimmed,
        exhausted or group_recreated), losing at least ``lost`` requests
        (``worker.redisio.group``)."""

    def claimed(self, kind: str) -> None:
        """An entry was taken over from another consumer, or from an earlier self."""

    def leases_renewed(self, count: int) -> None:
        """``count`` held entries had their lease renewed."""

    def consumers_forgotten(self, count: int) -> None:
        """``count`` idle consumers with nothing pending left the group."""

    def cancelled_after_run(self) -> None:
        """A request ran, then was answered CANCELLED: its cancel key counted, but too late."""

    def split(self, cls: str) -> None:
        """A request of class ``cls`` had its rows split across two batches, its first rows
        filling the room a higher class left (``worker.answer.parts``)."""

    def hook_ran(self, stage: str, requests: int, wall_s: float, cpu_s: float) -> None:
        """A pipeline hook call (``stage``: preprocess or postprocess) on ``requests`` requests
        took ``wall_s`` seconds, ``cpu_s`` of them on its thread's CPU."""

    # -- fault points -------------------------------------------------------------------------

    def point(self, name: str) -> None:
        """The path reached a named fault point (``worker.ops.faults.POINTS``)."""

    def run_starts(self, feeds: Mapping[str, np.ndarray]) -> None:
        """A run is about to start on these inputs."""

    def executed(self, requests: Sequence[Ran]) -> None:
        """These requests ran on the model (one run)."""


#: The events of a part built without any: nothing observes them.
NO_EVENTS = Events()


class Fanout(Events):
    """Hands every event to each of ``sinks`` that observes it, in order.

    A sink observes an event when its class overrides the method; the others (``Events``'s
    no-ops) are left out when the fan-out is built, so an event only ``Metrics`` hears costs
    one call, as without a fan-out.
    """

    def __init__(self, *sinks: Events) -> None:
        self.sinks = sinks
        self._to = {name: _observers(sinks, name) for name in _EVENTS}

    def batch_done(
        self,
        codes: Iterable[str],
        queued_s: Sequence[float],
        decode_s: Iterable[float],
        runs: Iterable[tuple[int, float]],
        write_s: float,
        classes: Sequence[str] = (),
    ) -> None:
        to = self._to["batch_done"]
        if len(to) > 1:  # materialised once: each sink iterates them
            codes, decode_s, runs = list(codes), list(decode_s), list(runs)
        for handle in to:
            handle(codes, queued_s, decode_s, runs, write_s, classes)

    def redis_down(self, during: str) -> None:
        for handle in self._to["redis_down"]:
            handle(during)

    def stream_damaged(self, shard: str, kind: str, lost: int) -> None:
        for handle in self._to["stream_damaged"]:
            handle(shard, kind, lost)

    def claimed(self, kind: str) -> None:
        for handle in self._to["claimed"]:
            handle(kind)

    def leases_renewed(self, count: int) -> None:
        for handle in self._to["leases_renewed"]:
            handle(count)

    def consumers_forgotten(self, count: int) -> None:
        for handle in self._to["consumers_forgotten"]:
            handle(count)

    def cancelled_after_run(self) -> None:
        for handle in self._to["cancelled_after_run"]:
            handle()

    def split(self, cls: str) -> None:
        for handle in self._to["split"]:
            handle(cls)

    def hook_ran(self, stage: str, requests: int, wall_s: float, cpu_s: float) -> None:
        for handle in self._to["hook_ran"]:
            handle(stage, requests, wall_s, cpu_s)

    def point(self, name: str) -> None:
        for handle in self._to["point"]:
            handle(name)

    def run_starts(self, feeds: Mapping[str, np.ndarray]) -> None:
        for handle in self._to["run_starts"]:
            handle(feeds)

    def executed(self, requests: Sequence[Ran]) -> None:
        for handle in self._to["executed"]:
            handle(requests)


_EVENTS = tuple(name for name, value in vars(Events).items() if callable(value) and name[0] != "_")


def _observers(sinks: Sequence[Events], name: str) -> tuple[Callable[..., None], ...]:
    """The bound ``name`` methods of the sinks whose class overrides it."""
    quiet = getattr(Events, name)
    return tuple(getattr(s, name) for s in sinks if getattr(type(s), name) is not quiet)
