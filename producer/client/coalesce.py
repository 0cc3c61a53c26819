"""Round trips shared by an ``AsyncClient``'s concurrent calls: the asyncio driver hands the
``Send`` and ``Pop`` steps of the plans (``producer.client.steps``) to these, so every call runs
the same plan as in ``Client`` and only the round trips are shared.

A web back end calls ``infer`` from many handlers at once. With its own ``XADD`` and its own
``BLPOP`` per call, each call pays a round trip's Python and system-call cost twice, where
``map()`` pays it once per window; sharing the round trips as below brings concurrent calls
close to that (docs/design.md has the figures).

- ``Coalescer``: submits made while one is on the wire go together in the next round trip. A
  caller cancelled before its turn is taken out; one cancelled while its round trip is on the
  wire may still have been sent. A round trip's retries and backlog wait end at the
  first deadline among its calls (an ``infer``'s ``timeout_s``); the calls whose time is up then
  fail, and the others go again in the next round trip, as with a shared ``BLPOP`` below.
- ``ReplyHub``: one ``BLPOP`` serves the ``Pop`` steps of many calls, and when it returns, one
  pipelined ``LPOP`` sweeps up the others that are ready (replies of one batch arrive together).
  A ``BLPOP`` watches one shard's keys (one slot: contract section 1), so each shard with
  waiting calls has its own watchers, and a reply on one shard never waits for another's.
  A call that starts waiting while every ``BLPOP`` of its shard is blocked gets a new one with
  the other newcomers, so no call waits on a ``BLPOP`` that does not watch its key; a ``BLPOP`` that
  returns takes the newcomers into its next round, so their number stays near the number of
  batches in flight. Deadlines are kept by the ``BLPOP`` that watches a key (it blocks no
  longer than the first of them). A ``BLPOP`` on the wire can still pop the reply of a call
  that was cancelled meanwhile: that reply is kept in memory (an hour, 4,096 at most), where a
  later ``wait`` or ``poll`` of the same request finds it, rather than lost. A second call that
  waits on a request already awaited waits with a ``BLPOP`` of its own: the two race for the
  one reply. A shared ``BLPOP`` that needed a retry, or a sweep that failed, may have lost a
  reply it popped: each call it watched is told so (``interrupted``), and its plan sends its
  request again, as ``Client``'s does after its own ``BLPOP`` needed a retry. A key of another
  type than a list (someone set a reply key to a string) makes a ``BLPOP`` over it fail for all
  the keys it watches; the sweep that follows then finds which key it is (its ``LPOP`` answers
  ``WRONGTYPE`` alone), and that call alone gets the error as its answer.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from producer.client.results import as_bytes
from producer.protocol.errors import ConnectionFailed, RedbatchError, RedisUnavailable
from producer.redisio.resp import is_wrong_type

__all__ = ["Coalescer", "ReplyHub"]

T = TypeVar("T")

# send(items, until): send items, giving up at the monotonic time ``until`` (None: no bound)
Send = Callable[[list[T], float | None], Awaitable[None]]
# blpop(tag, keys, until): BLPOP over keys of shard ``tag``, blocking until the monotonic time
# ``until`` at most, and whether it needed a retry; lpop(tag, keys): LPOP of each
Blpop = Callable[[str, list[bytes], float], Awaitable[tuple[Any, bool]]]
Lpop = Callable[[str, list[bytes]], Awaitable[Sequence[Any]]]

_ORPHANS_KEPT = 4096
_ORPHAN_TTL_S = 3600.0


def _closed() -> RedbatchError:
    return RedbatchError("the client was closed.")


@dataclass(eq=False, slots=True)
class _Queued(Generic[T]):
    """One call's items, the future it awaits, its deadline (monotonic; None: none) and when
    it was queued (monotonic)."""

    items: Sequence[T]
    future: asyncio.Future[None]
    until: float | None
    queued_at: float
    budget: bool = False  # ``until`` is the end of the client's retry_s, not the caller's


class Coalescer(Generic[T]):
    """Calls ``send`` with every item handed to it while the previous ``send`` ran.

    ``retry_s`` is the client's retry budget: a call sent again after a round trip gave up at
    another call's deadline still fails once it has been retrying that long. ``unsent()`` is
    the error of a call whose deadline passed while it waited for its turn.
    """

    def __init__(self, send: Send[T], *, retry_s: float, unsent: Callable[[], Exception]) -> None:
        self._send = send
        self._retry_s = retry_s
        self._unsent = unsent
        self._queue: list[_Queued[T]] = []
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        # One timer, at the first deadline among the queued calls, not one per call: a timer per
        # infer is a heap entry and a callback per request (docs/design.md has its cost).
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    async def __call__(self, items: Sequence[T], until: float | None = None) -> None:
        """Send ``items`` with whatever else is waiting, giving up at ``until`` (monotonic);
        raises what the send raised."""
        if self._closed:
            raise _closed()
        now = time.monotonic()
        entry = _Queued(items, asyncio.get_running_loop().create_future(), until, now)
        self._queue.append(entry)
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        if until is not None and until < self._timer_at:
            self._arm(until)
        try:
            await entry.future
        except asyncio.CancelledError:
            if entry in self._queue:  # not taken yet: it will not be sent
                self._queue.remove(entry)
            raise

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_later(at - time.monotonic(), self._expire_due)

    def _expire_due(self) -> None:
        """Fail the queued calls whose deadline has passed. A round trip on the wire ends by
        the first deadline among its calls; one queued behind it is failed here, unsent, so
        that no call outlasts its deadline while it waits for its turn."""
        self._timer, self._timer_at = None, math.inf
        now = time.monotonic()
        due = [e for e in self._queue if e.until is not None and e.until <= now]
        if due:
            self._queue = [e for e in self._queue if e not in due]
            for entry in due:
                _settle([entry], self._unsent())  # an error each: they raise in other tasks
        later = [e.until for e in self._queue if e.until is not None]
        if later:
            self._arm(min(later))

    async def _run(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                until = min((e.until for e in batch if e.until is not None), default=None)
                try:
                    await self._send([item for e in batch for item in e.items], until)
                except Exception as exc:
                    self._queue[:0] = _fail_expired(batch, until, exc, self._retry_s)
                except BaseException:
                    _settle(batch, _closed())
                    raise
                else:
                    _settle(batch, None)
        finally:
            self._task = None

    def close(self) -> None:
        """Fail what waits to be sent and stop sending."""
        self._closed = True
        queued, self._queue = self._queue, []
        _settle(queued, _closed())
        if self._task is not None:
            self._task.cancel()
        if self._timer is not None:
            self._timer.cancel()


def _fail_expired(
    batch: list[_Queued[T]], until: float | None, exc: Exception, retry_s: float
) -> list[_Queued[T]]:
    """Fail with ``exc`` the calls whose time is up; return the others, to send again.

    A send that failed before ``until`` (retries spent, a refused command, a backlog full with
    no waiting) fails every call. One that gave up at ``until`` did so for the first call's
    deadline: the calls with time left go again (resending is safe, as a retry is: same rids
    and bodies), and the call that set ``until`` is failed, so the next send's is later. Time
    left means before the call's own deadline and, through an outage, within ``retry_s`` of
    its queueing, so that a call without a deadline is not retried forever by its neighbours'.
    """
    now = time.monotonic()
    if until is None or now < until:
        _settle(batch, exc)
        return []
    outage = isinstance(exc, ConnectionFailed)
    for e in batch:
        if (e.until is not None and e.until <= now) or (outage and now - e.queued_at >= retry_s):
            _settle([e], _spent(exc, retry_s) if e.budget else exc)
    again = [e for e in batch if not e.future.done()]
    if outage:  # a call without a deadline still retries no longer than retry_s in all
        for e in again:
            if e.until is None:
                e.until, e.budget = e.queued_at + retry_s, True
    return again


def _spent(exc: Exception, retry_s: float) -> Exception:
    """The error of a call without a deadline whose retries ran to the client's ``retry_s``."""
    spent = RedisUnavailable(f"{exc} (retried for the client's retry_s, {retry_s:g} s, in all)")
    spent.__cause__ = exc
    return spent


