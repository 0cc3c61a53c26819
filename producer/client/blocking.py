"""``Client``: the blocking client, a thin redis-py shell that runs ``producer.client.plans``.

Every decision (what to send, how long to block, which chunk comes next) is made in the plans and
the sans-I/O pieces they use (``waiting``, ``mapwindow``, ``backlog``); this module only runs the
steps they yield. ``producer.client.aio.AsyncClient`` runs the same plans with ``await``.

Example::

    with Client("demo", "redis://127.0.0.1:6379/0") as client:
        y = client.infer({"x": np.ones((1, 4), np.float32)})["y"]
        for chunk in client.map({"x": big}, rows_per_request=32):
            chunk.raise_for_error()
            use(chunk.start, chunk.stop, chunk.outputs)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import redis
from numpy.typing import ArrayLike

from producer.client import driver, plans, steps
from producer.client.lanes import choose
from producer.client.mapwindow import MapPlan
from producer.client.results import Chunk, Result
from producer.client.settings import check_ttl_s
from producer.client.shell import DEFAULT_URL, BaseClient, Flavour
from producer.client.waiting import ReplyWaiter
from producer.protocol.errors import RedbatchError
from producer.redisio import resp
from producer.redisio.memory import info_memory
from producer.redisio.retry import REDIS_ERRORS
from producer.redisio.topology import Topology

__all__ = ["DEFAULT_URL", "Client"]

R = TypeVar("R")

# The backlog wait's sleep; a module attribute so tests can see that a submit waited.
_sleep = time.sleep


class Client(BaseClient[redis.Redis, Iterator[Chunk], Iterator[Result]]):
    """Submit requests to one model's workers and collect their replies (blocking I/O).

    ``url`` goes to ``redis.Redis.from_url``, so ``rediss://``, passwords and ACL users work
    (none given: ``$REDIS_URL`` as the CLI and the worker read it, else ``DEFAULT_URL``); or
    pass ``redis_client``, a ``redis.Redis`` or a ``redis.cluster.RedisCluster`` (then
    ``close()`` leaves it open; turn its own retries off, ``retry=Retry(NoBackoff(), 0)``, or
    a pop it retries after losing a reply goes unseen and that request is not sent again: see
    ``producer.redisio.retry``). On Redis Cluster, any node's URL will do: the client finds each
    shard's master itself, and follows ``MOVED`` replies.

    Requests are spread over the model's shards (``P:{M}:shards``, read at the first submit and
    every 5 s): ``submit`` takes each shard in turn from a random one, ``submit_many`` and each
    refill of ``map`` split evenly. ``submit`` returns a handle: the rid on the model's first
    shard (so a model with one shard needs no tags), ``T/R`` on another; ``poll``, ``wait``,
    ``wait_many`` and ``cancel`` take a handle or a bare rid (the first shard).

    Every submit, ``infer`` and ``map`` takes a lane (docs/protocol.md, "Lanes"): ``priority``
    is its class, ``"high"``, ``"normal"`` (the default) or ``"low"``; workers fill each batch
    from high first, then normal, then low, keeping a minimum share for each lower class so
    none starves. Send interactive calls as high or normal and batch jobs as low, and callers
    never wait behind a job's backlog. ``tenant`` (a name of ``[A-Za-z0-9_-]{1,64}``, default
    None) gives a team or customer a lane of its own in that class, served beside the other
    tenants' by weight (``P:{M}:weights``), so that one tenant's backlog does not hold up
    another's; its request ids begin with ``tenant.``, and a Redis user confined to the tenant
    (docs/security.md, ``redbatch-tenant-example``) can run this client. A bad priority or
    tenant raises ValueError before anything is sent. The default lane, normal without a
    tenant, is the stream every earlier producer writes, sent exactly as before.

    With ``max_backlog`` set, submits refuse with ``BacklogFull`` while the request streams of
    the lane they go to hold that many entries in all (summed over the shards: one limit for
    the lane, whatever its shard count; only that lane's streams are read), or wait for the
    backlog to shrink when ``wait_for_backlog`` is true (``infer`` waits no longer than its
    ``timeout_s``, then raises ``BacklogFull`` with nothing sent).

    Redis memory is a limit too: once ``used_memory`` reaches ``memory_high_watermark`` of
    ``maxmemory`` (0.8 by default; None turns it off; nothing applies without a ``maxmemory``),
    submits refuse with ``RedisFull``, or wait for room with ``wait_for_backlog``, so that the
    workers keep the rest to answer what is queued. Memory is read with ``INFO memory`` about
    once a second, not per submit, from each shard's node (on a cluster the fullest master
    counts); a write Redis itself refuses for memory is ``RedisFull`` too.

    Every Redis command is retried with capped, jittered backoff through outages of up to
    ``retry_s`` seconds (0: no retries), with one log line when an outage starts and one when it
    ends; then ``RedisUnavailable`` is raised. Other Redis errors raise ``ConnectionFailed`` at
    once. A retried submit resends the same request (same rid and body), so a lost answer can
    queue it twice, never as a different request; ``producer.redisio.retry`` has the details.
    """

    _flavour = Flavour(redis.Redis, redis.SSLConnection, info_memory, Topology)
    _topology: Topology

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
        priority: str = "normal",
        tenant: str | None = None,
    ) -> str:
        """Queue one request and return its handle (its rid on the model's first shard, else
        ``T/R``); ``deadline_s`` is seconds from now (> 0).

        A body Redis or the workers would refuse raises TooLarge at once, with nothing sent:
        one over Redis's ``proto-max-bulk-len`` (read once per client; Redis's default, 512
        MiB, when the user may not run ``CONFIG GET``), or over the smallest
        ``limits.max_request_bytes`` of the live workers (their records, read every 30 s).

        ``priority`` (``"high"``, ``"normal"``, ``"low"``) and ``tenant`` choose the request's
        lane (see the class); a tenant's ``rid``, when given, must begin with ``tenant.``."""
        lane = choose(priority, tenant)
        sub = plans.request(inputs, outputs, deadline_s, meta, rid, reply_ttl_s, lane)
        self._run(plans.submit(self._session, [sub]))
        return sub.handle

    def submit_many(
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
        """Queue many requests in one pipelined round trip (one per node on a cluster, sent one
        after another, every node's before any answer is read); returns their handles in
        order. They are split evenly over the shards, and go in transactions of up to 256
        requests (or about 1 MiB) of one shard each, each added whole or not at all: an error
        raised by a larger call (Redis refusing for memory part-way, an outage) may leave its
        first transactions queued.

        A body over the limits (see ``submit``) raises TooLarge naming its index, and then
        none of the requests is sent: the call returns no handles when it raises, so requests
        sent beside a refused one would run with nobody holding their handles. Fix or split
        that request and submit the list again."""
        lane = choose(priority, tenant)
        subs = plans.requests(requests, outputs, deadline_s, meta, reply_ttl_s, lane)
        if subs:
            self._run(plans.submit(self._session, subs))
        return [sub.handle for sub in subs]

    # -- replies ---------------------------------------------------------------------------

    def poll(self, handle: str) -> Result | None:
        """The reply of ``handle`` (or rid) if it has arrived, else None; never blocks, never
        consumes."""
        return self._run(plans.poll(self._session, self._session.settings.target(handle)))

    def wait(self, handle: str, timeout_s: float) -> Result:
        """Block for the reply of ``handle`` (or rid) and consume it; raises WaitTimeout.
        Interrupted (KeyboardInterrupt), it cancels the request, as ``infer`` does."""
        target = self._session.settings.target(handle)
        return self._run(plans.wait(self._session, target, timeout_s, time.monotonic()))

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
        priority: str = "normal",
        tenant: str | None = None,
    ) -> dict[str, np.ndarray]:
        """Submit, wait and return the outputs; raises the typed RequestFailed subclass.

        The whole call, submit included, ends within ``timeout_s``: WaitTimeout when no reply
        came, RedisUnavailable when Redis was down then, BacklogFull when the backlog never
        dropped (with ``wait_for_backlog``; the request was not sent). Interrupted
        (KeyboardInterrupt) once its request may have been sent, it sets the request's cancel
        key (one try) before the interruption goes on, so that no worker runs it for nobody.
        """
        started = time.monotonic()
        lane = choose(priority, tenant)
        sub = plans.request(inputs, outputs, deadline_s, meta, rid, reply_ttl_s, lane)
        return self._run(plans.infer(self._session, sub, timeout_s, started))

    def _drain(self, waiter: ReplyWaiter) -> Iterator[Result]:
        return self._iterate(plans.drain(self._session, waiter))

    def _map(self, plan: MapPlan) -> Iterator[Chunk]:
        self._run(plans.fit_rows(self._session, plan))  # NoWorkerInfo at the call
        return self._iterate(plans.run_map(self._session, plan))

    # -- control and status ----------------------------------------------------------------

    def cancel(self, handle: str, ttl_s: int = 3600) -> None:
        """Ask workers not to run ``handle`` (or rid): sets its cancel key, in its shard, for
        ``ttl_s`` seconds."""
        target = self._session.settings.target(handle)
        self._run(plans.cancel(self._session, [target], check_ttl_s("ttl_s", ttl_s)))

    def backlog(self) -> int:
        """Entries in the model's request streams (summed over its shards): queued plus in
        progress."""
        return self._run(plans.backlog(self._session))

    def workers(self) -> list[dict[str, Any]]:
        """The live workers' validation records, by name; forgets workers whose record expired."""
        return self._run(plans.workers(self._session))

    # -- running plans ---------------------------------------------------------------------

    def _run(self, plan: steps.Plan[R]) -> R:
        """Run ``plan`` to its end and return what it returns."""
        stepper = driver.Stepper(plan)
        while (step := stepper.step()) is not driver.DONE:
            self._do(stepper, step)
        return stepper.result

    def _iterate(self, plan: steps.Plan[None]) -> Iterator[Any]:
        """Run a streaming plan, yielding its outputs. Closing the iterator early stops the plan
        (``driver.CallerStopped``), whose clean-up still runs its commands."""
        stepper: driver.Stepper[None] = driver.Stepper(plan)
        while (step := stepper.step()) is not driver.DONE:
            if isinstance(step, steps.Step):
                self._do(stepper, step)
                continue
            try:
                yield step
            except BaseException as exc:  # GeneratorExit included: the plan cleans up
                stepper.fail(exc)

    def _do(self, stepper: driver.Stepper[Any], cmd: steps.Step) -> None:
        """Take one step, handing its answer or error back to the plan."""
        try:
            if isinstance(cmd, steps.Sleep):
                _sleep(cmd.seconds)
            elif isinstance(cmd, steps.Send):  # sent at once, by the plan it stands for
                stepper.enter(plans.send(self._session, cmd.subs, cmd.until))
            elif isinstance(cmd, steps.Shared):  # nobody to share it with: run now
                stepper.enter(cmd.start(self._session.retry.until(cmd.until, cmd.limit)))
            elif isinstance(cmd, steps.Aside):  # a clean-up: run now, its failure ignored
                with contextlib.suppress(RedbatchError):
                    self._run(cmd.plan)
            elif isinstance(cmd, steps.Pop):
                stepper.answer(cmd.bounded().call(self._once, cmd))
            else:
                stepper.answer(cmd.retry.call(self._once, cmd))
        except BaseException as exc:  # KeyboardInterrupt included: the plan cleans up
            stepper.fail(exc)

    def _once(self, cmd: steps.Call | steps.Batch) -> Any:
        """One try of ``cmd`` on its shard's node; its retry policy calls this again after a
        transient error (a redirect followed, or the slot map read again, first)."""
        cmd.tries += 1
        routing = self._routing
        try:
            if routing.refresh_due():
                self._topology.refresh()
                routing.refreshed()
            if isinstance(cmd, steps.Call):
                return cmd.fn(routing.client(cmd.tag))
            groups = driver.pending(cmd, routing)
            if len(groups) == 1:
                _round_trip(*groups[0])
            elif groups:
                self._round_trips(groups)
            return cmd.answers()
        except REDIS_ERRORS as exc:
            routing.failed(exc)
            raise

    def _round_trips(self, groups: list[tuple[redis.Redis, list[steps.Part]]]) -> None:
        """One round trip per node: every node's commands sent before any answer is read, so
        the nodes work at once. Each node's answers are taken before the first error is
        raised, so that a retry sends only what failed."""
        errors: list[Exception] = []
        flights = []
        try:
            for client, parts in groups:
                packer = driver.packed(parts)
                try:
                    if packer is None:
                        _round_trip(client, parts)
                    else:
                        flights.append((resp.send(client, packer), parts))
                except REDIS_ERRORS as exc:
                    errors.append(exc)
            for flight, parts in flights:
                try:
                    driver.settle(parts, flight.receive())
                except REDIS_ERRORS as exc:
                    errors.append(exc)
        finally:
            for flight, _ in flights:
                flight.abandon()  # only one still owing replies: an error cut its reading short
        for error in errors[1:]:
            self._routing.failed(error)
        if errors:
            raise errors[0]

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connections, unless the Redis client was passed in (the connections to
        other cluster nodes are the client's own: closed either way)."""
        self._topology.close()
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


def _round_trip(client: redis.Redis, parts: list[steps.Part]) -> None:
    """The parts' commands in one round trip to ``client``'s node."""
    packer = driver.packed(parts)
    if packer is not None:
        driver.settle(parts, resp.round_trip(client, packer))
        return
    pipe = client.pipeline(transaction=False)
    driver.queue(pipe, parts)
    driver.settle(parts, pipe.execute(raise_on_error=False))
