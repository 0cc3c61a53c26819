"""Each client call's logic, written once: plans that say which Redis commands to run, and when.

A plan is a generator. It yields a step (``producer.steps``: ``Call``, one redis-py command;
``Batch``, many commands in one round trip; ``Sleep``) and gets back the step's answer, or has
its error raised where it yielded. ``Client`` takes each step with blocking calls and
``AsyncClient`` with ``await``; that, the coalescing of concurrent calls (``producer.coalesce``)
and the connections' lifetime is all the shells do. A plan that streams (``drain``,
``run_map``) also yields its Results or Chunks, which the shell hands to its caller.

Why generators, when ``window.MapPlan`` and ``core.BacklogGate`` are state machines: the state
that outlives a step already lives in such objects (``ReplyWaiter``, ``MapPlan``,
``BacklogGate``, ``MemoryWatch``); what is left is sequencing: wait for room, send, pop, send
again after an interruption, and cancel on the way out, with loops, ``try``/``finally`` and
errors that change the course (Redis refusing a submit for memory). As explicit states that
would be a class per call, read out of order; a generator reads top to bottom and is the one
construct that both a blocking and an asyncio driver can suspend at each command. It costs a
generator step per Redis command, never per request; hot-path commands stay packed by hand.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from producer import core, window
from producer.base import Session
from producer.connection import block_s
from producer.core import Result, Submission
from producer.errors import BacklogFull, RedbatchError, RedisFull, RedisUnavailable, WaitTimeout
from producer.memory import parse_info_memory
from producer.retry import RetryPolicy
from producer.steps import Batch, Call, Plan, Sleep
from producer.workers import WorkerRoster, check_rows_per_request, row_limit

__all__ = [
    "backlog",
    "cancel",
    "drain",
    "fit_and_run_map",
    "fit_rows",
    "hub_blpop",
    "hub_lpop",
    "infer",
    "outputs",
    "poll",
    "request",
    "requests",
    "resend",
    "run_map",
    "send",
    "unsent",
    "wait",
    "wait_round",
    "workers",
]

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Commands


def _xadd(session: Session, subs: Sequence[Submission], retry: RetryPolicy) -> Batch:
    stream = session.settings.stream

    def queue(pipe: Any) -> None:
        for sub in subs:
            pipe.xadd(stream, sub.fields())

    if not session.packed:
        return Batch("XADD", retry, queue)
    xadds = core.pack_xadds(stream, subs)
    return Batch("XADD", retry, queue, xadds.packer, lambda got: core.check_xadds(xadds, got))


def _lpop(session: Session, keys: Sequence[bytes], retry: RetryPolicy) -> Batch:
    def queue(pipe: Any) -> None:
        for key in keys:
            pipe.lpop(key)

    return Batch("LPOP", retry, queue, core.pack_lpops(keys) if session.packed else None)


def _blpop(session: Session, waiter: window.ReplyWaiter, retry: RetryPolicy) -> Call:
    # The block is worked out per try, so a retry after an outage blocks only what is left.
    cap_s = session.block_cap_s
    return Call(
        "BLPOP", lambda r: r.blpop(waiter.keys(), waiter.block_s(time.monotonic(), cap_s)), retry
    )


def _xlen(session: Session, until: float | None) -> Call:
    stream = session.settings.stream
    return Call("XLEN", lambda r: r.xlen(stream), session.retry.until(until, core.INFER_LIMIT))


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
    return core.build_submission(
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
    return core.build_submissions(
        many,
        outputs=outputs,
        deadline_s=deadline_s,
        meta=meta,
        reply_ttl_s=reply_ttl_s,
        now_s=time.time(),
    )


def send(session: Session, subs: Sequence[Submission], until: float | None = None) -> Plan[None]:
    """XADD ``subs`` once the backlog and Redis memory allow. ``until`` (monotonic), an
    ``infer``'s deadline, ends the wait (BacklogFull, RedisFull) and the retries
    (RedisUnavailable)."""
    settings = session.settings
    gate = core.BacklogGate(settings.max_backlog, settings.wait_for_backlog, until)
    try:
        while True:
            while (delay_s := (yield from _no_room_s(session, gate, until))) is not None:
                yield Sleep(delay_s)
            try:
                yield _xadd(session, subs, session.retry.until(until, core.INFER_LIMIT))
            except RedisFull as exc:  # Redis's own OOM: past the watermark between readings
                session.full_seen = session.memory.refused(exc.refused or "")
                yield Sleep(gate.refused(session.full_seen, time.monotonic()))
                continue
            session.memory.sent(sum(len(sub.body) for sub in subs))
            return
    finally:
        session.backlog_seen = session.full_seen = None


def _no_room_s(session: Session, gate: core.BacklogGate, until: float | None) -> Plan[float | None]:
    """None when the backlog and Redis memory leave room; else how long to sleep before looking
    again (or the gate raises BacklogFull or RedisFull). Notes what holds the send up."""
    if gate.active:
        backlog = int((yield _xlen(session, until)))
        delay_s = gate.delay_s(backlog, time.monotonic())
        if delay_s is not None:
            session.backlog_seen = backlog
            return delay_s
    memory = session.memory
    if memory.stale(time.monotonic()):
        retry = session.retry.until(until, core.INFER_LIMIT)
        info = yield Call("INFO", session.info_memory, retry)
        if info is None:
            memory.cannot_read()
        else:
            memory.seen(parse_info_memory(info), time.monotonic())
    session.full_seen = memory.full()
    if session.full_seen is None:
        return None
    return gate.refused(session.full_seen, time.monotonic())


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
            f"Could not talk to Redis at {session.where} within {core.INFER_LIMIT}, while "
            "an earlier submit was retrying; the request was not sent."
        )
    return WaitTimeout(
        f"{core.INFER_LIMIT} ran out while an earlier submit was being sent; the request "
        "was not sent."
    )


def resend(session: Session, subs: Sequence[Submission], retry: RetryPolicy) -> Plan[None]:
    """Send awaited requests again, same rids, after a command needed a retry: a reply popped in
    flight was lost with its connection, or a Redis restarted without persistence forgot the
    stream. A worker answers a copy whose reply is gone (and one whose reply was read
    meanwhile: that reply expires unread), and writes nothing for one whose reply is still
    there. No backlog gate: these are counted in it, or were lost."""
    if subs:
        log.info("sending %d awaited request(s) again after a Redis interruption", len(subs))
        yield _xadd(session, subs, retry)


# ---------------------------------------------------------------------------------------------
# Waiting for replies


def _retry_for(session: Session, waiter: window.ReplyWaiter) -> RetryPolicy:
    """For ``wait`` and ``wait_many``, retries end at the first deadline (RedisUnavailable then,
    not later). map() keeps the client's: its late requests fail one by one and the others carry
    on, so a short outage near one deadline must not end them all."""
    if waiter.late_fails:
        return session.retry
    limit = f"the wait's timeout_s={waiter.timeout_s:g}"
    return session.retry.within(waiter.time_left(time.monotonic()), limit)


def _pop(waiter: window.ReplyWaiter, pop: Call | Batch) -> Plan[Any]:
    """A consuming pop (LPOP, BLPOP). One that needed a retry may have taken a reply whose answer
    was lost with its connection: ``waiter.interrupted`` then says so, and the plan sends again
    the requests it has the bodies of."""
    try:
        return (yield pop)
    finally:
        waiter.interrupted = waiter.interrupted or pop.tries > 1


def wait_round(session: Session, waiter: window.ReplyWaiter) -> Plan[list[Result]]:
    """One pipelined LPOP over every awaited key; if none was ready, one BLPOP over them."""
    keys = waiter.keys()
    popped = yield from _pop(waiter, _lpop(session, keys, _retry_for(session, waiter)))
    results = waiter.take_popped(keys, popped)
    if results:
        return results
    item = yield from _pop(waiter, _blpop(session, waiter, _retry_for(session, waiter)))
    return waiter.take_blpopped(item, time.monotonic())


def drain(session: Session, waiter: window.ReplyWaiter) -> Plan[None]:
    """``wait_many``: yields each Result as it arrives."""
    while waiter.pending:
        results = yield from wait_round(session, waiter)
        yield from results


def wait(
    session: Session, rid: str, timeout_s: float, since: float, sent: Submission | None = None
) -> Plan[Result]:
    """The blocking client's ``wait``, its ``timeout_s`` counted from ``since`` (monotonic).
    ``sent``, the request itself (``infer``), is sent again after an interruption."""
    waiter = window.ReplyWaiter(session.settings, timeout_s)
    waiter.add(rid, since)
    while True:
        item = yield from _pop(waiter, _blpop(session, waiter, _retry_for(session, waiter)))
        results = waiter.take_blpopped(item, time.monotonic())
        if results:
            return results[0]
        if sent is not None and waiter.interrupted:
            waiter.interrupted = False
            yield from resend(session, [sent], _retry_for(session, waiter))


def infer(
    session: Session, sub: Submission, timeout_s: float, started: float
) -> Plan[dict[str, np.ndarray]]:
    """The blocking client's ``infer``: the whole call ends within ``timeout_s`` of ``started``."""
    yield from send(session, [sub], started + core.check_timeout_s(timeout_s))
    return outputs((yield from wait(session, sub.rid, timeout_s, started, sent=sub)))


