"""Send dead-lettered requests to the request stream again (``redbatch replay``, whose reports
and arguments are ``producer.cli.replay``).

A dead letter (``P:{T}:dead``) keeps the original entry's fields, ``rid`` and ``body``, plus the
``reason`` it died. ``replay`` walks each shard ``T`` of the model (``P:{M}:shards``, those
retiring included: they still hold requests), on the node that serves it, reads its dead letters
oldest first, up to the dead stream's last entry when it started (so a request that dies again
during the replay is not replayed twice), and adds each one to the same shard's
``P:{T}:requests`` as a fresh request with exactly the two fields of the protocol. The same
shard, because its reply key ``P:{T}:reply:R`` is where the caller of a kept id looks, and because
every transaction must stay in one cluster slot:

- ``new_ids`` (the default): a new request id (UUID4 hex), as the protocol asks of any retry.
  Works for every dead letter with a body, including those whose ``rid`` was missing or broken.
  The old id's caller will not see the answer; the report maps old ids to new ones.
- ``same_ids``: the old request id, so whoever looks up ``P:{T}:reply:R`` finds the new answer.
  A reply is never replaced, so an old error reply (the ``POISONED`` answer) is deleted first;
  a dead letter whose id already has an ok reply, or a reply that cannot be read, is skipped.
  Dead letters without a valid id need new ids.

With ``delete`` each dead letter that was re-sent is removed (``XDEL``). Each page of one shard's
dead letters is re-sent, its old replies removed and its dead letters deleted in one ``MULTI``
(all keys of that one tag), so a failure never leaves a dead letter deleted without its request
re-sent. A dry run changes nothing. ``limit`` counts over all shards, taken in the list's order.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from producer.ops.status import ShardAccess
from producer.protocol import codec, keys
from producer.protocol.errors import WireFormatError
from producer.redisio.shards import read_shards
from producer.redisio.topology import Topology

__all__ = [
    "PAGE_SIZE",
    "ReplayReport",
    "Resent",
    "ShardReplay",
    "Skipped",
    "replay",
]

#: Dead letters read, and re-sent in one MULTI, per round trip.
PAGE_SIZE = 256


@dataclass(frozen=True, slots=True)
class Resent:
    """A dead letter sent again: its entry, the old and the new request id, the new entry."""

    dead_entry: str
    old_rid: str | None
    rid: str
    entry_id: str | None  # None on a dry run
    reply_removed: bool = False
    tag: str = ""  # the shard: its dead letter's, and the re-sent request's stream


@dataclass(frozen=True, slots=True)
class Skipped:
    """A dead letter left as it was, and why."""

    dead_entry: str
    rid: str | None
    reason: str
    tag: str = ""


@dataclass(frozen=True, slots=True)
class ShardReplay:
    """What one replay did on one shard."""

    tag: str
    dead_key: str
    stream_key: str
    examined: int
    resent: int
    skipped: int


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What one replay did, over all shards (``shards``: each one's counts). ``dead_key`` and
    ``stream_key`` name the one shard's keys, or list every shard's."""

    model: str
    prefix: str
    dead_key: str
    stream_key: str
    same_ids: bool
    delete: bool
    dry_run: bool
    examined: int
    resent: tuple[Resent, ...] = field(default=())
    skipped: tuple[Skipped, ...] = field(default=())
    shards: tuple[ShardReplay, ...] = field(default=())

    @property
    def deleted(self) -> int:
        """Dead letters removed (``delete`` and not a dry run)."""
        return len(self.resent) if self.delete and not self.dry_run else 0


def _new_rid() -> str:
    return uuid.uuid4().hex


@dataclass(slots=True)
class _Plan:
    dead_entry: str
    old_rid: str | None
    rid: str
    body: bytes
    remove_reply: bool = False


def replay(
    conn: redis.Redis,
    model: str,
    prefix: str = keys.DEFAULT_PREFIX,
    *,
    same_ids: bool = False,
    limit: int | None = None,
    delete: bool = False,
    dry_run: bool = False,
    new_rid: Callable[[], str] = _new_rid,
    retry_s: float = 0.0,
    topology: Topology | None = None,
) -> ReplayReport:
    """Re-send up to ``limit`` dead letters of ``model``, shard by shard, retrying each step
    through an outage for up to ``retry_s``; Redis errors raise ConnectionFailed.

    A page's MULTI that ran but whose answer was lost is sent again on retry: its requests are
    queued twice under the same ids (at-least-once; a worker writes one reply per id)."""
    access = ShardAccess(conn, retry_s, topology)
    resent: list[Resent] = []
    skipped: list[Skipped] = []
    shards: list[ShardReplay] = []
    examined = 0
    try:
        if topology is None:
            access.refresh()
        tags = access.on(model, read_shards, prefix, model).serve
        for tag in tags:
            left = None if limit is None else limit - examined
            if left is not None and left <= 0:  # listed anyway: the report names every shard
                dead, stream = keys.dead_key(prefix, tag), keys.request_stream(prefix, tag)
                shards.append(ShardReplay(tag, dead, stream, 0, 0, 0))
                continue
            part = _replay_shard(
                access, prefix, tag, same_ids, left, delete, dry_run, new_rid, resent, skipped
            )
            examined += part.examined
            shards.append(part)
    finally:
        access.close()
    return ReplayReport(
        model=model,
        prefix=prefix,
        dead_key=", ".join(s.dead_key for s in shards) or keys.dead_key(prefix, model),
        stream_key=", ".join(s.stream_key for s in shards) or keys.request_stream(prefix, model),
        same_ids=same_ids,
        delete=delete,
        dry_run=dry_run,
        examined=examined,
        resent=tuple(resent),
        skipped=tuple(skipped),
        shards=tuple(shards),
    )


