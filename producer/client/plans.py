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
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from producer.client import steps
from producer.client.mapwindow import MapPlan
from producer.client.results import Result, parse_reply, wrong_type_result
from producer.client.sending import (
    admit,
    read_backlog,
    read_bulk_limit,
    read_shards,
    request,
    requests,
    resend,
    send,
    unsent,
)
from producer.client.session import Session
from producer.client.settings import check_timeout_s
from producer.client.steps import Aside, Batch, Call, Plan, Send
from producer.client.submission import Submission
from producer.client.waiting import ReplyWaiter, Target
from producer.client.workers import check_rows_per_request, read_workers, row_limit
from producer.protocol.errors import ConnectionFailed, RedbatchError, RedisFull
from producer.redisio.connection import block_s
from producer.redisio.resp import is_wrong_type
from producer.redisio.retry import RetryPolicy

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
    try:
        item = yield from _pop(waiter, steps.blpop(session, waiter, _retry_for(session, waiter)))
    except ConnectionFailed as exc:
        if not is_wrong_type(exc):
            raise
        return []  # a key turned into another type since the LPOPs: the next ones say which
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
    interruption. A reply key of another type is a failed Result that says so. A wait
    interrupted (asyncio's cancellation, KeyboardInterrupt) cancels its request, so that no
    worker runs it for a reply nobody reads (``_interrupted``)."""
    waiter = ReplyWaiter(session.settings, timeout_s)
    tag, rid = target
    key = waiter.add(rid, since, tag)
    until, limit = waiter.deadline, _limit(waiter)
    try:
        while True:
            # Its retry policy is built only if the shell runs this BLPOP itself
            # (Pop.bounded). The hot path of every wait and infer: ``_pop``'s bookkeeping
            # inline, one generator fewer.
            pop = steps.pop_reply(session, key, tag, until, limit)
            try:
                item = yield pop
            except ConnectionFailed as exc:
                if not is_wrong_type(exc):
                    raise
                item = [key, exc]  # the key holds another type: this request's Result says so
            waiter.interrupted = waiter.interrupted or pop.tries > 1
            results = waiter.take_blpopped(item, time.monotonic())
            if results:
                return results[0]
            if sent is not None and waiter.interrupted:
                waiter.interrupted = False
                yield from resend(session, [sent], _retry_for(session, waiter))
    except BaseException as exc:
        if _interrupted(exc):
            yield _cancel_aside(session, target)
        raise


def _interrupted(exc: BaseException) -> bool:
    """True for an interruption from outside the plan (asyncio's CancelledError,
    KeyboardInterrupt): not an error of the call, and not the plan being closed."""
    return not isinstance(exc, (Exception, GeneratorExit))


def _cancel_aside(session: Session, target: Target) -> Aside:
    """Set ``target``'s cancel key on the side (``Aside``), one try: a call interrupted must not
    wait for it."""
    return Aside(cancel(session, [target], retry=session.retry.once()))


def submit(session: Session, subs: Sequence[Submission], until: float | None = None) -> Plan[None]:
    """``submit`` and ``submit_many``: refuse what Redis or the workers would (``admit``:
    TooLarge, with none of ``subs`` sent), then one ``Send`` (see ``send``)."""
    yield from admit(session, subs, until)
    yield Send(subs, until)


def infer(
    session: Session, sub: Submission, timeout_s: float, started: float
) -> Plan[dict[str, np.ndarray]]:
    """``infer``: submit, then ``wait``; the whole call ends within ``timeout_s`` of
    ``started``. Interrupted once its request may have gone out, it cancels it (see
    ``wait``)."""
    until = started + check_timeout_s(timeout_s)
    yield from admit(session, [sub], until)
    try:
        yield Send([sub], until)
    except BaseException as exc:
        if sub.tag and _interrupted(exc):  # a shard was chosen: it may have been sent
            yield _cancel_aside(session, (sub.tag, sub.rid))
        raise
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
        try:
            raw = yield Call("LINDEX", lambda r: r.lindex(key, 0), session.retry, tag)
        except ConnectionFailed as exc:
            if not is_wrong_type(exc):
                raise
            return wrong_type_result(rid, session.settings.model, key.encode(), exc, tag)
    return None if raw is None else parse_reply(rid, raw, tag)


# ---------------------------------------------------------------------------------------------
# map


def fit_rows(session: Session, plan: MapPlan) -> Plan[None]:
    """Give ``plan`` the live workers' row limit, or check the caller's against it, and the
    largest body a request may have (``limits``: its requests are split to stay under it)."""
    if not plan.has_rows:
        return
    records = yield from workers(session)
    limits = session.limits
    if limits.reading(time.monotonic()):  # the bulk limit, at the client's first use
        yield from read_bulk_limit(session, session.retry)
    limits.workers_seen(records, time.monotonic())
    plan.use_body_limit(limits)
    if plan.needs_row_limit:
        plan.use_row_limit(row_limit(records, session.settings))
    else:
        check_rows_per_request(plan.rows_per_request, records)


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
        yield from read_shards(session, session.retry)
    return (yield from read_backlog(session, None))


def workers(session: Session) -> Plan[list[dict[str, Any]]]:
    """The live workers' validation records, by name; forgets workers whose record expired."""
    return (yield from read_workers(session, session.retry))
