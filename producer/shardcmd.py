"""``redbatch shards``: show, place and retire the shards of a model's queue.

A model's queue may have several shards (contract section 1): ``P:{M}:shards`` lists their tags,
the model's own first; producers spread submits over them and workers serve them all, each
picking up a change within ``producer.shards.REFRESH_S``. A shard spreads load only on a master
of its own, and a tag's master is the one owning its CRC16 slot: consecutive tags land unevenly
(48 of them over 3 masters: 24, 11 and 13), so ``place`` picks each new tag's ``K`` for the
master it should land on. ``retire`` takes a shard off the list, so producers stop sending to
it, and puts it in ``P:{M}:retiring``, so workers keep serving it; once it is drained it leaves
that set too. Both keys are in the model's own slot, so each change is one ``MULTI`` (guarded by
``WATCH`` against a concurrent one) that runs on Redis Cluster as on one Redis.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from producer import argtypes, keys, shards
from producer.argtypes import EXIT_FAILED, EXIT_OK, UsageError
from producer.core import redact_url
from producer.errors import RedbatchError
from producer.shards import Shards, parse_shards
from producer.status import ShardAccess, ShardStatus, gather_shard
from producer.statusformat import ago, printable, table
from producer.topology import Node, tag_slot

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MARGIN_S",
    "POLL_S",
    "DrainState",
    "Placement",
    "Retirement",
    "ShardsView",
    "add_arguments",
    "place",
    "plan_placement",
    "retire",
    "run_command",
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
                f"{key} starts with {raw[0]!r}, not the model's own tag {model!r} (the contract "
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


# ---------------------------------------------------------------------------------------------
# Reports


def view_to_json(view: ShardsView) -> dict[str, Any]:
    """``show`` as JSON values."""
    return {
        "model": view.model,
        "prefix": view.prefix,
        "cluster": view.cluster,
        "masters": list(view.masters),
        "list": None if view.listed is None else list(view.listed),
        "send": [s.tag for s in view.shards if s.state == "send"],
        "retiring": [s.tag for s in view.shards if s.state == "retiring"],
        "shards": [
            {
                "tag": s.tag,
                "state": s.state,
                "master": s.node,
                "slot": tag_slot(s.tag),
                "backlog": s.requests.backlog,
                "pending": None if s.requests.group is None else s.requests.group.pending,
                "dead": s.dead.count,
                "oldest_entry_age_s": s.requests.oldest_entry_age_s,
            }
            for s in view.shards
        ],
        "total": {
            "backlog": sum(s.requests.backlog for s in view.shards),
            "pending": sum(s.requests.group.pending for s in view.shards if s.requests.group),
            "dead": sum(s.dead.count for s in view.shards),
        },
    }


def format_view(view: ShardsView, where: str | None = None) -> str:
    """``show`` as a person reads it: the list, the retiring set, a row per shard, a total."""
    at = f" at {where}" if where else ""
    kind = f"a Redis Cluster of {len(view.masters)} masters" if view.cluster else "one Redis"
    count = f"{len(view.shards)} shard{'' if len(view.shards) == 1 else 's'}"
    lines = [f"model {view.model!r}, prefix {view.prefix!r}{at}: {count} on {kind}"]
    key = keys.shards_key(view.prefix, view.model)
    if view.listed is None:
        lines.append(f"shard list {key}: absent (one shard, {view.model})")
    else:
        lines.append(f"shard list {key}: {', '.join(view.listed)}")
    retiring = [s.tag for s in view.shards if s.state == "retiring"]
    if retiring:
        lines.append(
            f"retiring {keys.retiring_key(view.prefix, view.model)}: {', '.join(retiring)} "
            "(no longer sent to; workers serve them until drained)"
        )
    where_cols = ["MASTER", "SLOT"] if view.cluster else []
    rows = [["SHARD", "STATE", *where_cols, "BACKLOG", "PENDING", "DEAD", "OLDEST"]]
    for s in view.shards:
        group = s.requests.group
        age = s.requests.oldest_entry_age_s
        rows.append(
            [
                s.tag,
                s.state,
                *([s.node or "-", str(tag_slot(s.tag))] if view.cluster else []),
                str(s.requests.backlog),
                "-" if group is None else str(group.pending),
                str(s.dead.count),
                "-" if age is None else ago(age),
            ]
        )
    total = view_to_json(view)["total"]
    pending = str(total["pending"]) if any(s.requests.group for s in view.shards) else "-"
    blank = ["", ""] if view.cluster else []
    rows.append(["total", "", *blank, str(total["backlog"]), pending, str(total["dead"]), ""])
    numbers = {3, 4, 5, 6} if view.cluster else {2, 3, 4}
    lines += table(rows, indent="  ", right=frozenset(numbers))
    sending = {s.tag: s.node for s in view.shards if s.state == "send"}
    lines += [f"note: {note}" for note in spread_notes(sending, view.masters)]
    return "\n".join(map(printable, lines))


def placement_to_json(placed: Placement) -> dict[str, Any]:
    """``place`` as JSON values."""
    return {
        "model": placed.model,
        "prefix": placed.prefix,
        "cluster": placed.cluster,
        "count": placed.count,
        "before": list(placed.before),
        "added": list(placed.added),
        "after": list(placed.after),
        "changed": bool(placed.added),
        "shards": [
            {"tag": tag, "master": placed.nodes.get(tag), "slot": tag_slot(tag)}
            for tag in placed.after
        ],
        "notes": list(placed.notes),
    }


def format_placement(placed: Placement) -> str:
    """``place`` as a person reads it."""
    key = keys.shards_key(placed.prefix, placed.model)
    if placed.added:
        lines = [
            f"added {len(placed.added)} shards to {key}: {', '.join(placed.added)}; "
            f"{placed.model!r} has {len(placed.after)} (workers and producers pick them up "
            f"within {shards.REFRESH_S:g} s)"
        ]
    else:
        lines = [f"{placed.model!r} has {len(placed.after)} shards; nothing changed"]
    where = ["MASTER", "SLOT"] if placed.cluster else []
    rows = [["SHARD", *where, ""]]
    for tag in placed.after:
        new = "new" if tag in placed.added else ""
        rows.append(
            [
                tag,
                *([placed.nodes.get(tag) or "-", str(tag_slot(tag))] if placed.cluster else []),
                new,
            ]
        )
    lines += table(rows, indent="  ")
    lines += [f"note: {note}" for note in placed.notes]
    return "\n".join(map(printable, lines))


def retirement_to_json(done: Retirement) -> dict[str, Any]:
    """``retire`` as JSON values."""
    return {
        "model": done.model,
        "prefix": done.prefix,
        "shard": done.tag,
        "moved": done.moved,
        "list_deleted": done.list_deleted,
        "waited": done.waited,
        "retired": done.retired,
        "timed_out": done.timed_out,
        "backlog": done.backlog,
        "pending": done.pending,
        "dead": done.dead,
        "waited_s": done.waited_s,
    }


def format_retirement(done: Retirement) -> str:
    """``retire``'s last lines."""
    retiring = keys.retiring_key(done.prefix, done.model)
    lines = []
    if done.retired:
        lines.append(
            f"retired {done.tag}: drained, and removed from {retiring} after "
            f"{done.waited_s:.1f} s; workers stop serving it within {shards.REFRESH_S:g} s"
        )
    elif done.timed_out:
        lines.append(
            f"{done.tag} still holds {done.backlog} entries ({done.pending} pending) after "
            f"{done.waited_s:.1f} s: it stays in {retiring} and workers keep serving it. Run "
            f"`redbatch shards retire --model {done.model} --shard {done.tag}` again to wait on"
        )
    else:
        lines.append(
            f"{done.tag} is retiring: producers stop sending to it within "
            f"{shards.REFRESH_S:g} s, workers serve it until it is drained. Run `redbatch "
            f"shards retire --model {done.model} --shard {done.tag}` (it waits) to finish"
        )
    if done.dead:
        dead = keys.dead_key(done.prefix, done.tag)
        lines.append(
            f"note: {dead} holds {done.dead} dead letters; status and replay list a shard only "
            "while it is listed or retiring: replay them (redbatch replay --from-dead) before "
            f"it retires, or read them with XRANGE {dead} - +"
        )
    return "\n".join(map(printable, lines))