def _settle(batch: Sequence[_Queued[Any]], exc: BaseException | None) -> None:
    for entry in batch:
        if not entry.future.done():
            if exc is None:
                entry.future.set_result(None)
            else:
                entry.future.set_exception(exc)


@dataclass(slots=True)
class _Waiting:
    """One awaited key: the future of its ``Pop``'s answer, and its deadline."""

    future: asyncio.Future[tuple[Any, bool]]
    deadline: float  # monotonic


class ReplyHub:
    """Serves many calls' ``Pop`` steps with few ``BLPOP``s (see the module docstring).

    ``blpop(tag, keys, until)`` and ``lpop(tag, keys)`` are the client's commands on shard
    ``tag``, retries included; ``blpop`` also says whether it needed a retry. A ``pop`` answers
    as the BLPOP of one call would: ``[key, element]``, or None once its deadline has passed,
    or None early, with ``interrupted``, when a shared command that watched its key needed a
    retry or failed (a reply it popped may have been lost with its connection): the plan then
    sends its request again and pops once more.
    """

    def __init__(self, blpop: Blpop, lpop: Lpop) -> None:
        self._blpop, self._lpop = blpop, lpop
        self._waiting: dict[bytes, _Waiting] = {}
        self._unwatched: dict[str, list[bytes]] = {}  # per shard: keys no BLPOP has taken yet
        self._starting: set[str] = set()  # shards whose new watcher is yet to take them
        self._watchers: set[asyncio.Task[None]] = set()
        # replies popped after their callers gave up: key -> (element, monotonic expiry)
        self._orphans: OrderedDict[bytes, tuple[Any, float]] = OrderedDict()
        self._closed = False

    def peek(self, key: bytes) -> Any:
        """A reply this hub popped for a call that gave up on it (None: none)."""
        orphan = self._orphans.get(key)
        return None if orphan is None or orphan[1] < time.monotonic() else orphan[0]

    def awaits(self, key: bytes) -> bool:
        """True when a call waits on ``key`` already: a second one pops with a BLPOP of its
        own, and the two race for the one reply, as two BLPOPs would."""
        return key in self._waiting and self.peek(key) is None

    async def pop(self, key: bytes, tag: str, until: float) -> tuple[Any, bool]:
        """The element at ``key`` of shard ``tag`` as a BLPOP answers (``[key, element]``), or
        None once ``until`` (monotonic) has passed; and whether the pop was interrupted."""
        if self._closed:
            raise _closed()
        if self.peek(key) is not None:
            return [key, self._orphans.pop(key)[0]], False
        future = asyncio.get_running_loop().create_future()
        waiting = self._waiting[key] = _Waiting(future, until)
        self._unwatched.setdefault(tag, []).append(key)
        if tag not in self._starting:
            self._starting.add(tag)
            task = asyncio.create_task(self._watch(tag))
            self._watchers.add(task)
            task.add_done_callback(self._watchers.discard)
        try:
            return await future
        finally:
            if self._waiting.get(key) is waiting:
                del self._waiting[key]  # answered, timed out, or given up by its caller

    async def _watch(self, tag: str) -> None:
        """Watch shard ``tag``'s unwatched keys, and its newcomers whenever a BLPOP returns,
        until none wait."""
        keys: list[bytes] = []
        try:
            while True:
                keys = self._live(list(dict.fromkeys(keys + self._take_unwatched(tag))))
                if not keys:
                    return
                until = min(self._waiting[k].deadline for k in keys)
                try:
                    item, retried = await self._blpop(tag, keys, until)
                except RedisUnavailable as exc:  # an outage outlasted the first deadline
                    keys = self._fail_expired(keys, until, exc)
                    continue
                except ConnectionFailed as exc:
                    if not is_wrong_type(exc):
                        raise
                    await self._sweep(tag, keys)  # answers the key of another type its error
                    keys = self._expire(self._live(keys))
                    continue
                if item:
                    key, raw = item
                    self._settle(as_bytes(key), raw)
                if retried:  # the answer of a try that failed may have held a reply
                    self._interrupt(self._live(keys))
                elif item:
                    await self._sweep(tag, self._live(keys))
                keys = self._expire(self._live(keys))
        except asyncio.CancelledError:
            self._fail(keys, _closed())
            raise
        except Exception as exc:  # the client's retries gave up: every watched call fails
            self._fail(keys, exc)

    def _take_unwatched(self, tag: str) -> list[bytes]:
        self._starting.discard(tag)
        return self._unwatched.pop(tag, [])

    def _live(self, keys: list[bytes]) -> list[bytes]:
        """The keys still awaited (a caller cancelled, or answered, is dropped)."""
        waiting = self._waiting
        return [key for key in keys if key in waiting and not waiting[key].future.done()]

    def _expire(self, keys: list[bytes]) -> list[bytes]:
        """Answer None to the keys whose deadline has passed; return the others."""
        now = time.monotonic()
        left = []
        for key in keys:
            waiting = self._waiting[key]
            if waiting.deadline <= now:
                waiting.future.set_result((None, False))
            else:
                left.append(key)
        return left

    def _interrupt(self, keys: list[bytes]) -> None:
        """Answer None, interrupted, to ``keys``: their calls send again and pop anew."""
        for key in keys:
            self._waiting[key].future.set_result((None, True))

    def _settle(self, key: bytes, raw: Any) -> None:
        """Answer ``key``'s call with ``raw``: the element popped, or the key's WRONGTYPE
        error (never kept for a later call: the key still holds it)."""
        waiting = self._waiting.get(key)
        if waiting is not None and not waiting.future.done():
            waiting.future.set_result(([key, raw], False))
            return
        if isinstance(raw, Exception):
            return
        # Its callers gave up while the BLPOP or LPOP that popped it was on the wire.
        self._orphans[key] = (raw, time.monotonic() + _ORPHAN_TTL_S)
        while len(self._orphans) > _ORPHANS_KEPT:
            self._orphans.popitem(last=False)

    async def _sweep(self, tag: str, keys: list[bytes]) -> None:
        """After a BLPOP's answer, one LPOP of the other keys (one try: the next BLPOP finds
        whatever this one missed). One that failed may have popped replies it lost: its keys
        are interrupted."""
        if not keys:
            return
        try:
            popped = await self._lpop(tag, keys)
        except RedisUnavailable:
            self._interrupt(self._live(keys))
            return
        for key, raw in zip(keys, popped, strict=True):
            if raw is not None:
                self._settle(key, raw)

    def _fail_expired(self, keys: list[bytes], until: float, exc: RedisUnavailable) -> list[bytes]:
        """Fail with ``exc`` the calls whose deadline has passed; the others keep waiting.
        Retries that ended before ``until``, the deadline they were given, will not try again
        (a client with retry_s 0, or its budget spent): then every call fails. Otherwise the
        call that set ``until`` is failed here or gone, so the next BLPOP's is later: no spin."""
        keys = self._live(keys)  # a caller cancelled during the outage is gone
        now = time.monotonic()
        if now < until:
            self._fail(keys, exc)
            return []
        self._fail([k for k in keys if self._waiting[k].deadline <= now], exc)
        return self._live(keys)

    def _fail(self, keys: list[bytes], exc: BaseException) -> None:
        for key in keys:
            waiting = self._waiting.get(key)
            if waiting is not None and not waiting.future.done():
                waiting.future.set_exception(exc)

    def close(self) -> None:
        """Fail every call still waiting and stop watching."""
        self._closed = True
        self._unwatched, self._starting = {}, set()
        self._fail(list(self._waiting), _closed())
        for task in list(self._watchers):
            task.cancel()
