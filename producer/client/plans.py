"""Each client call's logic, written once: plans that say which Redis commands to run, and when.

A plan is a generator. It yields a step (``producer.client.steps``: ``Call``, one redis-py
command; ``Batch``, many commands in a round trip per node; ``Sleep``; ``Send`` and ``Pop``, a
submit and one call's BLPOP) and gets back the step's answer, or has its error raised where it
yielded. ``Client`` takes each step with blocking calls and ``AsyncClient`` with ``await``; the
asyncio shell also shares the ``Send`` and ``Pop`` steps of concurrent calls
(``producer.client.coalesce``). Every call runs the same plan in both shells, so both behave the
same, sending again after an outage included. A plan that streams (``drain``, ``run_map``) also
yields its Results or Chunks, which the shell hands to its caller.

Why generators: the state that outlives a step lives in objects (``ReplyWaiter``, ``MapPlan``,
``BacklogGate``, ``MemoryWatch``); what is left is sequencing: wait for room, send, pop, send
again after an interruption, and cancel on the way out, with loops, ``try``/``finally`` and
errors that change the course (Redis refusing a submit for memory). As explicit states that
would be a class per call, read out of order; a generator reads top to bottom and is the one
construct that both a blocking and an asyncio driver can suspend at each command. It costs a
generator step per Redis command, never per request; hot-path commands stay packed by hand.

Shards (contract section 1): every command names the shard tag whose node runs it. Submits
read the model's shard list first (``ShardSpread``: lazily, then every ``shards.REFRESH_S``)
and spread their requests over it, each shard's in transactions of its own (one per 256
requests: a transaction never spans two slots); the backlog is the sum of ``XLEN`` over the
shards served. A wait pops each shard's keys with a pipelined ``LPOP`` and blocks on one
shard's keys at a time (``ReplyWaiter``). On a single Redis a batch's parts for all shards share
one round trip; on a cluster the blocking shell sends every node's part before reading any
answer, and the asyncio shell sends them concurrently.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from producer.client import steps
from producer.client.backlog import BacklogGate
from producer.client.mapwindow import MapPlan
from producer.client.results import Result, parse_reply
from producer.client.session import Session
from producer.client.settings import INFER_LIMIT, check_timeout_s
from producer.client.steps import Batch, Call, Plan, Send, Sleep
from producer.client.submission import Submission, build_submission, build_submissions
from producer.client.waiting import ReplyWaiter, Target
from producer.client.workers import WorkerRoster, check_rows_per_request, row_limit
from producer.protocol.errors import (
    BacklogFull,
    RedbatchError,
    RedisFull,
    RedisUnavailable,
    WaitTimeout,
)
from producer.redisio.connection import block_s
from producer.redisio.memory import parse_info_memory
from producer.redisio.retry import RetryPolicy
from producer.redisio.shards import Shards

__all__ = [
    "backlog",
    "cancel",
    "drain",
    "fit_and_run_map",
    "fit_rows",
    "infer",
    "outputs",
    "poll",
    "request",
    "requests",
    "resend",
    "run_map",
    "send",
    "shared_blpop",
    "shared_lpop",
    "submit",
    "unsent",
    "wait",
    "wait_round",
    "workers",
]

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# The shard list


def _shards(session: Session, retry: RetryPolicy) -> Plan[Shards]:
    """The model's shards: read at first use, then again once ``shards.REFRESH_S`` old (the
    callers check ``spread.stale`` first: no generator on the hot path)."""
    spread = session.spread
    (found,) = yield Batch("LRANGE", retry, [steps.shard_list(session)])
    spread.seen(found, time.monotonic())
    return spread.shards


# ---------------------------------------------------------------------------------------------
# Submitting


def request(
    inputs: Mapping[str, ArrayLike],
    outputs: Sequence[str] | None,
    deadline_s: float | None,
    meta: Any,
    rid: str | None,
    reply_ttl_s: int | None,
) -> Submission:
    """One request, its ``deadline_s`` counted from now."""
    return build_submission(
        inputs,
        outputs=outputs,
        deadline_s=deadline_s,
        meta=meta,
        rid=rid,
        reply_ttl_s=reply_ttl_s,
        now_s=time.time(),
    )


def requests(
    many: Sequence[Mapping[str, ArrayLike]],
    outputs: Sequence[str] | None,
    deadline_s: float | None,
    meta: Any,
    reply_ttl_s: int | None,
) -> list[Submission]:
    """Many requests sharing their options, each with a new rid."""
    return build_submissions(
        many,
        outputs=outputs,
        deadline_s=deadline_s,
        meta=meta,
        reply_ttl_s=reply_ttl_s,
        now_s=time.time(),
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
            yield from _shards(session, session.retry.until(until, INFER_LIMIT))
        while True:
            while (delay_s := (yield from _no_room_s(session, gate, until))) is not None:
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
            session.memory.sent(sum(len(sub.body) for sub in subs))
            return xadd.tries - tried > 1  # this attempt (not a refusal for memory) retried
    finally:
        session.backlog_seen = session.full_seen = None
        if accepted is not None and xadd is not None:
            accepted.extend(sub for part in xadd.parts if part.done for sub in part.items)


def _no_room_s(session: Session, gate: BacklogGate, until: float | None) -> Plan[float | None]:
    """None when the backlog and Redis memory leave room; else how long to sleep before looking
    again (or the gate raises BacklogFull or RedisFull). Notes what holds the send up."""
    if gate.active:
        backlog = yield from _backlog(session, until)
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


def _backlog(session: Session, until: float | None) -> Plan[int]:
    """The model's backlog: the sum of ``XLEN`` over the shards it has (listed and retiring),
    checked against ``max_backlog`` as one figure, as ``redbatch status`` and the scalers
    see it."""
    retry = session.retry.until(until, INFER_LIMIT)
    return sum((yield steps.xlen(session, session.spread.shards.serve, retry)))


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
        yield steps.xadd(session, session.spread.assign(subs), retry)


# ---------------------------------------------------------------------------------------------
# Waiting for replies


def _retry_for(session: Session, waiter: ReplyWaiter) -> RetryPolicy:
    """For ``wait`` and ``wait_many``, retries end at the first deadline (RedisUnavailable then,
    not later). map() keeps the client's: its late requests fail one by one and the others carry
    on, so a short outage near one deadline must not end them all."""
    if waiter.late_fails:
        return session.retry
    return session.retry.within(waiter.time_left(time.monotonic()), _limit(waiter))


def _limit(waiter: ReplyWaiter) -> str:
    """What bounds a wait's retries, as its RedisUnavailable names it."""
    return f"the wait's timeout_s={waiter.timeout_s:g}"


