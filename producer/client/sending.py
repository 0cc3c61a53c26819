"""Sending requests: what a submit checks before it sends, and the ``XADD`` itself.

- ``admit``: a body Redis or the workers would refuse raises ``TooLarge`` at once, before
  anything is sent (``producer.client.limits``: Redis's ``proto-max-bulk-len`` and the live
  workers' ``max_request_bytes``, read lazily and cached). It runs in each call's own plan,
  before its ``Send`` step, so in ``AsyncClient`` an oversized call never shares a round trip
  with concurrent ones: Redis would close that connection, failing them all.
- ``send``: waits for room (the backlog and Redis memory), then the ``XADD``s, each to its
  shard. An ``XADD`` refused because the stream's id space is used up (someone added the
  largest possible id) raises ``StreamExhausted`` at once.

The plans of ``producer.client.plans`` use these (and re-export them); see that module for
how plans and shells work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis.exceptions as rex
from numpy.typing import ArrayLike

from producer.client import lanes, lanesend, steps
from producer.client.backlog import BacklogGate
from producer.client.lanes import LaneChoice
from producer.client.session import Session
from producer.client.settings import INFER_LIMIT
from producer.client.steps import Batch, Call, Plan, Shared, Sleep
from producer.client.submission import (
    Submission,
    build_submission,
    build_submissions,
    is_exhausted,
    stream_exhausted,
)
from producer.client.workers import read_workers
from producer.protocol import keys
from producer.protocol.errors import (
    BacklogFull,
    ConnectionFailed,
    Misconfigured,
    RedbatchError,
    RedisFull,
    RedisUnavailable,
    WaitTimeout,
)
from producer.redisio.bulklimit import parse_bulk_limit
from producer.redisio.memory import parse_info_memory
from producer.redisio.retry import RetryPolicy
from producer.redisio.shards import Shards

__all__ = [
    "admit",
    "read_backlog",
    "read_bulk_limit",
    "read_limits",
    "read_shards",
    "request",
    "requests",
    "resend",
    "send",
    "unread",
    "unsent",
]

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# The shard list


def read_shards(session: Session, retry: RetryPolicy) -> Plan[Shards]:
    """The model's shards: read at first use, then again once ``shards.REFRESH_S`` old (the
    callers check ``spread.stale`` first: no generator on the hot path)."""
    spread = session.spread
    (found,) = yield Batch("LRANGE", retry, [steps.shard_list(session)])
    spread.seen(found, time.monotonic())
    return spread.shards


# ---------------------------------------------------------------------------------------------
# The largest body


def admit(session: Session, subs: Sequence[Submission], until: float | None = None) -> Plan[None]:
    """Raise ``TooLarge`` for a body over the limits (``BodyLimit.check``: none of ``subs`` is
    sent then), reading the limits first when they are due (``Shared``: concurrent calls of
    ``AsyncClient`` read them once). ``until`` (monotonic) bounds the reading's retries, as an
    ``infer``'s timeout does its submit."""
    limits = session.limits
    if limits.due(time.monotonic()):
        yield Shared("limits", lambda retry: read_limits(session, retry), until, INFER_LIMIT)
    limits.check(subs)


def read_limits(session: Session, retry: RetryPolicy) -> Plan[None]:
    """Read what bounds a body: ``proto-max-bulk-len`` (once per client) and the live workers'
    ``max_request_bytes``. A user refused the workers' records keeps what it knew."""
    limits = session.limits
    if limits.reading(time.monotonic()):
        yield from read_bulk_limit(session, retry)
    try:
        records = yield from read_workers(session, retry)
    except ConnectionFailed as exc:
        if not _refused(exc):
            raise
        return
    limits.workers_seen(records, time.monotonic())


def read_bulk_limit(session: Session, retry: RetryPolicy) -> Plan[None]:
    """Read ``proto-max-bulk-len`` from the model's first shard's node. A user refused
    ``CONFIG GET`` (the documented producer role is: ``CONFIG GET`` would show it secrets)
    assumes Redis's default."""
    model = session.settings.model
    try:
        answer = yield Call("CONFIG", lambda r: r.config_get("proto-max-bulk-len"), retry, model)
    except ConnectionFailed as exc:
        if not _refused(exc):
            raise
        answer = None
    session.limits.bulk_seen(parse_bulk_limit(answer))