def outputs(result: Result) -> dict[str, np.ndarray]:
    """An ``infer``'s answer: the outputs, or the typed RequestFailed subclass raised."""
    result.raise_for_error()
    return result.outputs or {}


def hub_blpop(session: Session, keys: list[bytes], until: float) -> Plan[Any]:
    """``coalesce.ReplyHub``'s BLPOP: its retries end at ``until``, the first waiting call's
    deadline (RedisUnavailable then, which fails the calls whose time is up), not later."""
    retry = session.retry.within(until - time.monotonic(), "the waiting call's timeout")
    cap_s = session.block_cap_s
    return (
        yield Call("BLPOP", lambda r: r.blpop(keys, block_s(until, time.monotonic(), cap_s)), retry)
    )


def hub_lpop(session: Session, keys: list[bytes]) -> Plan[list[Any]]:
    """The hub's sweep after a BLPOP answer: one try, as the next BLPOP covers a miss."""
    return (yield _lpop(session, keys, session.retry.once()))


def poll(
    session: Session, rid: str, kept: Callable[[bytes], Any] | None = None
) -> Plan[Result | None]:
    """The reply of ``rid`` if it has arrived, else None; ``kept`` finds one the client popped
    for a wait that gave up on it."""
    key = session.settings.reply_key(rid)
    raw = None if kept is None else kept(key.encode())
    if raw is None:
        raw = yield Call("LINDEX", lambda r: r.lindex(key, 0), session.retry)
    return None if raw is None else core.parse_reply(rid, raw)


