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
import functools
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import redis.asyncio
from numpy.typing import ArrayLike

from producer.client import driver, plans, sending, steps
from producer.client.coalesce import Coalescer, ReplyHub
from producer.client.lanes import choose
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
#: How long ``close()`` waits for the clean-ups of cancelled calls still under way.
_ASIDE_WAIT_S = 2.0

log = logging.getLogger(__name__)


class AsyncClient(BaseClient[redis.asyncio.Redis, AsyncIterator[Chunk], AsyncIterator[Result]]):
    """Submit requests to one model's workers and collect their replies (asyncio).

    ``url`` goes to ``redis.asyncio.Redis.from_url`` (on Redis Cluster, any node's; none given:
    ``$REDIS_URL``, else ``DEFAULT_URL``), or pass
    ``redis_client``, a ``redis.asyncio.Redis`` (then ``close()`` leaves it open). See
    ``Client`` for shards and handles, lanes (``priority``, ``tenant``: docs/protocol.md,
    "Lanes"), backpressure, ``retry_s`` and errors.
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
        self._asides: set[asyncio.Task[None]] = set()  # clean-ups of interrupted calls
        self._shared: dict[str, asyncio.Task[Any]] = {}  # Shared steps under way, by name
        self._closed = False

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
        priority: str = "normal",
        tenant: str | None = None,
    ) -> str:
        """Queue one request and return its handle (its rid on the model's first shard, else
        ``T/R``); ``deadline_s`` is seconds from now (> 0); ``priority`` and ``tenant`` choose
        its lane, as in ``Client``."""
        lane = choose(priority, tenant)
        sub = plans.request(inputs, outputs, deadline_s, meta, rid, reply_ttl_s, lane)
        await self._run(plans.submit(self._session, [sub]))
        return sub.handle

    async def submit_many(
        self,
        requests: Sequence[Mapping[str, ArrayLike]],
        *,
        outputs: Sequence[str] | None = None,
        deadline_s: float | None = None,
        meta: Any = None,
        reply_ttl_s: int | None = None,
        priority: str = "normal",
        tenant: str | None = None,
    ) -> list[str]:
        """As ``Client.submit_many``: one pipelined round trip (shared with concurrent calls;
        on a cluster one per node, run concurrently), split evenly over the shards, in
        transactions of up to 256 requests of one shard each; returns the handles. One body
        over the limits raises TooLarge with none sent, as in ``Client``."""
        lane = choose(priority, tenant)
        subs = plans.requests(requests, outputs, deadline_s, meta, reply_ttl_s, lane)
        if subs:
            await self._run(plans.submit(self._session, subs))
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
        Concurrent waits share their round trips: one BLPOP watches many keys of a shard. A
        wait cancelled by asyncio (``task.cancel()``, ``asyncio.wait_for``) cancels the request,
        as ``infer`` does: nobody is left to read its reply."""
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
        priority: str = "normal",
        tenant: str | None = None,
    ) -> dict[str, np.ndarray]:
        """Submit, wait and return the outputs; raises the typed RequestFailed subclass. The
        whole call, submit included, ends within ``timeout_s``, as ``Client.infer``'s does.

        Cancelled by asyncio (``task.cancel()``, ``asyncio.wait_for``'s timeout) once its
        request may have been sent, it sets the request's cancel key (one try, in a task of its
        own, so the cancellation is not held up), so that a worker skips it and no reply is
        left unread; calls sharing its round trips carry on."""
        started = time.monotonic()
        lane = choose(priority, tenant)
        sub = plans.request(inputs, outputs, deadline_s, meta, rid, reply_ttl_s, lane)
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
        if isinstance(cmd, steps.Aside):
            self._aside(cmd.plan)
            return None
        if isinstance(cmd, steps.Shared):
            return await self._run_shared(cmd)
        return await cmd.retry.acall(self._once, cmd)

    async def _run_shared(self, cmd: steps.Shared) -> Any:
        """``cmd``'s plan, run once in a task of its own (the client's retries) for every call
        that asks for it while it runs, each waiting until its own deadline; a caller that
        gives up leaves it running for the others."""
        if self._closed:
            raise RedbatchError("the client was closed.")
        task = self._shared.get(cmd.name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._run(cmd.start(self._session.retry)))
            self._shared[cmd.name] = task
            task.add_done_callback(functools.partial(self._shared_done, cmd.name))
        timeout_s = None if cmd.until is None else max(cmd.until - time.monotonic(), 0.0)
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except TimeoutError:
            raise sending.unread(self._session, cmd.limit) from None
        except asyncio.CancelledError:
            if task.cancelled():  # ended by close(), not by this caller's cancellation
                raise RedbatchError("the client was closed.") from None
            raise

    def _shared_done(self, name: str, task: asyncio.Task[Any]) -> None:
        if self._shared.get(name) is task:
            del self._shared[name]
        if not task.cancelled():
            task.exception()  # its callers got it, or have all gone: not "never retrieved"

    def _aside(self, plan: steps.Plan[None]) -> None:
        """Run ``plan`` in a task of its own, not waited for (``close()`` waits for it)."""
        task = asyncio.get_running_loop().create_task(self._quietly(plan))
        self._asides.add(task)
        task.add_done_callback(self._asides.discard)

    async def _quietly(self, plan: steps.Plan[None]) -> None:
        try:
            await self._run(plan)
        except RedbatchError as exc:  # best effort: the call it cleans up after has ended
            log.debug("a clean-up after an interrupted call failed: %s", exc)

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
        raise RedbatchError. Clean-ups still under way (cancel keys of cancelled calls) get a
        moment to finish first."""
        self._closed = True
        if self._asides:
            await asyncio.wait(list(self._asides), timeout=_ASIDE_WAIT_S)
        for task in list(self._shared.values()):
            task.cancel()
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
