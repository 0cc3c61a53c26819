"""``AsyncClient``: the asyncio twin of ``Client``, a thin ``redis.asyncio`` shell that runs the
same ``producer.client.plans`` with ``await``.

Same methods, same plans, same behaviour, with ``await``: ``wait_many`` and ``map`` are async
iterators. Like ``Client``, it pipelines submits and waits on many keys at once, which is what
keeps its cost per request low. Calls made concurrently (``infer`` from many handlers) share their
round trips as well: the driver hands the plans' ``Send`` and ``Pop`` steps to
``producer.client.coalesce``, so submits go together, and one BLPOP per shard waits for many
calls. On a cluster, a batch's round trips to different nodes run concurrently.

Example::

    async with AsyncClient("demo", url) as client:
        async for chunk in client.map({"x": big}):
            chunk.raise_for_error()
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import redis.asyncio
from numpy.typing import ArrayLike

from producer.client import driver, plans, steps
from producer.client.coalesce import Coalescer, ReplyHub
from producer.client.mapwindow import MapPlan
from producer.client.results import Chunk, Result
from producer.client.settings import check_ttl_s
from producer.client.shell import BaseClient, Flavour
from producer.client.submission import Submission
from producer.client.waiting import ReplyWaiter
from producer.protocol.errors import RedbatchError
from producer.redisio import resp
from producer.redisio.memory import info_memory_async
from producer.redisio.retry import REDIS_ERRORS
from producer.redisio.topology import AsyncTopology

__all__ = ["AsyncClient"]

R = TypeVar("R")

# The backlog wait's sleep; a module attribute so tests can see that a submit waited.
_sleep = asyncio.sleep


class AsyncClient(BaseClient[redis.asyncio.Redis, AsyncIterator[Chunk], AsyncIterator[Result]]):
    """Submit requests to one model's workers and collect their replies (asyncio).

    ``url`` goes to ``redis.asyncio.Redis.from_url`` (on Redis Cluster, any node's), or pass
    ``redis_client``, a ``redis.asyncio.Redis`` (then ``close()`` leaves it open). See
    ``Client`` for shards and handles, backpressure, ``retry_s`` and errors.
    """

    _flavour = Flavour(
        redis.asyncio.Redis, redis.asyncio.SSLConnection, info_memory_async, AsyncTopology
    )
    _topology: AsyncTopology

    def _opened(self) -> None:
        # Concurrent submit and wait calls (infer from many handlers) share round trips.
        retry_s = self._session.retry.retry_s
        self._submits: Coalescer[Submission] = Coalescer(
            self._send, retry_s=retry_s, unsent=self._unsent
        )
        self._replies = ReplyHub(self._shared_blpop, self._shared_lpop)

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
        """Queue one request and return its handle (its rid on the model's first shard, else
        ``T/R``); ``deadline_s`` is seconds from now (> 0)."""
        sub = plans.request(inputs, outputs, deadline_s, meta, rid, reply_ttl_s)
        await self._run(plans.submit([sub]))
        return sub.handle

    async def submit_many(
        self,
        requests: Sequence[Mapping[str, ArrayLike]],
        *,
        outputs: Sequence[str] | None = None,
        deadline_s: float | None = None,
        meta: Any = None,
        reply_ttl_s: int | None = None,
    ) -> list[str]:
        """As ``Client.submit_many``: one pipelined round trip (shared with concurrent calls;
        on a cluster one per node, run concurrently), split evenly over the shards, in
        transactions of up to 256 requests of one shard each; returns the handles."""
        subs = plans.requests(requests, outputs, deadline_s, meta, reply_ttl_s)
        if subs:
            await self._run(plans.submit(subs))
        return [sub.handle for sub in subs]

    async def _send(self, subs: list[Submission], until: float | None) -> None:
        """The coalescer's round trip, the ``Send`` steps of many calls at once; ``until`` is
        the first deadline among them."""
        await self._run(plans.send(self._session, subs, until))

    def _unsent(self) -> RedbatchError:
        return plans.unsent(self._session)

    # -- replies ---------------------------------------------------------------------------

    async def poll(self, handle: str) -> Result | None:
        """The reply of ``handle`` (or rid) if it has arrived, else None; never blocks, never
        consumes."""
        target = self._session.settings.target(handle)
        return await self._run(plans.poll(self._session, target, self._replies.peek))

    async def wait(self, handle: str, timeout_s: float) -> Result:
        """Block for the reply of ``handle`` (or rid) and consume it; raises WaitTimeout.
        Concurrent waits share their round trips: one BLPOP watches many keys of a shard."""
        target = self._session.settings.target(handle)
        return await self._run(plans.wait(self._session, target, timeout_s, time.monotonic()))

    async def _shared_blpop(self, tag: str, keys: list[bytes], until: float) -> tuple[Any, bool]:
        return await self._run(plans.shared_blpop(self._session, tag, keys, until))

    async def _shared_lpop(self, tag: str, keys: list[bytes]) -> list[Any]:
        return await self._run(plans.shared_lpop(self._session, tag, keys))

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
        sub = plans.request(inputs, outputs, deadline_s, meta, rid, reply_ttl_s)
        return await self._run(plans.infer(self._session, sub, timeout_s, started))

    def _drain(self, waiter: ReplyWaiter) -> AsyncIterator[Result]:
        return self._iterate(plans.drain(self._session, waiter))

    def _map(self, plan: MapPlan) -> AsyncIterator[Chunk]:
        return self._iterate(plans.fit_and_run_map(self._session, plan))  # NoWorkerInfo lazily

    # -- control and status ----------------------------------------------------------------

    async def cancel(self, handle: str, ttl_s: int = 3600) -> None:
        """Ask workers not to run ``handle`` (or rid): sets its cancel key, in its shard, for
        ``ttl_s`` seconds."""
        target = self._session.settings.target(handle)
        await self._run(plans.cancel(self._session, [target], check_ttl_s("ttl_s", ttl_s)))

    async def backlog(self) -> int:
        """Entries in the model's request streams (summed over its shards): queued plus in
        progress."""
        return await self._run(plans.backlog(self._session))

    async def workers(self) -> list[dict[str, Any]]:
        """The live workers' validation records, by name; forgets workers whose record expired."""
        return await self._run(plans.workers(self._session))

    # -- running plans ---------------------------------------------------------------------

    async def _run(self, plan: steps.Plan[R]) -> R:
        """Run ``plan`` to its end and return what it returns. Every call runs here, so the
        plan is driven directly (no ``Stepper``: nothing iterates it, so no caller can stop it
        half-way); a step's error, a cancellation included, is thrown into the plan where it
        yielded, so its clean-up runs."""
        answer: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = plan.send(answer) if error is None else plan.throw(error)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            answer = error = None
            try:
                answer = await self._take(step)
            except BaseException as exc:
                error = exc

    async def _iterate(self, plan: steps.Plan[None]) -> AsyncIterator[Any]:
        """Run a streaming plan, yielding its outputs; ``aclose()`` lets the plan clean up
        (``driver.CallerStopped``)."""
        stepper: driver.Stepper[None] = driver.Stepper(plan)
        while (step := stepper.step()) is not driver.DONE:
            if isinstance(step, steps.Step):
                await self._do(stepper, step)
            else:
                try:
                    yield step
                except BaseException as exc:  # GeneratorExit included
                    stepper.fail(exc)

    async def _do(self, stepper: driver.Stepper[Any], cmd: steps.Step) -> None:
        """Take one step of an iterated plan, handing its answer or error back to the plan (a
        cancellation too, so that its clean-up runs)."""
        try:
            stepper.answer(await self._take(cmd))
        except BaseException as exc:
            stepper.fail(exc)

    async def _take(self, cmd: steps.Step) -> Any:
        """One step's answer. ``Send`` and ``Pop`` share their round trips with concurrent
        calls'; a ``Pop`` (every wait) is dispatched first."""
        if isinstance(cmd, steps.Pop):
            return await self._pop(cmd)
        if isinstance(cmd, steps.Send):
            return await self._submits(cmd.subs, cmd.until)
        if isinstance(cmd, steps.Sleep):
            return await _sleep(cmd.seconds)
        return await cmd.retry.acall(self._once, cmd)

    async def _pop(self, cmd: steps.Pop) -> Any:
        """``cmd`` served by a BLPOP shared with other calls; ``tries`` says whether that was
        interrupted, as a retry of ``cmd`` itself would. A second call on a request already
        awaited runs ``cmd`` itself: the two BLPOPs race for the one reply."""
        if self._replies.awaits(cmd.key):
            return await cmd.bounded().acall(self._once, cmd)
        item, interrupted = await self._replies.pop(cmd.key, cmd.tag or self.model, cmd.until)
        cmd.tries = 2 if interrupted else 1
        return item

    async def _once(self, cmd: steps.Call | steps.Batch) -> Any:
        """One try of ``cmd`` on its shard's node; its retry policy calls this again after a
        transient error (a redirect followed, or the slot map read again, first)."""
        cmd.tries += 1
        routing = self._routing
        try:
            if routing.refresh_due():
                await self._topology.refresh()
                routing.refreshed()
            if isinstance(cmd, steps.Call):
                return await cmd.fn(routing.client(cmd.tag))
            groups = driver.pending(cmd, routing)
            if len(groups) == 1:
                await _round_trip(*groups[0])
            elif groups:
                await self._round_trips(groups)
            return cmd.answers()
        except REDIS_ERRORS as exc:
            routing.failed(exc)
            raise

    async def _round_trips(
        self, groups: list[tuple[redis.asyncio.Redis, list[steps.Part]]]
    ) -> None:
        """One round trip per node, all at once; each node's answers are taken before the
        first error is raised, so that a retry sends only what failed."""
        done = await asyncio.gather(
            *(_round_trip(client, parts) for client, parts in groups), return_exceptions=True
        )
        errors = [error for error in done if isinstance(error, BaseException)]
        for error in errors[1:]:
            if isinstance(error, REDIS_ERRORS):
                self._routing.failed(error)
        if errors:
            raise errors[0]

    # -- lifetime --------------------------------------------------------------------------

    async def close(self) -> None:
        """Close the connections, unless the Redis client was passed in; calls still waiting
        raise RedbatchError."""
        self._submits.close()
        self._replies.close()
        await self._topology.close()
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


async def _round_trip(client: redis.asyncio.Redis, parts: list[steps.Part]) -> None:
    """The parts' commands in one round trip to ``client``'s node."""
    packer = driver.packed(parts)
    if packer is not None:
        driver.settle(parts, await resp.round_trip_async(client, packer))
        return
    pipe = client.pipeline(transaction=False)
    driver.queue(pipe, parts)
    driver.settle(parts, await pipe.execute(raise_on_error=False))