def unread(session: Session, limit: str) -> RedbatchError:
    """The error of a call whose time (``limit``) ran out while it waited for a reading that
    another call started (``Shared``)."""
    if session.retry.outage.active:
        return RedisUnavailable(
            f"Redis at {session.where} stayed unavailable past {limit}, while the client read "
            "its limits; the request was not sent."
        )
    return WaitTimeout(
        f"{limit} ran out while the client read its limits; the request was not sent."
    )


def _refused(exc: ConnectionFailed) -> bool:
    """True when Redis refused the command itself (no permission, an unknown or renamed
    command): a reading to do without, unlike an outage or a misconfigured connection."""
    if isinstance(exc, (RedisUnavailable, Misconfigured)):
        return False
    return isinstance(exc.__cause__, rex.ResponseError)


# ---------------------------------------------------------------------------------------------
# Submitting


def request(
    inputs: Mapping[str, ArrayLike],
    outputs: Sequence[str] | None,
    deadline_s: float | None,
    meta: Any,
    rid: str | None,
    reply_ttl_s: int | None,
    lane: LaneChoice | None = None,
) -> Submission:
    """One request, its ``deadline_s`` counted from now, to ``lane`` (``lanes.choose``)."""
    return build_submission(
        inputs,
        outputs=outputs,
        deadline_s=deadline_s,
        meta=meta,
        rid=rid,
        reply_ttl_s=reply_ttl_s,
        now_s=time.time(),
        lane=lane,
    )


def requests(
    many: Sequence[Mapping[str, ArrayLike]],
    outputs: Sequence[str] | None,
    deadline_s: float | None,
    meta: Any,
    reply_ttl_s: int | None,
    lane: LaneChoice | None = None,
) -> list[Submission]:
    """Many requests sharing their options and lane, each with a new rid."""
    return build_submissions(
        many,
        outputs=outputs,
        deadline_s=deadline_s,
        meta=meta,
        reply_ttl_s=reply_ttl_s,
        now_s=time.time(),
        lane=lane,
    )


def send(
    session: Session,
    subs: Sequence[Submission],
    until: float | None = None,
    accepted: list[Submission] | None = None,
) -> Plan[bool]:
    """XADD ``subs`` once the backlog and Redis memory allow, each to its shard (one chosen by
    ``ShardSpread`` for those without). ``until`` (monotonic), an ``infer``'s deadline, ends
    the wait (BacklogFull, RedisFull) and the retries (RedisUnavailable). ``accepted`` gets
    the submissions in Redis when the send ends, also when it fails (a shard that had room
    took its part, which is never sent again).

    Returns True when the XADDs needed a retry: Redis went away meanwhile, and what it had
    acknowledged before may be gone with it (a master failed over before its replica had the
    writes: replication is asynchronous), so a caller awaiting earlier requests sends them
    again (``resend``)."""
    settings = session.settings
    gate = BacklogGate(settings.max_backlog, settings.wait_for_backlog, until)
    xadd: Batch | None = None
    try:
        if session.spread.stale(time.monotonic()):
            yield from read_shards(session, session.retry.until(until, INFER_LIMIT))
        while True:
            while (delay_s := (yield from _no_room_s(session, gate, until, subs))) is not None:
                yield Sleep(delay_s)
            retry = session.retry.until(until, INFER_LIMIT)
            if xadd is None:
                xadd = steps.xadd(session, session.spread.assign(subs), retry)
            else:  # after a refusal for memory: the parts not yet in Redis, on a fresh budget
                xadd.retry = retry
            tried = xadd.tries
            try:
                yield xadd
            except RedisFull as exc:  # Redis's own OOM: past the watermark between readings
                session.full_seen = session.memory.refused(exc.refused or "")
                yield Sleep(gate.refused(session.full_seen, time.monotonic()))
                continue
            except ConnectionFailed as exc:
                raise _xadd_refusal(session, xadd, exc) from exc.__cause__
            session.memory.sent(sum(len(sub.body) for sub in subs))
            return xadd.tries - tried > 1  # this attempt (not a refusal for memory) retried
    finally:
        session.backlog_seen = session.full_seen = None
        if accepted is not None and xadd is not None:
            accepted.extend(sub for part in xadd.parts if part.done for sub in part.items)