class _Progress:
    """Prints a retiring shard's drain as it changes (and every 10 s while it does not), so a
    person sees it move without a line per poll."""

    def __init__(self, out: Callable[[str], None], model: str) -> None:
        self.out = out
        self.model = model
        self.last: tuple[int, int, bool] | None = None
        self.printed_at = 0.0

    def __call__(self, state: DrainState) -> None:
        if self.last is None:  # the shard was found and is retiring now
            self.out(
                f"retiring {state.tag} of {self.model!r}: producers stop sending to it within "
                f"{shards.REFRESH_S:g} s; waiting until it is drained"
            )
        seen = (state.backlog, state.pending, state.grace_left_s > 0)
        if seen == self.last and state.elapsed_s - self.printed_at < 10.0:
            return
        self.last, self.printed_at = seen, state.elapsed_s
        text = f"{state.tag}: backlog {state.backlog}, pending {state.pending}"
        if state.grace_left_s > 0:
            text += f"; waiting {state.grace_left_s:.1f} s more for producers to see the change"
        elif state.drained:
            text += ": drained"
        self.out(text)


# ---------------------------------------------------------------------------------------------
# The command

HELP = """\
Show, place and retire the shards of a model's queue. A shard is one request stream (with its
dead letters, replies and cancels) in one Redis Cluster slot; P:{M}:shards lists a model's
shards, its own tag M first, then M~K. Producers spread requests over them and every worker
serves them all, picking up a change within 5 s, without a restart. On a cluster, each shard on
its own master spreads the queue's load; on one Redis, shards add nothing.

examples:
  redbatch shards show --model demo
  redbatch shards place --model demo --count 3
  redbatch shards retire --model demo --shard demo~2
"""

