"""Round trips shared by an ``AsyncClient``'s concurrent calls.

A web back end calls ``infer`` from many handlers at once. With its own ``XADD`` and its own
``BLPOP`` per call, 64 concurrent calls cost the client 0.48 to 0.61 CPU ms a request here and
reached 1,600 to 2,000 requests/s (tiny model), where ``map()`` with as many in flight cost 0.1
ms and reached 6,800/s; sharing the round trips as below, 0.25 to 0.27 ms and 3,100 to 3,600/s.

- ``Coalescer``: submits made while one is on the wire go together in the next round trip.
- ``ReplyHub``: one ``BLPOP`` waits for the replies of many calls, and when it returns, one
  pipelined ``LPOP`` sweeps up the others that are ready (replies of one batch arrive together).
  A call that starts waiting while every ``BLPOP`` is blocked gets a new one with the other
  newcomers, so no call waits on a ``BLPOP`` that does not watch its key; a ``BLPOP`` that
  returns takes the newcomers into its next round, so their number stays near the number of
  batches in flight. Deadlines are kept by the ``BLPOP`` that watches a key (it blocks no
  longer than the first of them), so a reply is never popped after its caller gave up on it.
  A caller that is cancelled instead can lose its reply to a ``BLPOP`` already on the wire, as
  a cancelled ``BLPOP`` of its own could.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from producer.core import as_bytes
from producer.errors import RedbatchError, WaitTimeout

__all__ = ["Coalescer", "ReplyHub"]

T = TypeVar("T")

Blpop = Callable[[list[bytes], float], Awaitable[Any]]
Lpop = Callable[[list[bytes]], Awaitable[Sequence[Any]]]


class Coalescer(Generic[T]):
    """Calls ``send`` with every item handed to it while the previous ``send`` ran."""

    def __init__(self, send: Callable[[list[T]], Awaitable[None]]) -> None:
        self._send = send
        self._queue: list[tuple[Sequence[T], asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None

    async def __call__(self, items: Sequence[T]) -> None:
        """Send ``items`` with whatever else is waiting; raises what the send raised."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((items, future))
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        await future

    async def _run(self) -> None:
        batch: list[tuple[Sequence[T], asyncio.Future[None]]] = []
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    await self._send([item for items, _ in batch for item in items])
                except Exception as exc:
                    _settle(batch, exc)
                else:
                    _settle(batch, None)
        except BaseException:  # cancelled: the client is closing
            _settle([*batch, *self._queue], RedbatchError("the client was closed."))
            self._queue = []
            raise
        finally:
            self._task = None

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


def _settle(batch: Sequence[tuple[Any, asyncio.Future[None]]], exc: BaseException | None) -> None:
    for _, future in batch:
        if not future.done():
            if exc is None:
                future.set_result(None)
            else:
                future.set_exception(exc)


@dataclass(slots=True)
class _Waiting:
    """One awaited key: the future of its element, its deadline, and how many calls wait."""

    future: asyncio.Future[Any]
    deadline: float  # monotonic
    timeout_s: float  # for the message
    callers: int = 0


class ReplyHub:
    """Pops reply keys for many waiting calls with few ``BLPOP``s (see the module docstring).

    ``blpop(keys, block_s)`` and ``lpop(keys)`` are the client's commands, retries included;
    ``timed_out(key, timeout_s)`` makes the error a caller gets when its deadline passes.
    """

    def __init__(
        self,
        blpop: Blpop,
        lpop: Lpop,
        block_cap_s: float,
        timed_out: Callable[[bytes, float], WaitTimeout],
    ) -> None:
        self._blpop, self._lpop = blpop, lpop
        self._block_cap_s = block_cap_s
        self._timed_out = timed_out
        self._waiting: dict[bytes, _Waiting] = {}
        self._unwatched: list[bytes] = []  # awaited keys no BLPOP has taken yet
        self._starting = False  # a new watcher is about to take the unwatched keys
        self._watchers: set[asyncio.Task[None]] = set()

    async def wait(self, key: bytes, timeout_s: float) -> Any:
        """Pop the element at ``key``, waiting up to ``timeout_s``; WaitTimeout after that.
        Calls that wait on one key at once share its one element (and the first's deadline)."""
        waiting = self._waiting.get(key)
        if waiting is None:
            future = asyncio.get_running_loop().create_future()
            waiting = self._waiting[key] = _Waiting(future, time.monotonic() + timeout_s, timeout_s)
            self._unwatched.append(key)
            if not self._starting:
                self._starting = True
                task = asyncio.create_task(self._watch())
                self._watchers.add(task)
                task.add_done_callback(self._watchers.discard)
        waiting.callers += 1
        try:
            return await asyncio.shield(waiting.future)
        finally:
            waiting.callers -= 1
            if not waiting.callers and self._waiting.get(key) is waiting:
                del self._waiting[key]  # answered, timed out, or given up by its callers

    async def _watch(self) -> None:
        """Watch the unwatched keys, and newcomers whenever a BLPOP returns, until none wait."""
        keys: list[bytes] = []
        try:
            while True:
                keys = self._live(keys + self._take_unwatched())
                if not keys:
                    return
                block_s = self._block_s(keys)
                item = await self._blpop(keys, block_s)
                if item:
                    key, raw = item
                    self._settle(as_bytes(key), raw)
                    rest = self._live(keys)
                    if rest:
                        for key, raw in zip(rest, await self._lpop(rest), strict=True):
                            if raw is not None:
                                self._settle(key, raw)
                keys = self._expire(self._live(keys))
        except asyncio.CancelledError:
            self._fail(keys + self._take_unwatched(), RedbatchError("the client was closed."))
            raise
        except Exception as exc:  # the client's retries gave up: every watched call fails
            self._fail(keys, exc)

    def _take_unwatched(self) -> list[bytes]:
        keys, self._unwatched = self._unwatched, []
        self._starting = False
        return keys

    def _live(self, keys: list[bytes]) -> list[bytes]:
        """The keys still awaited (a caller cancelled, or answered, is dropped)."""
        return [
            key for key in keys if key in self._waiting and not self._waiting[key].future.done()
        ]

    def _block_s(self, keys: list[bytes]) -> float:
        first = min(self._waiting[key].deadline for key in keys)
        # Redis counts in milliseconds, and a timeout of 0 would block forever.
        return max(round(min(first - time.monotonic(), self._block_cap_s), 3), 0.001)

    def _expire(self, keys: list[bytes]) -> list[bytes]:
        """Fail the keys whose deadline has passed; return the others."""
        now = time.monotonic()
        left = []
        for key in keys:
            waiting = self._waiting[key]
            if waiting.deadline <= now:
                waiting.future.set_exception(self._timed_out(key, waiting.timeout_s))
            else:
                left.append(key)
        return left

    def _settle(self, key: bytes, raw: Any) -> None:
        waiting = self._waiting.get(key)
        if waiting is not None and not waiting.future.done():
            waiting.future.set_result(raw)

    def _fail(self, keys: list[bytes], exc: BaseException) -> None:
        for key in keys:
            waiting = self._waiting.get(key)
            if waiting is not None and not waiting.future.done():
                waiting.future.set_exception(exc)

    def close(self) -> None:
        for task in list(self._watchers):
            task.cancel()