def _no_room_s(
    session: Session, gate: BacklogGate, until: float | None, subs: Sequence[Submission]
) -> Plan[float | None]:
    """None when the backlog of the lanes ``subs`` go to and Redis memory leave room; else how
    long to sleep before looking again (or the gate raises BacklogFull or RedisFull). Notes
    what holds the send up."""
    if gate.active:
        backlog = yield from read_backlog(session, until, _lanes_of(subs))
        delay_s = gate.delay_s(backlog, time.monotonic())
        if delay_s is not None:
            session.backlog_seen = backlog
            return delay_s
    memory = session.memory
    if memory.stale(time.monotonic()):
        # Each shard's node (on a cluster each master has its own memory), the fullest counts
        retry = session.retry.until(until, INFER_LIMIT)
        readings = []
        for tag in session.spread.shards.send:
            info = yield Call("INFO", session.info_memory, retry, tag)
            if info is None:
                memory.cannot_read()
                break
            readings.append(parse_info_memory(info))
        else:
            memory.seen(memory.tightest(readings), time.monotonic())
    session.full_seen = memory.full()
    if session.full_seen is None:
        return None
    return gate.refused(session.full_seen, time.monotonic())


def read_backlog(
    session: Session, until: float | None, lanes_: Sequence[LaneChoice | None] = (None,)
) -> Plan[int]:
    """A lane's backlog: the sum of its streams' ``XLEN`` over the shards the model has
    (listed and retiring), checked against ``max_backlog`` as one figure, as ``redbatch
    status`` and the scalers see it; the fullest of ``lanes_`` (default: the default lane,
    ``P:{T}:requests``). Only those lanes' streams are read: a role confined to a tenant may
    read no other."""
    retry = session.retry.until(until, INFER_LIMIT)
    tags = session.spread.shards.serve
    lengths = yield steps.xlen(session, tags, retry, lanes_)
    if len(lanes_) == 1:
        return sum(lengths)
    n = len(tags)
    return max(sum(lengths[i : i + n]) for i in range(0, len(lengths), n))


def _lanes_of(subs: Sequence[Submission]) -> Sequence[LaneChoice | None]:
    """The lanes ``subs`` go to (one, but for the asyncio client's concurrent submits)."""
    first = subs[0].lane if subs else None
    if all(sub.lane is first for sub in subs):
        return (first,)
    return list(lanesend.by_lane(subs))


def unsent(session: Session) -> RedbatchError:
    """The error of an ``infer`` whose timeout_s ran out while its submit waited behind an
    earlier one: the cause that held that one up, as if the infer had met it itself."""
    settings = session.settings
    if session.backlog_seen is not None and settings.max_backlog is not None:
        return BacklogFull(session.backlog_seen, settings.max_backlog, waited=True)
    if session.full_seen is not None:
        return session.full_seen.waited_out()
    if session.retry.outage.active:
        return RedisUnavailable(
            f"Could not talk to Redis at {session.where} within {INFER_LIMIT}, while "
            "an earlier submit was retrying; the request was not sent."
        )
    return WaitTimeout(
        f"{INFER_LIMIT} ran out while an earlier submit was being sent; the request was not sent."
    )


def resend(session: Session, subs: Sequence[Submission], retry: RetryPolicy) -> Plan[None]:
    """Send awaited requests again, same rids and shards, after a command needed a retry: a
    reply popped in flight was lost with its connection, or a Redis restarted without
    persistence forgot the stream. A worker answers a copy whose reply is gone (and one whose
    reply was read meanwhile: that reply expires unread), and writes nothing for one whose
    reply is still there. No backlog gate: these are counted in it, or were lost."""
    if subs:
        log.info("sending %d awaited request(s) again after a Redis interruption", len(subs))
        xadd = steps.xadd(session, session.spread.assign(subs), retry)
        try:
            yield xadd
        except ConnectionFailed as exc:
            raise _xadd_refusal(session, xadd, exc) from exc.__cause__


def _xadd_refusal(session: Session, xadd: Batch, exc: ConnectionFailed) -> ConnectionFailed:
    """``exc``, or ``StreamExhausted`` when Redis refused the XADD because the stream's id
    space is used up (not retried: nothing passes until an operator repairs the stream)."""
    if not is_exhausted(exc.__cause__):
        return exc
    part = next((part for part in xadd.parts if not part.done), None)
    if part is None or not part.items:
        stream = keys.request_stream(session.settings.prefix, session.settings.model)
    else:  # the lane of its first submission: a part holds more than one only in AsyncClient
        stream = lanes.stream_of(session.settings.prefix, part.tag, part.items[0].lane)
    return stream_exhausted(session.where, stream)