_SHOW_HELP = """\
Show a model's shard list, the shards being retired, and for each shard the master it lives on
(on a cluster), its backlog (XLEN), what workers hold (pending), its dead letters, and a total.

examples:
  redbatch shards show --model demo
  redbatch shards show --model demo --json | jq '.shards[] | {tag, master, backlog}'
"""

_PLACE_HELP = """\
Give a model COUNT shards, each new one on a cluster master that holds none of the model's
shards yet (round-robin once every master holds one), by choosing its tag M~K so that its slot
is there. The first shard is always M, wherever its slot is. Shards are only ever appended:
running it again with the same COUNT changes nothing, a larger COUNT adds shards online, a
smaller one changes nothing (retire removes shards). On a single Redis it works too, with every
shard on the one node.

examples:
  redbatch shards place --model demo --count 3
  redbatch shards place --model demo --count 6 --json
"""

_RETIRE_HELP = """\
Retire one shard: take it off the list (producers stop sending to it within 5 s) and into
P:{M}:retiring (workers keep serving it), in one transaction. With --wait (the default), then
wait until it is drained (no entry in its stream, none pending) and remove it from the retiring
set, printing its progress; it first waits 5 s and a margin, as producers may still send until
they read the list again. The model's first shard, M, is never retired. When only M is left the
list is deleted (absent means one shard). A shard already retiring is waited for again, so an
interrupted run can be resumed. Exit status 1 when --timeout-s passed before the drain.

examples:
  redbatch shards retire --model demo --shard demo~2
  redbatch shards retire --model demo --shard demo~2 --no-wait
  redbatch shards retire --model demo --shard demo~2 --timeout-s 600 --json
"""


def _shard_arg(text: str) -> str:
    if not keys.is_valid_tag(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a shard tag: MODEL~K with K in [a-z0-9]{{1,16}}"
        )
    return text


def add_arguments(
    parser: argparse.ArgumentParser,
    connection_options: Callable[[argparse.ArgumentParser], None] | None = None,
) -> None:
    """``redbatch shards`` and its ``show``, ``place`` and ``retire`` (``producer.cli``
    registers the command and passes its connection options, added to each)."""
    parser.description = HELP
    formatter = argparse.RawDescriptionHelpFormatter
    actions = parser.add_subparsers(dest="shards_action", metavar="ACTION", required=True)
    made = []
    for name, helptext, description in (
        ("show", "list the shards, where they live and what they hold", _SHOW_HELP),
        ("place", "give the model N shards on distinct masters", _PLACE_HELP),
        ("retire", "retire one shard once it is drained", _RETIRE_HELP),
    ):
        sub = actions.add_parser(
            name, help=helptext, description=description, formatter_class=formatter
        )
        sub.add_argument("--model", required=True, type=argtypes.model_name, help="model name")
        sub.add_argument("--json", action="store_true", help="print JSON instead of text")
        sub.set_defaults(handler=run_command)
        made.append(sub)
    place_cmd, retire_cmd = made[1], made[2]
    place_cmd.add_argument(
        "--count",
        required=True,
        type=argtypes.positive_int,
        metavar="N",
        help="how many shards the model should have, its own first",
    )
    retire_cmd.add_argument(
        "--shard", required=True, type=_shard_arg, metavar="TAG", help="the shard, MODEL~K"
    )
    retire_cmd.add_argument(
        "--wait",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wait until the shard is drained, then drop it from the retiring set (default)",
    )
    retire_cmd.add_argument(
        "--timeout-s",
        type=argtypes.positive_float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"how long to wait for the drain (default: {DEFAULT_TIMEOUT_S:g})",
    )
    if connection_options is not None:
        connection_options(parser)
        for sub in made:
            connection_options(sub)


def run_command(args: argparse.Namespace) -> int:
    """``redbatch shards ACTION``: 0 when done, 1 when ``retire`` timed out waiting."""
    conn = redis.Redis.from_url(args.redis_url, socket_connect_timeout=5, socket_timeout=10)
    access = ShardAccess(conn, args.retry_s)
    try:
        access.refresh()
        if args.shards_action == "show":
            view = show(access, args.prefix, args.model)
            print(
                json.dumps(view_to_json(view), indent=2)
                if args.json
                else format_view(view, redact_url(args.redis_url))
            )
            return EXIT_OK
        if args.shards_action == "place":
            placed = place(access, args.prefix, args.model, args.count)
            print(
                json.dumps(placement_to_json(placed), indent=2)
                if args.json
                else format_placement(placed)
            )
            return EXIT_OK
        return _run_retire(access, args)
    finally:
        access.close()
        conn.close()


def _run_retire(access: ShardAccess, args: argparse.Namespace) -> int:
    check_retirable(args.model, args.shard)
    stream = sys.stderr if args.json else sys.stdout

    def say(text: str) -> None:
        print(printable(text), file=stream, flush=True)

    done = retire(
        access,
        args.prefix,
        args.model,
        args.shard,
        wait=args.wait,
        timeout_s=args.timeout_s,
        progress=_Progress(say, args.model) if args.wait else None,
    )
    if args.json:
        print(json.dumps(retirement_to_json(done), indent=2))
    else:
        print(format_retirement(done))
    return EXIT_FAILED if done.timed_out else EXIT_OK
