"""Both clients behind one calling convention, so that each behaviour test is written once and
runs against ``Client`` and ``AsyncClient`` (a pytest plugin: ``pytest_plugins = ["shells"]``).

``shell`` is parametrised over "sync" and "async". ``shell.Client(...)`` takes ``Client``'s
arguments and gives a ``Client``, or an ``AsyncClient`` whose coroutines run on an event loop
in a thread of their own while the test blocks for the result (``Blocking``): its async
iterators come back as plain iterators. So a test body reads the same for both, fake workers
on threads serve both, and ``shell.run(x)`` turns what a raw redis-py client returned (a value,
or a coroutine on the asyncio flavour) into its value.

The fake worker and helpers the tests import are in ``tests/fakes.py``: a plugin module cannot
be imported by the test modules as well.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from fakes import MODEL, FakeReplier

from producer.client import aio, steps
from producer.client import blocking as client_module
from producer.client.aio import AsyncClient
from producer.client.blocking import Client

Command = steps.Call | steps.Batch
CALL_TIMEOUT_S = 120  # no call of a test blocks this long; a hang fails instead


# ---------------------------------------------------------------------------------------------
# The asyncio client, called from blocking code


class LoopThread:
    """An event loop running on its own thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[Any]) -> Any:
        """Run ``coro`` on the loop; block for its result, or raise its error."""
        return asyncio.run_coroutine_threadsafe(_awaited(coro), self.loop).result(CALL_TIMEOUT_S)

    def close(self) -> None:
        """Finish what is left on the loop, as ``asyncio.run`` does, then stop it."""
        self.run(self._finish())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    async def _finish(self) -> None:
        """Cancel the tasks left (a client's watchers), and close open async generators (a
        map stopped early), so that no connection outlives the loop."""
        left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        await self.loop.shutdown_asyncgens()


async def _awaited(coro: Awaitable[Any]) -> Any:
    return await coro


class BlockingIterator:
    """An async iterator stepped from blocking code; ``close()`` is its ``aclose()``."""

    def __init__(self, iterator: AsyncIterator[Any], loop: LoopThread) -> None:
        self._iterator, self._loop = iterator, loop

    def __iter__(self) -> BlockingIterator:
        return self

    def __next__(self) -> Any:
        try:
            return self._loop.run(self._iterator.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        self._loop.run(self._iterator.aclose())  # type: ignore[attr-defined]


class Blocking:
    """An ``AsyncClient`` called as a ``Client`` is: each method blocks for its result."""

    def __init__(self, client: AsyncClient, loop: LoopThread) -> None:
        self.aclient, self._loop = client, loop

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.aclient, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            out = attr(*args, **kwargs)
            if inspect.iscoroutine(out):
                return self._loop.run(out)
            if isinstance(out, AsyncIterator):
                return BlockingIterator(out, self._loop)
            return out

        return call

    def __enter__(self) -> Blocking:
        return self

    def __exit__(self, *_: object) -> None:
        self._loop.run(self.aclient.close())

    def __repr__(self) -> str:
        return repr(self.aclient)


class Shell:
    """One of the two clients, as the tests call it (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = LoopThread() if name == "async" else None
        self.module = aio if name == "async" else client_module
        self.cls: type[Client] | type[AsyncClient] = AsyncClient if name == "async" else Client

    def Client(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 (reads as the class)
        """The shell's client, built from ``Client``'s arguments."""
        if self.loop is None:
            return Client(*args, **kwargs)
        return Blocking(AsyncClient(*args, **kwargs), self.loop)

    def redis_from_url(self, url: str, **kwargs: Any) -> Any:
        """A raw redis-py client of the shell's flavour, to pass as ``redis_client``."""
        flavour = redis.asyncio.Redis if self.loop is not None else redis.Redis
        return flavour.from_url(url, **kwargs)

    def run(self, value: Any) -> Any:
        """``value``, awaited on the loop when it is a coroutine (an asyncio client's answer)."""
        if self.loop is not None and inspect.isawaitable(value):
            return self.loop.run(value)
        return value

    def patch_sleep(self, monkeypatch: pytest.MonkeyPatch, seen: Callable[[float], None]) -> None:
        """Call ``seen(seconds)`` at each backlog or memory wait's sleep, then sleep."""
        real = self.module._sleep
        if self.loop is None:

            def sleep(seconds: float) -> None:
                seen(seconds)
                real(seconds)

            monkeypatch.setattr(self.module, "_sleep", sleep)
            return

        async def asleep(seconds: float) -> None:
            seen(seconds)
            await real(seconds)

        monkeypatch.setattr(self.module, "_sleep", asleep)

    def patch_tries(
        self,
        monkeypatch: pytest.MonkeyPatch,
        after: Callable[[Command, Any], None] | None = None,
        *,
        before: Callable[[Command], None] | None = None,
    ) -> None:
        """Call ``before(command)`` before each try of a Redis command, and ``after(command,
        answer)`` after each that answered; either may raise, as a lost connection would."""

        def hooked(cmd: Command, answer: Any) -> Any:
            if after is not None:
                after(cmd, answer)
            return answer

        original = self.cls._once
        if self.loop is None:

            def once(client: Client, cmd: Command) -> Any:
                if before is not None:
                    before(cmd)
                return hooked(cmd, original(client, cmd))  # type: ignore[arg-type]

            monkeypatch.setattr(self.cls, "_once", once)
            return

        async def aonce(client: AsyncClient, cmd: Command) -> Any:
            if before is not None:
                before(cmd)
            return hooked(cmd, await original(client, cmd))  # type: ignore[arg-type,misc]

        monkeypatch.setattr(self.cls, "_once", aonce)

    def close(self) -> None:
        if self.loop is not None:
            self.loop.close()


@pytest.fixture(params=["sync", "async"])
def shell(request: pytest.FixtureRequest) -> Iterator[Shell]:
    """Each client in turn: the test runs once with ``Client``, once with ``AsyncClient``."""
    each = Shell(request.param)
    yield each
    each.close()


@pytest.fixture
def client(shell: Shell, redis_url: str) -> Iterator[Any]:
    """The shell's client on the module's Redis, closed after the test."""
    with shell.Client(MODEL, redis_url) as each:
        yield each


@pytest.fixture
def replier(redis_url: str) -> Iterator[FakeReplier]:
    fake = FakeReplier(redis_url).start()
    yield fake
    fake.stop()
