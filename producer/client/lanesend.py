"""The ``XADD``s of submits to lanes other than the default: each lane's in ``MULTI``/``EXEC``
transactions that add the lane to the shard's lane set first (``SADD P:{T}:lanes LANE``), in
one round trip with the default lane's, which go as ``pack_xadds`` sends them (contract
section 7; ``producer.client.lanes`` says what a lane is). ``producer.client.steps`` comes here
only when a submit is not all to the default lane.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from producer.client.lanes import LaneChoice, stream_of
from producer.client.submission import Submission, Xadds, check_xadds, pack_lane_xadds
from producer.protocol.lanes import lanes_key

__all__ = ["LaneXadds", "by_lane", "lane_xadds"]


def by_lane(subs: Iterable[Submission]) -> dict[LaneChoice | None, list[Submission]]:
    """``subs`` grouped by lane, each group in their order (the asyncio client's concurrent
    submits may go to several lanes in one round trip)."""
    groups: dict[LaneChoice | None, list[Submission]] = {}
    for sub in subs:
        group = groups.get(sub.lane)
        if group is None:
            groups[sub.lane] = [sub]
        else:
            group.append(sub)
    return groups


Group = tuple[str, str | None, list[Submission]]


@dataclass(frozen=True, slots=True)
class LaneXadds:
    """One shard's submits to several lanes: ``groups`` holds each lane's stream, the lane set
    to add it to (None: the default lane, never in the set) and its submissions; ``xadds`` their
    commands packed, the same commands a redis-py pipeline queues (``queue``), checked by
    ``check`` either way."""

    groups: list[Group]
    xadds: Xadds

    def check(self, replies: list[Any]) -> None:
        check_xadds(self.xadds, replies)

    def queue(self, pipe: Any) -> None:
        """The packer's commands on a redis-py pipeline that is not a transaction: ``MULTI``
        and ``EXEC`` are queued as commands, so the replies line up with the packer's."""
        blocks = iter(self.xadds.blocks)
        for stream, lane_set, subs in self.groups:
            at = 0
            while at < len(subs):
                count, txn = next(blocks)
                if txn:
                    pipe.execute_command("MULTI")
                if lane_set is not None:
                    pipe.sadd(lane_set, stream)
                for sub in subs[at : at + count]:
                    pipe.xadd(stream, sub.fields())
                if txn:
                    pipe.execute_command("EXEC")
                at += count


def lane_xadds(prefix: str, tag: str, subs: Sequence[Submission]) -> LaneXadds:
    """The ``XADD``s of ``subs`` on shard ``tag``, each to its lane's stream: the default
    lane's as ``pack_xadds`` sends them, any other's in transactions that add the lane to
    ``P:{T}:lanes`` first (``SADD``, then the ``XADD``s)."""
    lane_set = lanes_key(prefix, tag)
    groups: list[Group] = [
        (stream_of(prefix, tag, lane), None if lane is None else lane_set, group)
        for lane, group in by_lane(subs).items()
    ]
    return LaneXadds(groups, pack_lane_xadds(groups))