# ---------------------------------------------------------------------------------------------
# map


def fit_rows(session: Session, plan: window.MapPlan) -> Plan[None]:
    """Give ``plan`` the live workers' row limit, or check the caller's against it."""
    if plan.needs_row_limit:
        plan.use_row_limit(row_limit((yield from workers(session)), session.settings))
    elif plan.has_rows:
        check_rows_per_request(plan.rows_per_request, (yield from workers(session)))


def run_map(session: Session, plan: window.MapPlan) -> Plan[None]:
    """map(): yields its Chunks in input order; see ``BaseClient.map``."""
    waiter = plan.waiter
    try:
        while not plan.finished:
            subs = plan.take(time.time())
            if subs:
                try:
                    yield from send(session, subs)
                except RedisFull as exc:  # stop sending; what is in flight is still awaited
                    plan.refused(subs, exc)
                else:
                    plan.sent(subs, time.monotonic())
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


def fit_and_run_map(session: Session, plan: window.MapPlan) -> Plan[None]:
    """``run_map`` that first looks the workers up (``fit_rows``): AsyncClient's map(), which
    raises NoWorkerInfo on first use rather than at the call."""
    yield from fit_rows(session, plan)
    yield from run_map(session, plan)


# ---------------------------------------------------------------------------------------------
# Control and status


def cancel(
    session: Session, rids: Sequence[str], ttl_s: int = 3600, retry: RetryPolicy | None = None
) -> Plan[None]:
    """Set the cancel key of each of ``rids`` for ``ttl_s`` seconds."""
    if rids:
        keys = [session.settings.cancel_key(rid) for rid in rids]

        def queue(pipe: Any) -> None:
            for key in keys:
                pipe.set(key, b"1", ex=ttl_s)

        yield Batch("SET", retry or session.retry, queue)


def backlog(session: Session) -> Plan[int]:
    """Entries in the request stream: queued plus in progress."""
    return int((yield _xlen(session, None)))


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