def _pop(waiter: ReplyWaiter, pop: Call | Batch) -> Plan[Any]:
    """A consuming pop (LPOP, BLPOP). One that needed a retry may have taken a reply whose answer
    was lost with its connection: ``waiter.interrupted`` then says so, and the plan sends again
    the requests it has the bodies of."""
    try:
        return (yield pop)
    finally:
        waiter.interrupted = waiter.interrupted or pop.tries > 1


def wait_round(session: Session, waiter: ReplyWaiter) -> Plan[list[Result]]:
    """One pipelined LPOP over every awaited key (per shard); if none was ready, one BLPOP
    over one shard's keys."""
    by_tag = waiter.by_shard()
    answers = yield from _pop(waiter, steps.lpop(session, by_tag, _retry_for(session, waiter)))
    results = waiter.take_popped(*steps.popped(by_tag, answers))
    if results:
        return results
    item = yield from _pop(waiter, steps.blpop(session, waiter, _retry_for(session, waiter)))
    return waiter.take_blpopped(item, time.monotonic())


def drain(session: Session, waiter: ReplyWaiter) -> Plan[None]:
    """``wait_many``: yields each Result as it arrives."""
    while waiter.pending:
        results = yield from wait_round(session, waiter)
        yield from results


def wait(
    session: Session,
    target: Target,
    timeout_s: float,
    since: float,
    sent: Submission | None = None,
) -> Plan[Result]:
    """``wait`` for ``target`` (tag, rid), its ``timeout_s`` counted from ``since``
    (monotonic). ``sent``, the request itself (``infer``), is sent again after an
    interruption."""
    waiter = ReplyWaiter(session.settings, timeout_s)
    tag, rid = target
    key = waiter.add(rid, since, tag)
    until, limit = waiter.deadline, _limit(waiter)
    while True:
        # Its retry policy is built only if the shell runs this BLPOP itself (Pop.bounded). The
        # hot path of every wait and infer: ``_pop``'s bookkeeping inline, one generator fewer.
        pop = steps.pop_reply(session, key, tag, until, limit)
        item = yield pop
        waiter.interrupted = waiter.interrupted or pop.tries > 1
        results = waiter.take_blpopped(item, time.monotonic())
        if results:
            return results[0]
        if sent is not None and waiter.interrupted:
            waiter.interrupted = False
            yield from resend(session, [sent], _retry_for(session, waiter))


