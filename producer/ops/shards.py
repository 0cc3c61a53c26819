"""The shards of a model's queue, as an operator changes them: show, place, retire.

``P:{M}:shards`` lists a model's tags, its own first (docs/protocol.md, section 1). A shard
spreads load only on a master of its own, and a tag's master is the one owning its CRC16 slot:
consecutive tags land unevenly (48 of them over 3 masters: 24, 11 and 13), so ``place`` picks
each new tag's ``K`` for the master it should land on (``plan_placement``, which the bench and
the cluster tests use too). ``retire`` takes a shard off the list, so producers stop sending to
it, and puts it in ``P:{M}:retiring``, so workers keep serving it; once it is drained it leaves
that set too. Both keys are in the model's own slot, so each change is one ``MULTI`` (guarded by
``WATCH`` against a concurrent one) that runs on Redis Cluster as on one Redis.
``producer.cli.shards`` is the command around these.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from producer.ops.status import ShardAccess, ShardStatus, gather_shard
from producer.protocol import keys
from producer.protocol.errors import RedbatchError, UsageError
from producer.redisio import shards
from producer.redisio.shards import Shards, parse_shards
from producer.redisio.topology import Node

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MARGIN_S",
    "POLL_S",
    "DrainState",
    "Placement",
    "Retirement",
    "ShardsView",
    "check_retirable",
    "place",
    "plan_placement",
    "retire",
    "show",
    "spread_notes",
]

#: Waited on top of ``shards.REFRESH_S`` before a retiring shard is checked for its drain: a
#: producer that read the list just before the change may still send to it until then.
MARGIN_S = 1.0
#: How often ``retire`` looks at the shard's stream while it drains.
POLL_S = 0.5
#: How long ``retire`` waits for the drain (after the grace period) by default.
DEFAULT_TIMEOUT_S = 3600.0
#: Candidate keys ``place`` tries per shard before giving up (a master owning one slot of
#: 16384 needs about 16384 tries on average).
MAX_CANDIDATES = 1_000_000
_EDIT_TRIES = 10


# ---------------------------------------------------------------------------------------------
# show


@dataclass(frozen=True, slots=True)
class ShardsView:
    """What ``show`` found: the list as stored (None: absent, one shard), the cluster's masters
    (empty on a single Redis) and each shard served, listed ones first."""

    model: str
    prefix: str
    cluster: bool
    masters: tuple[str, ...]
    listed: tuple[str, ...] | None
    shards: tuple[ShardStatus, ...]


def show(access: ShardAccess, prefix: str, model: str, now_s: float | None = None) -> ShardsView:
    """Read the model's shard list, retiring set, and each shard's stream on its own node."""
    now = time.time() if now_s is None else now_s
    raw, found = access.on(model, _read, prefix, model)
    parts = tuple(
        gather_shard(access, prefix, tag, now, 0, retiring=tag in found.retiring)
        for tag in found.serve
    )
    masters = tuple(n.address for n in access.topology.slots.masters())
    return ShardsView(model, prefix, access.cluster, masters, tuple(raw) if raw else None, parts)


def _read(client: redis.Redis, prefix: str, model: str) -> tuple[list[str], Shards]:
    """The list as stored, and the shards as workers and clients read it."""
    pipe = client.pipeline(transaction=False)
    pipe.lrange(keys.shards_key(prefix, model), 0, -1)
    pipe.smembers(keys.retiring_key(prefix, model))
    listed, retiring = pipe.execute()
    return _decode(listed), parse_shards(model, listed, retiring)


# ---------------------------------------------------------------------------------------------
# place


@dataclass(frozen=True, slots=True)
class Placement:
    """What ``place`` did: the shards before, those it appended, where each lives (None on a
    single Redis), and what an operator should know."""

    model: str
    prefix: str
    cluster: bool
    count: int
    before: tuple[str, ...]
    added: tuple[str, ...]
    nodes: dict[str, str | None]
    notes: tuple[str, ...]

    @property
    def after(self) -> tuple[str, ...]:
        return self.before + self.added


def plan_placement(
    model: str,
    current: Sequence[str],
    count: int,
    node_of: Callable[[str], Node | None],
    masters: Sequence[Node],
    taken: set[str],
) -> list[str]:
    """The tags to append so that ``model`` has ``count`` shards (none when it has as many).

    Each new shard goes to the master holding the fewest of the model's shards so far (ties: the
    first in slot order), so shards spread one per master, then round-robin. Its tag is
    ``M~K`` for the first ``K`` of 1, 2, 3, ... whose slot that master owns and whose tag is not
    in ``taken`` (listed, retiring, or just picked). On a single Redis (no ``masters``) it is
    simply the next free ``K``."""
    load = {m.address: 0 for m in masters}
    for tag in current:
        node = node_of(tag)
        if node is not None and node.address in load:
            load[node.address] += 1
    added: list[str] = []
    taken = set(taken) | set(current)
    for _ in range(count - len(current)):
        target = min(masters, key=lambda m: load[m.address]) if masters else None
        tag = _free_tag(model, taken, node_of, target)
        added.append(tag)
        taken.add(tag)
        if target is not None:
            load[target.address] += 1
    return added


def _free_tag(
    model: str, taken: set[str], node_of: Callable[[str], Node | None], target: Node | None
) -> str:
    for k in range(1, MAX_CANDIDATES + 1):
        tag = keys.shard_tag(model, str(k))
        if tag in taken:
            continue
        if target is None:
            return tag
        node = node_of(tag)
        if node is not None and node.address == target.address:
            return tag
    where = "" if target is None else f" on master {target.address}"
    raise RedbatchError(f"found no free shard tag for {model!r}{where} in {MAX_CANDIDATES} tries")


def place(access: ShardAccess, prefix: str, model: str, count: int) -> Placement:
    """Give ``model`` ``count`` shards, each new one on its own master: append only (never
    reorder or remove, so producers' and workers' lists only grow), and change nothing when it
    has as many already. On a single Redis it works too, all shards on the one node."""
    masters = access.topology.slots.masters() if access.cluster else []
    key, retiring_key = keys.shards_key(prefix, model), keys.retiring_key(prefix, model)

    def edit(pipe: Any) -> tuple[tuple[str, ...], list[str]]:
        raw = _decode(pipe.lrange(key, 0, -1))
        if raw and raw[0] != model:
            raise UsageError(
                f"{key} starts with {raw[0]!r}, not the model's own tag {model!r} (the protocol "
                "wants it first); fix the list before placing more shards"
            )
        found = parse_shards(model, raw, pipe.smembers(retiring_key))
        taken = set(found.serve) | set(raw)
        added = plan_placement(model, found.send, count, access.topology.node_of, masters, taken)
        if added:
            pipe.multi()
            pipe.rpush(key, *([] if raw else [model]), *added)
        return found.send, added

    before, added = access.on(model, _transaction, (key, retiring_key), edit)
    after = (*before, *added)
    notes = []
    if not access.cluster:
        notes.append(
            "this Redis is not a cluster: every shard lives on it. Shards spread load only over "
            "the masters of a Redis Cluster"
        )
    if count < len(before):
        notes.append(
            f"{model!r} has {len(before)} shards already; place only adds shards "
            "(redbatch shards retire takes one away)"
        )
    addresses = [n.address for n in masters]
    notes += spread_notes({tag: access.node(tag) for tag in after}, addresses)
    return Placement(
        model,
        prefix,
        access.cluster,
        count,
        tuple(before),
        tuple(added),
        {tag: access.node(tag) for tag in after},
        tuple(notes),
    )


def spread_notes(nodes: dict[str, str | None], masters: Sequence[str]) -> list[str]:
    """On a cluster (``masters``, addresses): a note when some master holds two shards more
    than another (placed before a reshard or a failover moved slots, or listed by hand)."""
    if not masters:
        return []
    load: dict[str, list[str]] = {m: [] for m in masters}
    for tag, node in nodes.items():
        if node in load:
            load[node].append(tag)
    counts = [len(v) for v in load.values()]
    if max(counts) - min(counts) <= 1:
        return []
    crowded = ", ".join(f"{', '.join(v)} on {m}" for m, v in load.items() if len(v) == max(counts))
    return [
        f"shards are spread unevenly ({crowded}; least loaded master holds {min(counts)}): "
        "retire the extra ones and place again"
    ]


# ---------------------------------------------------------------------------------------------
# retire


@dataclass(frozen=True, slots=True)
class DrainState:
    """One look at a retiring shard: entries in its stream and entries workers hold."""

    tag: str
    backlog: int
    pending: int
    elapsed_s: float
    grace_left_s: float

    @property
    def drained(self) -> bool:
        return self.backlog == 0 and self.pending == 0


@dataclass(frozen=True, slots=True)
class Retirement:
    """What ``retire`` did: ``moved`` (taken off the list by this run), ``list_deleted`` (only
    the model's own tag was left), ``retired`` (drained and dropped from the retiring set)."""

    model: str
    prefix: str
    tag: str
    moved: bool
    list_deleted: bool
    waited: bool
    retired: bool
    backlog: int | None
    pending: int | None
    dead: int
    waited_s: float
    timed_out: bool = False


def check_retirable(model: str, tag: str) -> None:
    """UsageError unless ``tag`` names a shard of ``model`` other than its first."""
    if not keys.is_valid_tag(tag):
        raise UsageError(f"{tag!r} is not a shard tag: MODEL~K, K in [a-z0-9]{{1,16}}")
    if keys.model_of(tag) != model:
        raise UsageError(f"shard {tag!r} belongs to model {keys.model_of(tag)!r}, not {model!r}")
    if tag == model:
        raise UsageError(
            f"{model!r} is the model's first shard and is never retired: the shard list lives "
            "in its slot, and callers holding a bare request id look there. Retire the others "
            f"({model}~K)"
        )


def retire(
    access: ShardAccess,
    prefix: str,
    model: str,
    tag: str,
    *,
    wait: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    poll_s: float | None = None,
    progress: Callable[[DrainState], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Retirement:
    """Take ``tag`` off the model's list and into its retiring set (one MULTI; the list is
    deleted when only the model's own tag would be left), then, with ``wait``, wait until the
    shard is drained (no entry in its stream, none pending in the group) and drop it from the
    retiring set. The drain is first looked for ``REFRESH_S`` + ``MARGIN_S`` after the change,
    when no producer sends there any more. A shard already retiring is waited for again, so a
    run that timed out or was interrupted can be resumed. ``timeout_s`` bounds the wait after
    that grace period; past it the shard stays retiring (workers keep serving it)."""
    check_retirable(model, tag)
    started = clock()
    key, retiring_key = keys.shards_key(prefix, model), keys.retiring_key(prefix, model)

    def edit(pipe: Any) -> tuple[bool, bool]:
        raw = _decode(pipe.lrange(key, 0, -1))
        retiring = _decode(pipe.smembers(retiring_key))
        if tag not in raw and tag not in retiring:
            found = parse_shards(model, raw, retiring)
            raise UsageError(
                f"{tag!r} is not a shard of {model!r} (shards: {', '.join(found.send)}"
                + (f"; retiring: {', '.join(found.retiring)})" if found.retiring else ")")
            )
        if tag not in raw:
            return False, False  # retiring already: wait for it again
        left = parse_shards(model, [t for t in raw if t != tag]).send
        pipe.multi()
        if left == (model,):
            pipe.delete(key)  # absent: one shard, as the contract has it
        else:
            pipe.lrem(key, 0, tag)
        pipe.sadd(retiring_key, tag)
        return True, left == (model,)

    moved, deleted = access.on(model, _transaction, (key, retiring_key), edit)
    stream = keys.request_stream(prefix, tag)
    if not wait:
        return Retirement(
            model, prefix, tag, moved, deleted, False, False, None, None, 0, clock() - started
        )
    grace_until = clock() + shards.REFRESH_S + MARGIN_S
    deadline = grace_until + timeout_s
    while True:
        checked = clock()
        backlog, pending = access.on(tag, _drain_state, stream)
        state = DrainState(
            tag, backlog, pending, checked - started, max(grace_until - checked, 0.0)
        )
        if progress is not None:
            progress(state)
        if checked >= grace_until and state.drained:
            # Dropped, then looked at once more: a request a producer with a stale list sent
            # between the check and the drop puts the shard back (workers keep serving it).
            access.on(model, _forget, retiring_key, tag)
            if access.on(tag, _drain_state, stream)[0] == 0:
                break
            access.on(model, _keep, retiring_key, tag)
        if checked >= deadline:
            dead = access.on(tag, _xlen, keys.dead_key(prefix, tag))
            return Retirement(
                model,
                prefix,
                tag,
                moved,
                deleted,
                True,
                False,
                backlog,
                pending,
                dead,
                clock() - started,
                timed_out=True,
            )
        sleep(POLL_S if poll_s is None else poll_s)
    dead = access.on(tag, _xlen, keys.dead_key(prefix, tag))
    return Retirement(model, prefix, tag, moved, deleted, True, True, 0, 0, dead, clock() - started)


def _drain_state(client: redis.Redis, stream: str) -> tuple[int, int]:
    """``XLEN`` of the shard's stream and what its ``workers`` group holds (``XINFO GROUPS``,
    which the operator's read-only rules allow)."""
    pipe = client.pipeline(transaction=False)
    pipe.xlen(stream)
    pipe.xinfo_groups(stream)
    backlog, groups = pipe.execute(raise_on_error=False)
    if isinstance(backlog, Exception):
        raise backlog
    if isinstance(groups, Exception):
        if "no such key" not in str(groups).lower():
            raise groups
        groups = []
    pending = sum(int(g["pending"]) for g in groups if _text(g.get("name")) == keys.CONSUMER_GROUP)
    return int(backlog), pending


def _forget(client: redis.Redis, retiring_key: str, tag: str) -> None:
    client.srem(retiring_key, tag)


def _keep(client: redis.Redis, retiring_key: str, tag: str) -> None:
    client.sadd(retiring_key, tag)


def _xlen(client: redis.Redis, key: str) -> int:
    return int(client.xlen(key))


# ---------------------------------------------------------------------------------------------
# Shared


def _transaction(client: redis.Redis, watched: Sequence[str], edit: Callable[[Any], Any]) -> Any:
    """Run ``edit`` on a pipeline watching ``watched`` (it reads, then queues a MULTI or not),
    and EXEC; again from the start when another client changed a watched key meanwhile."""
    with client.pipeline(transaction=True) as pipe:
        for _ in range(_EDIT_TRIES):
            try:
                pipe.watch(*watched)
                result = edit(pipe)
                if pipe.explicit_transaction:
                    pipe.execute()
                return result
            except redis.WatchError:
                continue
    raise RedbatchError(
        f"{', '.join(watched)} changed under this command {_EDIT_TRIES} times in a row "
        "(another `redbatch shards` running?); run it again"
    )


def _decode(values: Any) -> list[str]:
    return [_text(v) for v in values or ()]


def _text(value: Any) -> str:
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)
