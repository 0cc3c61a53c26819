"""A model's lanes summed from its status: every lane of each shard (its default lane first),
and the whole queue over all of them. Apart from ``producer.ops.lanes``, which ``status`` uses
to read the lanes, so that neither imports the other."""

from __future__ import annotations

from producer.ops.lanes import LaneStatus
from producer.ops.status import ModelStatus, ShardStatus
from producer.protocol.lanes import Lane

__all__ = ["has_lanes", "model_lanes", "queue_total", "shard_lanes"]


def shard_lanes(shard: ShardStatus) -> tuple[LaneStatus, ...]:
    """Every lane of ``shard``: its default lane (``P:{T}:requests``) first, then the others."""
    req = shard.requests
    default = LaneStatus(
        Lane(shard.tag),
        req.key,
        req.exists,
        req.backlog,
        None if req.group is None else req.group.pending,
        req.oldest_entry_age_s,
    )
    return (default, *shard.lanes.lanes)


def model_lanes(status: ModelStatus) -> tuple[LaneStatus, ...]:
    """Every lane of every shard of the model, shard by shard."""
    return tuple(ln for shard in status.shards for ln in shard_lanes(shard))


def has_lanes(status: ModelStatus) -> bool:
    """True when a shard has a lane besides its default one."""
    return any(shard.lanes.lanes for shard in status.shards)


def queue_total(status: ModelStatus) -> tuple[int, int, float | None]:
    """The model's whole queue, every lane of every shard: (backlog, pending, oldest age).
    The default lanes' part is ``status.requests`` (their sum), as the report always read it."""
    req = status.requests
    others = [ln for shard in status.shards for ln in shard.lanes.lanes if ln.exists]
    ages = [ln.oldest_entry_age_s for ln in others if ln.oldest_entry_age_s is not None]
    if req.oldest_entry_age_s is not None:
        ages.append(req.oldest_entry_age_s)
    return (
        req.backlog + sum(ln.backlog for ln in others),
        (req.group.pending if req.group else 0) + sum(ln.pending or 0 for ln in others),
        max(ages) if ages else None,
    )