def submit(subs: Sequence[Submission], until: float | None = None) -> Plan[None]:
    """``submit`` and ``submit_many``: one ``Send`` (see ``send``)."""
    yield Send(subs, until)


def infer(
    session: Session, sub: Submission, timeout_s: float, started: float
) -> Plan[dict[str, np.ndarray]]:
    """``infer``: submit, then ``wait``; the whole call ends within ``timeout_s`` of
    ``started``."""
    yield Send([sub], started + check_timeout_s(timeout_s))
    return outputs((yield from wait(session, (sub.tag, sub.rid), timeout_s, started, sent=sub)))


def outputs(result: Result) -> dict[str, np.ndarray]:
    """An ``infer``'s answer: the outputs, or the typed RequestFailed subclass raised."""
    result.raise_for_error()
    return result.outputs or {}


def shared_blpop(
    session: Session, tag: str, keys_: list[bytes], until: float
) -> Plan[tuple[Any, bool]]:
    """A BLPOP over keys of shard ``tag`` that serves many calls' ``Pop`` steps
    (``coalesce.ReplyHub``): its retries end at ``until``, the first waiting call's deadline
    (RedisUnavailable then, which fails the calls whose time is up), not later. Returns the
    answer, and whether it needed a retry (a reply it popped may have been lost)."""
    retry = session.retry.within(until - time.monotonic(), "the waiting call's timeout")
    cap_s = session.block_cap_s
    call = Call(
        "BLPOP", lambda r: r.blpop(keys_, block_s(until, time.monotonic(), cap_s)), retry, tag
    )
    item = yield call
    return item, call.tries > 1


def shared_lpop(session: Session, tag: str, keys_: list[bytes]) -> Plan[list[Any]]:
    """The sweep of shard ``tag`` after a shared BLPOP's answer: one try, as the next BLPOP
    covers a miss."""
    (popped,) = yield steps.lpop(session, {tag: keys_}, session.retry.once())
    return list(popped)


def poll(
    session: Session, target: Target, kept: Callable[[bytes], Any] | None = None
) -> Plan[Result | None]:
    """The reply of ``target`` (tag, rid) if it has arrived, else None; ``kept`` finds one the
    client popped for a wait that gave up on it."""
    tag, rid = target
    key = session.settings.reply_key(rid, tag)
    raw = None if kept is None else kept(key.encode())
    if raw is None:
        raw = yield Call("LINDEX", lambda r: r.lindex(key, 0), session.retry, tag)
    return None if raw is None else parse_reply(rid, raw, tag)


# ---------------------------------------------------------------------------------------------
# map