def _replay_shard(
    access: ShardAccess,
    prefix: str,
    tag: str,
    same_ids: bool,
    limit: int | None,
    delete: bool,
    dry_run: bool,
    new_rid: Callable[[], str],
    resent: list[Resent],
    skipped: list[Skipped],
) -> ShardReplay:
    """One shard's dead letters, page by page, on the node serving it."""
    dead_key = keys.dead_key(prefix, tag)
    stream_key = keys.request_stream(prefix, tag)
    examined = 0
    sent_before, skipped_before = len(resent), len(skipped)
    newest = access.on(tag, _newest, dead_key)
    if newest is not None:
        end, start = newest, "-"
        taken: set[str] = set()
        while limit is None or examined < limit:
            count = PAGE_SIZE if limit is None else min(PAGE_SIZE, limit - examined)
            page = access.on(tag, _page, dead_key, start, end, count)
            if not page:
                break
            examined += len(page)
            start = "(" + _text(page[-1][0])
            plans = _plan_page(page, same_ids, new_rid, taken, skipped, tag)
            if same_ids:
                plans = access.on(tag, _check_replies, prefix, tag, plans, skipped)
            resent += access.on(
                tag, _send, stream_key, dead_key, prefix, tag, plans, delete, dry_run
            )
            if _text(page[-1][0]) == end:
                break
    return ShardReplay(
        tag,
        dead_key,
        stream_key,
        examined,
        resent=len(resent) - sent_before,
        skipped=len(skipped) - skipped_before,
    )


def _newest(conn: redis.Redis, dead_key: str) -> str | None:
    newest = conn.xrevrange(dead_key, "+", "-", count=1)
    return _text(newest[0][0]) if newest else None


def _page(conn: redis.Redis, dead_key: str, start: str, end: str, count: int) -> Any:
    return conn.xrange(dead_key, start, end, count=count)


def _plan_page(
    page: Sequence[tuple[Any, Mapping[Any, Any] | None]],
    same_ids: bool,
    new_rid: Callable[[], str],
    taken: set[str],
    skipped: list[Skipped],
    tag: str = "",
) -> list[_Plan]:
    """What to send for each dead letter of a page; the others go to ``skipped``."""
    plans = []
    for raw_id, raw_fields in page:
        entry = _text(raw_id)
        fields = {_text(k): v for k, v in (raw_fields or {}).items()}
        old = _rid(fields.get("rid"))
        shown = old if old is not None else _shown_rid(fields.get("rid"))
        body = fields.get("body")
        if not isinstance(body, bytes):
            skipped.append(Skipped(entry, shown, "no body field: nothing to send", tag))
            continue
        if not same_ids:
            plans.append(_Plan(entry, shown, new_rid(), body))
            continue
        if old is None:
            reason = (
                "no rid field; use --new-ids"
                if fields.get("rid") is None
                else "rid does not match [A-Za-z0-9_.:-]{1,128}; use --new-ids"
            )
            skipped.append(Skipped(entry, shown, reason, tag))
        elif old in taken:
            skipped.append(Skipped(entry, old, "rid already re-sent by this replay", tag))
        else:
            taken.add(old)
            plans.append(_Plan(entry, old, old, body))
    return plans


def _check_replies(
    conn: redis.Redis, prefix: str, tag: str, plans: list[_Plan], skipped: list[Skipped]
) -> list[_Plan]:
    """With same ids: an old error reply is to be removed; an ok or unreadable one blocks."""
    if not plans:
        return plans
    pipe = conn.pipeline(transaction=False)
    for plan in plans:
        pipe.lindex(keys.reply_key(prefix, tag, plan.rid), 0)
    kept = []
    for plan, raw in zip(plans, pipe.execute(), strict=True):
        if raw is None:
            kept.append(plan)
            continue
        try:
            reply = codec.decode_reply(raw)
        except WireFormatError:
            skipped.append(
                Skipped(plan.dead_entry, plan.rid, "its reply key holds an unreadable reply", tag)
            )
            continue
        if reply.ok:
            skipped.append(
                Skipped(
                    plan.dead_entry,
                    plan.rid,
                    "already answered ok; --new-ids runs it again without losing that answer",
                    tag,
                )
            )
            continue
        plan.remove_reply = True
        kept.append(plan)
    return kept


def _send(
    conn: redis.Redis,
    stream_key: str,
    dead_key: str,
    prefix: str,
    tag: str,
    plans: list[_Plan],
    delete: bool,
    dry_run: bool,
) -> list[Resent]:
    """One MULTI per page: remove old replies, add the requests, delete the dead letters."""
    if dry_run or not plans:
        return [Resent(p.dead_entry, p.old_rid, p.rid, None, p.remove_reply, tag) for p in plans]
    pipe = conn.pipeline(transaction=True)
    positions = []
    for plan in plans:
        if plan.remove_reply:
            pipe.delete(keys.reply_key(prefix, tag, plan.rid))
        positions.append(len(pipe.command_stack))
        pipe.xadd(stream_key, {"rid": plan.rid, "body": plan.body})
        if delete:
            pipe.xdel(dead_key, plan.dead_entry)
    results = pipe.execute()
    return [
        Resent(p.dead_entry, p.old_rid, p.rid, _text(results[i]), p.remove_reply, tag)
        for p, i in zip(plans, positions, strict=True)
    ]


def _rid(value: Any) -> str | None:
    """The dead letter's request id when it is one a key may be built from."""
    if not isinstance(value, bytes):
        return None
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if keys.is_valid_rid(text) else None


def _shown_rid(value: Any) -> str | None:
    if value is None:
        return None
    text = _text(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _text(value: Any) -> str:
    """Bytes from Redis as text, bytes that are not UTF-8 as ``\\xNN`` (as ``status`` shows
    them)."""
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)
