"""``AsyncClient``: the asyncio twin of ``Client``, a thin ``redis.asyncio`` shell around the
sans-I/O ``core`` and ``window``.

Same methods, same behaviour, with ``await``: ``wait_many`` and ``map`` are async iterators.
Like ``Client``, it pipelines submits and waits on many keys at once, which is what keeps its cost
per request low. Calls made concurrently (``infer`` from many handlers) share their round trips
as well (``producer.coalesce``): submits go together, and one BLPOP waits for many calls.

Example::

    async with AsyncClient("demo", url) as client:
        async for chunk in client.map({"x": big}):
            chunk.raise_for_error()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import redis.asyncio
from numpy.typing import ArrayLike

from producer import core, resp, window
from producer.client import DEFAULT_URL
from producer.coalesce import Coalescer, ReplyHub
from producer.core import Chunk, Result
from producer.errors import BacklogFull, RedbatchError, RedisFull, RedisUnavailable, WaitTimeout
from producer.keys import DEFAULT_PREFIX
from producer.memory import (
    DEFAULT_HIGH_WATERMARK,
    MemoryWatch,
    check_watermark,
    info_memory_async,
    parse_info_memory,
)
from producer.retry import DEFAULT_RETRY_S, RetryPolicy

__all__ = ["AsyncClient"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# The backlog wait's sleep; a module attribute so tests can see that a submit waited.
_sleep = asyncio.sleep


class AsyncClient:
    """Submit requests to one model's workers and collect their replies (asyncio).

    ``url`` goes to ``redis.asyncio.Redis.from_url``, or pass ``redis_client`` (then
    ``close()`` leaves it open). See ``Client`` for backpressure, ``retry_s`` and errors.
    """

    def __init__(
        self,
        model: str,
        url: str = DEFAULT_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        max_backlog: int | None = None,
        wait_for_backlog: bool = False,
        redis_client: redis.asyncio.Redis | None = None,
        retry_s: float = DEFAULT_RETRY_S,
        memory_high_watermark: float | None = DEFAULT_HIGH_WATERMARK,
    ) -> None:
        self._settings = core.Settings.create(model, prefix, max_backlog, wait_for_backlog)
        check_watermark(memory_high_watermark)
        if redis_client is None:
            self._redis = redis.asyncio.Redis.from_url(url, decode_responses=False)
            self._where = core.redact_url(url)
        else:
            self._redis = redis_client
            pool = redis_client.connection_pool
            tls = issubclass(pool.connection_class, redis.asyncio.SSLConnection)
            self._where = core.describe_connection(pool.connection_kwargs, tls)
        self._owns_redis = redis_client is None
        connection_kwargs = self._redis.connection_pool.connection_kwargs
        core.check_connection_kwargs(connection_kwargs)
        self._block_cap_s = core.block_cap_s(connection_kwargs.get("socket_timeout"))
        self._retry = RetryPolicy(self._where, retry_s)
        self._packed = resp.supports(self._redis)  # submits and sweeps packed by hand
        self._memory = MemoryWatch(self._where, memory_high_watermark)
        # Concurrent submit and wait calls (infer from many handlers) share round trips.
        self._submits: Coalescer[core.Submission] = Coalescer(
            self._send, retry_s=retry_s, unsent=self._unsent
        )
        self._backlog_seen: int | None = None  # while a send waits for the backlog to drop
        self._full_seen: RedisFull | None = None  # while a send waits for Redis memory
        self._replies = ReplyHub(self._hub_blpop, self._hub_lpop, self._late)

    @property
    def model(self) -> str:
        """The model this client sends to."""
        return self._settings.model

    # -- submitting ------------------------------------------------------------------------

    async def submit(
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
        await self._submits([sub])
        return sub.rid

    async def submit_many(
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
            await self._submits(subs)
        return [sub.rid for sub in subs]

    async def _send(self, subs: Sequence[core.Submission], until: float | None = None) -> None:
        """As ``Client._send``; ``until`` is the first deadline among the coalesced calls."""
        settings = self._settings
        gate = core.BacklogGate(settings.max_backlog, settings.wait_for_backlog, until)
        try:
            while True:
                while (delay_s := await self._no_room_s(gate, until)) is not None:
                    await _sleep(delay_s)
                try:
                    await self._retry.until(until, core.INFER_LIMIT).acall(self._xadd, subs)
                except RedisFull as exc:  # Redis's own OOM: past the watermark between readings
                    self._full_seen = self._memory.refused(exc.refused or "")
                    await _sleep(gate.refused(self._full_seen, time.monotonic()))
                    continue
                self._memory.sent(sum(len(sub.body) for sub in subs))
                return
        finally:
            self._backlog_seen = self._full_seen = None

    async def _no_room_s(self, gate: core.BacklogGate, until: float | None) -> float | None:
        """As ``Client._no_room_s``; notes what holds the send up, for ``_unsent``."""
        if gate.active:
            backlog = await self._xlen(until)
            delay_s = gate.delay_s(backlog, time.monotonic())
            if delay_s is not None:
                self._backlog_seen = backlog
                return delay_s
        if self._memory.stale(time.monotonic()):
            retry = self._retry.until(until, core.INFER_LIMIT)
            info = await retry.acall(info_memory_async, self._redis)
            if info is None:
                self._memory.cannot_read()
            else:
                self._memory.seen(parse_info_memory(info), time.monotonic())
        self._full_seen = self._memory.full()
        if self._full_seen is None:
            return None
        return gate.refused(self._full_seen, time.monotonic())

    def _unsent(self) -> RedbatchError:
        """The error of an ``infer`` whose timeout_s ran out while its submit waited behind an
        earlier one: the cause that held that one up, as if the infer had met it itself."""
        settings = self._settings
        if self._backlog_seen is not None and settings.max_backlog is not None:
            return BacklogFull(self._backlog_seen, settings.max_backlog, waited=True)
        if self._full_seen is not None:
            return self._full_seen.waited_out()
        if self._retry.outage.active:
            return RedisUnavailable(
                f"Could not talk to Redis at {self._where} within {core.INFER_LIMIT}, while "
                "an earlier submit was retrying; the request was not sent."
            )
        return WaitTimeout(
            f"{core.INFER_LIMIT} ran out while an earlier submit was being sent; the request "
            "was not sent."
        )

    async def _resend(self, subs: Sequence[core.Submission]) -> None:
        """As ``Client._resend``: ``map``'s awaited requests, again, after an interruption."""
        if subs:
            log.info("sending %d awaited request(s) again after a Redis interruption", len(subs))
            await self._retry.acall(self._xadd, subs)

    async def _xadd(self, subs: Sequence[core.Submission]) -> None:
        if self._packed:
            xadds = core.pack_xadds(self._settings.stream, subs)
            core.check_xadds(xadds, await resp.round_trip_async(self._redis, xadds.packer))
            return
        # A new pipeline per try: a failed execute() has already emptied the old one.
        pipe = self._redis.pipeline(transaction=False)
        for sub in subs:
            pipe.xadd(self._settings.stream, sub.fields())
        await pipe.execute()

    # -- replies ---------------------------------------------------------------------------

    async def poll(self, rid: str) -> Result | None:
        """The reply of ``rid`` if it has arrived, else None; never blocks, never consumes."""
        key = self._settings.reply_key(rid)
        raw = self._replies.peek(key.encode())  # popped by a wait that gave up on it
        if raw is None:
            raw = await self._retry.acall(self._redis.lindex, key, 0)
        return None if raw is None else core.parse_reply(rid, raw)

    async def wait(self, rid: str, timeout_s: float) -> Result:
        """Block for the reply of ``rid`` and consume it; raises WaitTimeout. Concurrent waits
        share their round trips: one BLPOP watches many keys."""
        return await self._wait(rid, core.check_timeout_s(timeout_s), time.monotonic())

    async def _wait(self, rid: str, timeout_s: float, since: float) -> Result:
        """``wait``, with its ``timeout_s`` counted from ``since`` (monotonic)."""
        key = self._settings.reply_key(rid).encode()
        raw = await self._replies.wait(key, timeout_s, rid, since)
        return core.parse_reply_or_fail(rid, raw, self.model)

    async def _hub_blpop(self, keys: list[bytes], until: float) -> Any:
        """Retries end at ``until``, the first waiting call's deadline: RedisUnavailable then,
        which fails the calls whose time is up (coalesce.ReplyHub), not later."""
        retry = self._retry.within(until - time.monotonic(), "the waiting call's timeout")
        return await retry.acall(self._blpop_until, keys, until)

    async def _blpop_until(self, keys: list[bytes], until: float) -> Any:
        # The block is worked out per try, so a retry after an outage blocks only what is left.
        # Redis counts in milliseconds, and a timeout of 0 would block forever.
        block_s = max(round(min(until - time.monotonic(), self._block_cap_s), 3), 0.001)
        return await self._redis.blpop(keys, block_s)

    async def _hub_lpop(self, keys: list[bytes]) -> Sequence[Any]:
        """The hub's sweep after a BLPOP answer: one try, as the next BLPOP covers a miss."""
        return await self._retry.once().acall(self._lpop, keys)

    def _late(self, rid: str, timeout_s: float) -> WaitTimeout:
        return window.wait_timeout(self.model, timeout_s, [rid])

    def wait_many(self, rids: Sequence[str], timeout_s: float) -> AsyncIterator[Result]:
        """Yield replies as they arrive (consuming them); WaitTimeout for any left at the end."""
        waiter = window.ReplyWaiter(self._settings, timeout_s)
        now = time.monotonic()
        for rid in rids:
            waiter.add(rid, now)
        return self._drain(waiter)

    async def _drain(self, waiter: window.ReplyWaiter) -> AsyncIterator[Result]:
        while waiter.pending:
            for result in await self._wait_round(waiter):
                yield result

    def _retry_for(self, waiter: window.ReplyWaiter) -> RetryPolicy:
        """As ``Client._retry_for``: wait_many's retries end at its first deadline; map's do not."""
        if waiter.late_fails:
            return self._retry
        limit = f"the wait's timeout_s={waiter.timeout_s:g}"
        return self._retry.within(waiter.time_left(time.monotonic()), limit)

    async def _wait_round(self, waiter: window.ReplyWaiter) -> list[Result]:
        """One pipelined LPOP over every awaited key; if none was ready, one BLPOP over them."""
        keys = waiter.keys()
        results = waiter.take_popped(keys, await self._pop(waiter, self._lpop, keys))
        if results:
            return results
        item = await self._pop(waiter, self._blpop, waiter)
        return waiter.take_blpopped(item, time.monotonic())

    async def _pop(
        self, waiter: window.ReplyWaiter, fn: Callable[..., Awaitable[T]], *args: Any
    ) -> T:
        """As ``Client._pop``: a pop that needed a retry marks ``waiter.interrupted``."""
        tries = 0

        async def counted(*a: Any) -> T:
            nonlocal tries
            tries += 1
            return await fn(*a)

        try:
            return await self._retry_for(waiter).acall(counted, *args)
        finally:
            waiter.interrupted = waiter.interrupted or tries > 1

    async def _lpop(self, keys: Sequence[bytes]) -> list[Any]:
        if self._packed:
            replies = await resp.round_trip_async(self._redis, core.pack_lpops(keys))
            return resp.raise_first_error(replies)
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.lpop(key)
        return await pipe.execute()

    async def _blpop(self, waiter: window.ReplyWaiter) -> Any:
        # The block is worked out per try, so a retry after an outage blocks only what is left.
        block_s = waiter.block_s(time.monotonic(), self._block_cap_s)
        return await self._redis.blpop(waiter.keys(), block_s)

    async def infer(
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
        """Submit, wait and return the outputs; raises the typed RequestFailed subclass. The
        whole call, submit included, ends within ``timeout_s``, as ``Client.infer``'s does."""
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
        await self._submits([sub], started + core.check_timeout_s(timeout_s))
        result = await self._wait(sub.rid, timeout_s, started)
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
    ) -> AsyncIterator[Chunk]:
        """Run arrays through the model in requests of at most ``rows_per_request`` rows.

        An async iterator of Chunks in input order; see ``Client.map``. Bad arguments raise
        at the call; NoWorkerInfo (no ``rows_per_request`` and no live worker) on first use.
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
        return self._run_map(plan)

    async def _run_map(self, plan: window.MapPlan) -> AsyncIterator[Chunk]:
        if plan.needs_row_limit:
            plan.use_row_limit(core.row_limit(await self.workers(), self._settings))
        elif plan.rows:
            core.check_rows_per_request(plan.rows_per_request, await self.workers())
        try:
            while not plan.finished:
                subs = plan.take(time.time())
                if subs:
                    try:
                        await self._send(subs)
                    except RedisFull as exc:  # stop sending; what is in flight is still awaited
                        plan.refused(subs, exc)
                    else:
                        plan.sent(subs, time.monotonic())
                for chunk in plan.ready():
                    yield chunk
                if plan.waiter.pending:
                    plan.answered(await self._wait_round(plan.waiter), time.monotonic())
                    await self._cancel_many(plan.waiter.late)
                    plan.waiter.late.clear()
                if plan.waiter.interrupted:
                    plan.waiter.interrupted = False
                    await self._resend(plan.awaited(time.time()))
            if plan.refusal is not None:
                raise plan.refusal
        finally:
            # The caller stopped early, or Redis failed: run nothing more (late requests too,
            # when the stop came between giving up on them and cancelling them).
            unanswered = [*plan.in_flight, *plan.waiter.late]
            if unanswered:
                with contextlib.suppress(RedbatchError):
                    await self._cancel_many(unanswered, retry=self._retry.once())

    # -- control and status ----------------------------------------------------------------

    async def cancel(self, rid: str, ttl_s: int = 3600) -> None:
        """Ask workers not to run ``rid``: sets its cancel key for ``ttl_s`` seconds."""
        await self._cancel_many([rid], core.check_ttl_s("ttl_s", ttl_s))

    async def _cancel_many(
        self, rids: Sequence[str], ttl_s: int = 3600, retry: RetryPolicy | None = None
    ) -> None:
        if rids:
            keys = [self._settings.cancel_key(rid) for rid in rids]
            await (retry or self._retry).acall(self._set_all, keys, ttl_s)

    async def _set_all(self, keys: Sequence[str], ttl_s: int) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.set(key, b"1", ex=ttl_s)
        await pipe.execute()

    async def backlog(self) -> int:
        """Entries in the request stream: queued plus in progress."""
        return await self._xlen(None)

    async def _xlen(self, until: float | None) -> int:
        retry = self._retry.until(until, core.INFER_LIMIT)
        return int(await retry.acall(self._redis.xlen, self._settings.stream))

    async def workers(self) -> list[dict[str, Any]]:
        """The live workers' validation records, by name; forgets workers whose record expired."""
        key, call = self._settings.workers_key, self._retry.acall
        members = await call(self._redis.smembers, key)
        roster = core.WorkerRoster.from_members(self._settings, members)
        raws = await call(self._redis.mget, roster.record_keys) if roster.record_keys else []
        records, stale = roster.read(raws)
        if stale:
            await call(self._redis.srem, key, *stale)
        return records

    # -- lifetime --------------------------------------------------------------------------

    async def close(self) -> None:
        """Close the connections, unless the Redis client was passed in; calls still waiting
        raise RedbatchError."""
        self._submits.close()
        self._replies.close()
        if self._owns_redis:
            await self._redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncClient(model={self._settings.model!r}, url={self._where!r})"