def fit_rows(session: Session, plan: MapPlan) -> Plan[None]:
    """Give ``plan`` the live workers' row limit, or check the caller's against it."""
    if plan.needs_row_limit:
        plan.use_row_limit(row_limit((yield from workers(session)), session.settings))
    elif plan.has_rows:
        check_rows_per_request(plan.rows_per_request, (yield from workers(session)))


def run_map(session: Session, plan: MapPlan) -> Plan[None]:
    """map(): yields its Chunks in input order; see ``BaseClient.map``. Each refill of the
    window is one send: its requests split evenly over the shards, one transaction each."""
    waiter = plan.waiter
    try:
        while not plan.finished:
            subs = plan.take(time.time())
            if subs:
                accepted: list[Submission] = []
                try:
                    if (yield from send(session, subs, accepted=accepted)):
                        waiter.interrupted = True  # earlier acknowledged requests may be lost
                except RedisFull as exc:  # stop sending; what is in flight is still awaited
                    plan.sent(accepted, time.monotonic())
                    took = {sub.rid for sub in accepted}
                    plan.refused([sub for sub in subs if sub.rid not in took], exc)
                else:
                    plan.sent(subs, time.monotonic())
                finally:
                    plan.routed(subs)  # cancels go to each one's shard, whatever happened
            yield from plan.ready()
            if waiter.pending:
                plan.answered((yield from wait_round(session, waiter)), time.monotonic())
                yield from cancel(session, waiter.late)
                waiter.late.clear()
            if waiter.interrupted:
                waiter.interrupted = False
                yield from resend(session, plan.awaited(time.time()), session.retry)
        if plan.refusal is not None:
            raise plan.refusal
    finally:
        # The caller stopped early, or Redis failed: run nothing more (late requests too, when
        # the stop came between giving up on them and cancelling them).
        unanswered = [*plan.in_flight, *waiter.late]
        if unanswered:
            with contextlib.suppress(RedbatchError):
                yield from cancel(session, unanswered, retry=session.retry.once())


def fit_and_run_map(session: Session, plan: MapPlan) -> Plan[None]:
    """``run_map`` that first looks the workers up (``fit_rows``): AsyncClient's map(), which
    raises NoWorkerInfo on first use rather than at the call."""
    yield from fit_rows(session, plan)
    yield from run_map(session, plan)


# ---------------------------------------------------------------------------------------------
# Control and status


def cancel(
    session: Session,
    targets: Sequence[Target],
    ttl_s: int = 3600,
    retry: RetryPolicy | None = None,
) -> Plan[None]:
    """Set the cancel key of each of ``targets`` (tag, rid) for ``ttl_s`` seconds, in its
    shard's slot."""
    if targets:
        by_tag: dict[str, list[str]] = {}
        for tag, rid in targets:
            by_tag.setdefault(tag, []).append(session.settings.cancel_key(rid, tag))
        parts = [steps.cancel_part(tag, ks, ttl_s) for tag, ks in by_tag.items()]
        yield Batch("SET", retry or session.retry, parts)


def backlog(session: Session) -> Plan[int]:
    """Entries in the model's request streams, summed over its shards: queued plus in
    progress."""
    if session.spread.stale(time.monotonic()):
        yield from _shards(session, session.retry)
    return (yield from _backlog(session, None))


def workers(session: Session) -> Plan[list[dict[str, Any]]]:
    """The live workers' validation records, by name; forgets workers whose record expired."""
    settings, retry = session.settings, session.retry
    key = settings.workers_key
    members = yield Call("SMEMBERS", lambda r: r.smembers(key), retry)
    roster = WorkerRoster.from_members(settings, members)
    raws = []
    if roster.record_keys:
        raws = yield Call("MGET", lambda r: r.mget(roster.record_keys), retry)
    records, stale = roster.read(raws)
    if stale:
        yield Call("SREM", lambda r: r.srem(key, *stale), retry)
    return records
