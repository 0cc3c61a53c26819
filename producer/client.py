"""``Client``: the blocking client, a thin redis-py shell around ``producer.core`` and ``window``.

Every decision (what to send, how long to block, which chunk comes next) is made in ``core`` and
``window``; this module only runs the Redis commands. ``producer.aio.AsyncClient`` is its async
twin.

Example::

    with Client("demo", "redis://127.0.0.1:6379/0") as client:
        y = client.infer({"x": np.ones((1, 4), np.float32)})["y"]
        for chunk in client.map({"x": big}, rows_per_request=32):
            chunk.raise_for_error()
            use(chunk.start, chunk.stop, chunk.outputs)
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import redis
from numpy.typing import ArrayLike

from producer import core, resp, window
from producer.core import Chunk, Result
from producer.errors import RedbatchError, RedisFull
from producer.keys import DEFAULT_PREFIX
from producer.memory import (
    DEFAULT_HIGH_WATERMARK,
    MemoryWatch,
    check_watermark,
    info_memory,
    parse_info_memory,
)
from producer.retry import DEFAULT_RETRY_S, RetryPolicy

__all__ = ["Client"]

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_URL = "redis://127.0.0.1:6379/0"

# The backlog wait's sleep; a module attribute so tests can see that a submit waited.
_sleep = time.sleep


class Client:
    """Submit requests to one model's workers and collect their replies (blocking I/O).

    ``url`` goes to ``redis.Redis.from_url``, so ``rediss://``, passwords and ACL users work;
    or pass ``redis_client`` (then ``close()`` leaves it open; turn its own retries off,
    ``retry=Retry(NoBackoff(), 0)``, or a pop it retries after losing a reply goes unseen and
    that request is not sent again: see ``producer.retry``). With ``max_backlog`` set,
    submits refuse with ``BacklogFull`` while the request stream holds that many entries, or
    wait for it to shrink when ``wait_for_backlog`` is true (``infer`` waits no longer than its
    ``timeout_s``, then raises ``BacklogFull`` with nothing sent).

    Redis memory is a limit too: once ``used_memory`` reaches ``memory_high_watermark`` of
    ``maxmemory`` (0.8 by default; None turns it off; nothing applies without a ``maxmemory``),
    submits refuse with ``RedisFull``, or wait for room with ``wait_for_backlog``, so that the
    workers keep the rest to answer what is queued. Memory is read with ``INFO memory`` about
    once a second, not per submit; a write Redis itself refuses for memory is ``RedisFull`` too.

    Every Redis command is retried with capped, jittered backoff through outages of up to
    ``retry_s`` seconds (0: no retries), with one log line when an outage starts and one when it
    ends; then ``RedisUnavailable`` is raised. Other Redis errors raise ``ConnectionFailed`` at
    once. A retried submit resends the same request (same rid and body), so a lost answer can
    queue it twice, never as a different request; ``producer.retry`` has the details.
    """

    def __init__(
        self,
        model: str,
        url: str = DEFAULT_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        max_backlog: int | None = None,
        wait_for_backlog: bool = False,
        redis_client: redis.Redis | None = None,
        retry_s: float = DEFAULT_RETRY_S,
        memory_high_watermark: float | None = DEFAULT_HIGH_WATERMARK,
    ) -> None:
        self._settings = core.Settings.create(model, prefix, max_backlog, wait_for_backlog)
        check_watermark(memory_high_watermark)
        if redis_client is None:
            self._redis = redis.Redis.from_url(url, decode_responses=False)
            self._where = core.redact_url(url)
        else:
            self._redis = redis_client
            pool = redis_client.connection_pool
            tls = issubclass(pool.connection_class, redis.SSLConnection)
            self._where = core.describe_connection(pool.connection_kwargs, tls)
        self._owns_redis = redis_client is None
        connection_kwargs = self._redis.connection_pool.connection_kwargs
        core.check_connection_kwargs(connection_kwargs)
        self._block_cap_s = core.block_cap_s(connection_kwargs.get("socket_timeout"))
        self._retry = RetryPolicy(self._where, retry_s)
        self._packed = resp.supports(self._redis)  # submits and sweeps packed by hand
        self._memory = MemoryWatch(self._where, memory_high_watermark)

    @property
    def model(self) -> str:
        """The model this client sends to."""
        return self._settings.model

    # -- submitting ------------------------------------------------------------------------

    def submit(
        self,
        inputs: Mapping[str, ArrayLike],
        *,
        outputs: Sequence[str] | None = None,
        deadline_s: float | None = None,
        meta: Any = None,
        rid: str | None = None,
        reply_ttl_s: int | None = None,
    ) -> str:
        """Queue one request and return its rid; ``deadline_s`` is seconds from now (> 0)."""
        sub = core.build_submission(
            inputs,
            outputs=outputs,
            deadline_s=deadline_s,
            meta=meta,
            rid=rid,
            reply_ttl_s=reply_ttl_s,
            now_s=time.time(),
        )
        self._send([sub])
        return sub.rid

    def submit_many(
        self,
        requests: Sequence[Mapping[str, ArrayLike]],
        *,
        outputs: Sequence[str] | None = None,
        deadline_s: float | None = None,
        meta: Any = None,
        reply_ttl_s: int | None = None,
    ) -> list[str]:
        """Queue many requests in one pipelined round trip; returns their rids in order. They go
        in transactions of up to 256 requests (or about 1 MiB), each added whole or not at all:
        an error raised by a larger call (Redis refusing for memory part-way, an outage) may
        leave its first transactions queued."""
        subs = core.build_submissions(
            requests,
            outputs=outputs,
            deadline_s=deadline_s,
            meta=meta,
            reply_ttl_s=reply_ttl_s,
            now_s=time.time(),
        )
        if subs:
            self._send(subs)
        return [sub.rid for sub in subs]

    def _send(self, subs: Sequence[core.Submission], until: float | None = None) -> None:
        """XADD ``subs`` once the backlog and Redis memory allow. ``until`` (monotonic), an
        ``infer``'s deadline, ends the wait (BacklogFull, RedisFull) and the retries
        (RedisUnavailable)."""
        settings = self._settings
        gate = core.BacklogGate(settings.max_backlog, settings.wait_for_backlog, until)
        while True:
            while (delay_s := self._no_room_s(gate, until)) is not None:
                _sleep(delay_s)
            try:
                self._retry.until(until, core.INFER_LIMIT).call(self._xadd, subs)
            except RedisFull as exc:  # Redis's own OOM: past the watermark between readings
                _sleep(gate.refused(self._memory.refused(exc.refused or ""), time.monotonic()))
                continue
            self._memory.sent(sum(len(sub.body) for sub in subs))
            return

    def _no_room_s(self, gate: core.BacklogGate, until: float | None) -> float | None:
        """None when the backlog and Redis memory leave room; else how long to sleep before
        looking again (or the gate raises BacklogFull or RedisFull)."""
        if gate.active:
            delay_s = gate.delay_s(self._xlen(until), time.monotonic())
            if delay_s is not None:
                return delay_s
        if self._memory.stale(time.monotonic()):
            self._read_memory(until)
        full = self._memory.full()
        return None if full is None else gate.refused(full, time.monotonic())

    def _read_memory(self, until: float | None) -> None:
        """Read ``INFO memory`` (through the retry policy) into the memory watch."""
        retry = self._retry.until(until, core.INFER_LIMIT)
        info = retry.call(info_memory, self._redis)
        if info is None:
            self._memory.cannot_read()
        else:
            self._memory.seen(parse_info_memory(info), time.monotonic())

    def _xadd(self, subs: Sequence[core.Submission]) -> None:
        if self._packed:
            xadds = core.pack_xadds(self._settings.stream, subs)
            core.check_xadds(xadds, resp.round_trip(self._redis, xadds.packer))
            return
        # A new pipeline per try: a failed execute() has already emptied the old one.
        pipe = self._redis.pipeline(transaction=False)
        for sub in subs:
            pipe.xadd(self._settings.stream, sub.fields())
        pipe.execute()

    # -- replies ---------------------------------------------------------------------------

    def poll(self, rid: str) -> Result | None:
        """The reply of ``rid`` if it has arrived, else None; never blocks, never consumes."""
        key = self._settings.reply_key(rid)
        raw = self._retry.call(self._redis.lindex, key, 0)
        return None if raw is None else core.parse_reply(rid, raw)

    def wait(self, rid: str, timeout_s: float) -> Result:
        """Block for the reply of ``rid`` and consume it; raises WaitTimeout."""
        return self._wait(rid, timeout_s, time.monotonic())

    def _wait(
        self, rid: str, timeout_s: float, since: float, sent: core.Submission | None = None
    ) -> Result:
        """``wait``, with its ``timeout_s`` counted from ``since`` (monotonic). ``sent``, the
        request itself (``infer``), is sent again after an interruption (``_resend``)."""
        waiter = window.ReplyWaiter(self._settings, timeout_s)
        waiter.add(rid, since)
        while True:
            item = self._pop(waiter, self._blpop, waiter)
            results = waiter.take_blpopped(item, time.monotonic())
            if results:
                return results[0]
            if sent is not None and waiter.interrupted:
                waiter.interrupted = False
                self._resend([sent], self._retry_for(waiter))

    def _pop(self, waiter: window.ReplyWaiter, fn: Callable[..., T], *args: Any) -> T:
        """A consuming pop (LPOP, BLPOP) through the retry policy. One that needed a retry may
        have taken a reply whose answer was lost with its connection: ``waiter.interrupted``
        then says so, and the shell sends again the requests it has the bodies of."""
        tries = 0

        def counted(*a: Any) -> T:
            nonlocal tries
            tries += 1
            return fn(*a)

        try:
            return self._retry_for(waiter).call(counted, *args)
        finally:
            waiter.interrupted = waiter.interrupted or tries > 1

    def _resend(self, subs: Sequence[core.Submission], retry: RetryPolicy) -> None:
        """Send awaited requests again, same rids, after a command needed a retry: a reply
        popped in flight was lost with its connection, or a Redis restarted without
        persistence forgot the stream. A worker answers a copy whose reply is gone (and one
        whose reply was read meanwhile: that reply expires unread), and writes nothing for one
        whose reply is still there. No backlog gate: these are counted in it, or were lost."""
        if subs:
            log.info("sending %d awaited request(s) again after a Redis interruption", len(subs))
            retry.call(self._xadd, subs)

    def _retry_for(self, waiter: window.ReplyWaiter) -> RetryPolicy:
        """For ``wait`` and ``wait_many``, retries end at the first deadline (RedisUnavailable
        then, not later). map() keeps the client's: its late requests fail one by one and the
        others carry on, so a short outage near one deadline must not end them all."""
        if waiter.late_fails:
            return self._retry
        limit = f"the wait's timeout_s={waiter.timeout_s:g}"
        return self._retry.within(waiter.time_left(time.monotonic()), limit)

    def wait_many(self, rids: Sequence[str], timeout_s: float) -> Iterator[Result]:
        """Yield replies as they arrive (consuming them); WaitTimeout for any left at the end."""
        waiter = window.ReplyWaiter(self._settings, timeout_s)
        now = time.monotonic()
        for rid in rids:
            waiter.add(rid, now)
        return self._drain(waiter)

    def _drain(self, waiter: window.ReplyWaiter) -> Iterator[Result]:
        while waiter.pending:
            yield from self._wait_round(waiter)

    def _wait_round(self, waiter: window.ReplyWaiter) -> list[Result]:
        """One pipelined LPOP over every awaited key; if none was ready, one BLPOP over them."""
        keys = waiter.keys()
        results = waiter.take_popped(keys, self._pop(waiter, self._lpop, keys))
        if results:
            return results
        item = self._pop(waiter, self._blpop, waiter)
        return waiter.take_blpopped(item, time.monotonic())

    def _lpop(self, keys: Sequence[bytes]) -> list[Any]:
        if self._packed:
            replies = resp.round_trip(self._redis, core.pack_lpops(keys))
            return resp.raise_first_error(replies)
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.lpop(key)
        return pipe.execute()

    def _blpop(self, waiter: window.ReplyWaiter) -> Any:
        # The block is worked out per try, so a retry after an outage blocks only what is left.
        block_s = waiter.block_s(time.monotonic(), self._block_cap_s)
        return self._redis.blpop(waiter.keys(), block_s)

    def infer(
        self,
        inputs: Mapping[str, ArrayLike],
        timeout_s: float = 30.0,
        *,
        outputs: Sequence[str] | None = None,
        deadline_s: float | None = None,
        meta: Any = None,
        rid: str | None = None,
        reply_ttl_s: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Submit, wait and return the outputs; raises the typed RequestFailed subclass.

        The whole call, submit included, ends within ``timeout_s``: WaitTimeout when no reply
        came, RedisUnavailable when Redis was down then, BacklogFull when the backlog never
        dropped (with ``wait_for_backlog``; the request was not sent).
        """
        started = time.monotonic()
        sub = core.build_submission(
            inputs,
            outputs=outputs,
            deadline_s=deadline_s,
            meta=meta,
            rid=rid,
            reply_ttl_s=reply_ttl_s,
            now_s=time.time(),
        )
        self._send([sub], started + core.check_timeout_s(timeout_s))
        result = self._wait(sub.rid, timeout_s, started, sent=sub)
        result.raise_for_error()
        return result.outputs or {}

    def map(
        self,
        arrays: Mapping[str, ArrayLike],
        *,
        rows_per_request: int | None = None,
        concurrency: int = 64,
        outputs: Sequence[str] | None = None,
        timeout_s: float = 60.0,
        stop_on_timeout: bool = False,
    ) -> Iterator[Chunk]:
        """Run arrays through the model in requests of at most ``rows_per_request`` rows.

        Yields one Chunk per request, in input order; a failed request is a Chunk with
        ``error`` set. ``rows_per_request`` defaults to the smallest ``max_batch_size`` of the
        live workers (NoWorkerInfo when none is registered). ``timeout_s`` bounds the wait for
        each request's reply, counted from when it was sent: a late request is yielded as a
        failed Chunk (code WAIT_TIMEOUT) and cancelled, and the others carry on; with
        ``stop_on_timeout`` the first late reply stops the sending instead, and the iteration
        ends once the requests already in flight are yielded (its last chunk then stops short
        of the input's end). Stopping the iteration early cancels the requests still in
        flight. Each refill of the window is one pipelined submit, with the same backlog check
        as ``submit_many``. When Redis is full (``RedisFull``), the sending stops: the requests
        in flight are still awaited and yielded, and then the refusal is raised; the rows after
        the last chunk yielded were never sent (with ``wait_for_backlog``, map waits for room
        instead).
        """
        plan = window.MapPlan(
            self._settings,
            arrays,
            rows_per_request=rows_per_request,
            concurrency=concurrency,
            outputs=outputs,
            timeout_s=timeout_s,
            stop_on_timeout=stop_on_timeout,
        )
        if plan.needs_row_limit:
            plan.use_row_limit(core.row_limit(self.workers(), self._settings))
        elif plan.rows:
            core.check_rows_per_request(plan.rows_per_request, self.workers())
        return self._run_map(plan)

    def _run_map(self, plan: window.MapPlan) -> Iterator[Chunk]:
        try:
            while not plan.finished:
                subs = plan.take(time.time())
                if subs:
                    try:
                        self._send(subs)
                    except RedisFull as exc:  # stop sending; what is in flight is still awaited
                        plan.refused(subs, exc)
                    else:
                        plan.sent(subs, time.monotonic())
                yield from plan.ready()
                if plan.waiter.pending:
                    plan.answered(self._wait_round(plan.waiter), time.monotonic())
                    self._cancel_many(plan.waiter.late)
                    plan.waiter.late.clear()
                if plan.waiter.interrupted:
                    plan.waiter.interrupted = False
                    self._resend(plan.awaited(time.time()), self._retry)
            if plan.refusal is not None:
                raise plan.refusal
        finally:
            # The caller stopped early, or Redis failed: run nothing more (late requests too,
            # when the stop came between giving up on them and cancelling them).
            unanswered = [*plan.in_flight, *plan.waiter.late]
            if unanswered:
                with contextlib.suppress(RedbatchError):
                    self._cancel_many(unanswered, retry=self._retry.once())

    # -- control and status ----------------------------------------------------------------

    def cancel(self, rid: str, ttl_s: int = 3600) -> None:
        """Ask workers not to run ``rid``: sets its cancel key for ``ttl_s`` seconds."""
        self._cancel_many([rid], core.check_ttl_s("ttl_s", ttl_s))

    def _cancel_many(
        self, rids: Sequence[str], ttl_s: int = 3600, retry: RetryPolicy | None = None
    ) -> None:
        if rids:
            keys = [self._settings.cancel_key(rid) for rid in rids]
            (retry or self._retry).call(self._set_all, keys, ttl_s)

    def _set_all(self, keys: Sequence[str], ttl_s: int) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.set(key, b"1", ex=ttl_s)
        pipe.execute()

    def backlog(self) -> int:
        """Entries in the request stream: queued plus in progress."""
        return self._xlen(None)

    def _xlen(self, until: float | None) -> int:
        retry = self._retry.until(until, core.INFER_LIMIT)
        return int(retry.call(self._redis.xlen, self._settings.stream))

    def workers(self) -> list[dict[str, Any]]:
        """The live workers' validation records, by name; forgets workers whose record expired."""
        key = self._settings.workers_key
        members = self._retry.call(self._redis.smembers, key)
        roster = core.WorkerRoster.from_members(self._settings, members)
        raws = self._retry.call(self._redis.mget, roster.record_keys) if roster.record_keys else []
        records, stale = roster.read(raws)
        if stale:
            self._retry.call(self._redis.srem, key, *stale)
        return records

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connections, unless the Redis client was passed in."""
        if self._owns_redis:
            self._redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client(model={self._settings.model!r}, url={self._where!r})"
