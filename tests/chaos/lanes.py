"""Lanes in the workload (contract section 7): which lane each request is sent to, the streams
the oracle must find drained, and the per-lane figures of a scenario.

A laned scenario draws each request's lane from ``MIX``: version 2's raw ``XADD`` to
``P:{T}:requests`` (class normal, no tenant) beside classes high and low without a tenant and
all three classes for two tenants. A tenant's request id begins with its name and a dot, as the
client's do. The load driver sends a lane other than the default as a producer of version 3
does (``MULTI; SADD P:{T}:lanes LANE; XADD LANE ...; EXEC``); the oracle then requires each
reply's ``class`` and ``tenant`` to be its lane's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from producer.protocol.lanes import DEFAULT_CLASS, lane_stream, lanes_key, tenant_rid

from .common import MODEL, PREFIX

if TYPE_CHECKING:
    import random

    from .workload import Requests

#: (class, tenant) of each lane a laned workload sends to; the default lane is drawn as often
#: as any two others together, so that version 2 producers stay a large part of the load.
MIX: tuple[tuple[str, str | None], ...] = (
    (DEFAULT_CLASS, None),
    (DEFAULT_CLASS, None),
    ("high", None),
    ("low", None),
    ("high", "ta"),
    (DEFAULT_CLASS, "ta"),
    ("low", "ta"),
    ("high", "tb"),
    (DEFAULT_CLASS, "tb"),
    ("low", "tb"),
)


def label(cls: str, tenant: str | None) -> str:
    """A lane's name in the report: ``normal (v2 XADD)``, ``high``, ``low:ta``..."""
    if tenant is None:
        return f"{cls} (v2 XADD)" if cls == DEFAULT_CLASS else cls
    return f"{cls}:{tenant}"


class LaneBook:
    """The lanes half of ``Run``: each rid's lane (absent: the default lane), by shard."""

    requests: Requests
    rng: random.Random
    _shard_of: dict[str, str]
    lane_of: dict[str, tuple[str, str | None]]  # rid -> (class, tenant), laned rids only

    def shard_of(self, rid: str) -> str:
        return MODEL

    def laned(self, rids: Sequence[str]) -> list[str]:
        """``rids`` each given a lane drawn from ``MIX``; a tenant's rid renamed ``N.rid``
        (its body, expected answer and shard moved with it). Returns the rids to send."""
        out = []
        for rid in rids:
            cls, tenant = self.rng.choice(MIX)
            new = tenant_rid(tenant, rid)
            if new != rid:
                self.requests.bodies[new] = self.requests.bodies.pop(rid)
                self.requests.expected[new] = self.requests.expected.pop(rid)
                if rid in self._shard_of:
                    self._shard_of[new] = self._shard_of.pop(rid)
            self.lane_of[new] = (cls, tenant)
            out.append(new)
        return out

    def lane(self, rid: str) -> tuple[str, str | None]:
        """``rid``'s (class, tenant): (normal, None) unless ``laned`` chose another."""
        return self.lane_of.get(rid, (DEFAULT_CLASS, None))

    def stream_of(self, rid: str) -> tuple[str, str | None]:
        """(``rid``'s lane stream, its shard's lane set key, None for the default lane)."""
        tag = self.shard_of(rid)
        cls, tenant = self.lane(rid)
        stream = lane_stream(PREFIX, tag, cls, tenant)
        if cls == DEFAULT_CLASS and tenant is None:
            return stream, None
        return stream, lanes_key(PREFIX, tag)

    def lane_streams(self, tag: str) -> list[str]:
        """Shard ``tag``'s streams that requests were sent to (its default stream always)."""
        streams = {lane_stream(PREFIX, tag)}
        for rid, (cls, tenant) in self.lane_of.items():
            if self.shard_of(rid) == tag:
                streams.add(lane_stream(PREFIX, tag, cls, tenant))
        return sorted(streams)

    def lane_figures(
        self, rids: Sequence[str], counts: Sequence[int], executions: Counter[str]
    ) -> dict[str, dict[str, int]]:
        """Per lane: requests sent, answered exactly once, lost (no reply), doubled (more than
        one reply) and duplicate executions. Empty when no rid was laned."""
        if not self.lane_of:
            return {}
        out: dict[str, dict[str, int]] = {}
        for rid, n in zip(rids, counts, strict=True):
            row = out.setdefault(
                label(*self.lane(rid)),
                {"sent": 0, "answered": 0, "lost": 0, "doubled": 0, "duplicates": 0},
            )
            row["sent"] += 1
            row["answered"] += n == 1
            row["lost"] += n == 0
            row["doubled"] += n > 1
            row["duplicates"] += max(0, executions[rid] - 1)
        return dict(sorted(out.items()))
