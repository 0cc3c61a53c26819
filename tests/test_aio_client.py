"""What only AsyncClient does: concurrent calls share their round trips
(``producer.client.coalesce``), under the same plans as ``Client``'s.

Every other behaviour runs against both clients in the shared suite (``tests/shells.py``). Each
test here is a plain function that runs its scenario with ``asyncio.run``; the fake worker
(``fakes.FakeReplier``) answers from a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import numpy as np
import pytest
import redis
import redis.asyncio
from fakes import FAKE_MODEL, MODEL, PREFIX, STREAM, FakeReplier, xs

from producer.client import aio, plans, steps
from producer.client.aio import AsyncClient
from producer.client.coalesce import Coalescer, ReplyHub
from producer.client.results import as_bytes
from producer.protocol import codec, keys
from producer.protocol.codec import Reply
from producer.protocol.errors import BacklogFull, RedbatchError, RedisUnavailable, WaitTimeout


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


@contextlib.contextmanager
def replying(url: str) -> Any:
    fake = FakeReplier(url).start()
    try:
        yield fake
    finally:
        fake.stop()


# ---------------------------------------------------------------------------------------------
# Concurrent calls share round trips (producer/client/coalesce.py)


def a_reply(rid: str) -> bytes:
    return codec.encode_reply(
        Reply(rid=rid, ok=True, model=FAKE_MODEL, worker="hand", timings_ms={}, outputs={})
    )


async def eventually(
    check: Callable[[], Awaitable[object]], what: str, timeout_s: float = 5
) -> None:
    """Return once ``await check()`` is true (Redis state, which offers no event); fail after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout_s:g} s"
        await asyncio.sleep(0.005)


async def blocked_clients(conn: redis.asyncio.Redis, at_least: int) -> None:
    """Return once Redis has ``at_least`` clients blocked (in a BLPOP)."""

    async def blocked() -> bool:
        return int((await conn.info("clients"))["blocked_clients"]) >= at_least

    await eventually(blocked, f"{at_least} blocked client(s)")


async def pop_until(hub: ReplyHub, key: bytes, timeout_s: float) -> Any:
    """Pop ``key`` through ``hub`` as the wait plan does: again after an early or interrupted
    answer, until its deadline (then WaitTimeout, naming the key)."""
    until = time.monotonic() + timeout_s
    while True:
        item, _ = await hub.pop(key, "", until)
        if item:
            return item[1]
        if time.monotonic() >= until:
            raise WaitTimeout(f"late {key.decode()}")


@contextlib.asynccontextmanager
async def client_and_observer(url: str) -> AsyncIterator[tuple[AsyncClient, redis.asyncio.Redis]]:
    """A client, and a second connection to watch and write Redis beside it."""
    async with AsyncClient(MODEL, url) as client:
        observer = redis.asyncio.Redis.from_url(url)
        try:
            yield client, observer
        finally:
            await observer.aclose()


def test_concurrent_infers_share_submits_and_waits(
    redis_url: str, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    xadd_trips: list[int] = []
    send = plans.send

    def counting_send(session: Any, subs: Any, until: float | None = None) -> Any:
        xadd_trips.append(len(subs))  # one XADD round trip per send, Redis having room
        return send(session, subs, until)

    monkeypatch.setattr(plans, "send", counting_send)
    blpops_before = int(rconn.info("commandstats").get("cmdstat_blpop", {}).get("calls", 0))

    async def scenario() -> None:
        async with AsyncClient(MODEL, redis_url) as client:

            async def one(i: int) -> None:
                out = await client.infer({"x": xs(1) + i}, timeout_s=10)
                np.testing.assert_array_equal(out["y"], (xs(1) + i) * 2)

            await asyncio.gather(*(one(i) for i in range(64)))

    with replying(redis_url):
        run(scenario)
    blpops = int(rconn.info("commandstats")["cmdstat_blpop"]["calls"]) - blpops_before
    assert sum(xadd_trips) == 64
    assert len(xadd_trips) <= 4  # 64 alone without coalescing
    assert blpops <= 16  # one per call without the hub


def test_a_call_that_starts_waiting_during_a_blocked_blpop_is_not_held_by_it(
    redis_url: str,
) -> None:
    async def scenario() -> None:
        async with client_and_observer(redis_url) as (client, observer):
            slow = asyncio.create_task(client.wait("never-answered", timeout_s=3.0))
            await blocked_clients(observer, 1)  # its BLPOP is on the wire
            started = time.monotonic()
            quick = asyncio.create_task(client.wait("answered", timeout_s=3.0))
            await blocked_clients(observer, 2)  # a second BLPOP watches the newcomer
            await observer.rpush(keys.reply_key(PREFIX, MODEL, "answered"), a_reply("answered"))
            result = await quick
            assert result.rid == "answered"
            assert time.monotonic() - started < 1.0  # not after the first call's 3 s
            assert not slow.done()
            with pytest.raises(WaitTimeout, match="never-answered"):
                await slow
            # A reply that comes after its caller gave up stays for a later wait or poll.
            late_key = keys.reply_key(PREFIX, MODEL, "never-answered")
            await observer.rpush(late_key, a_reply("never-answered"))
            assert await observer.llen(late_key) == 1
            assert (await client.wait("never-answered", timeout_s=1.0)).ok

    run(scenario)


def test_one_call_cancelled_or_timed_out_leaves_the_others_their_replies(
    redis_url: str,
) -> None:
    async def scenario() -> None:
        async with client_and_observer(redis_url) as (client, writer):
            waits = {
                rid: asyncio.create_task(client.wait(rid, timeout_s=t))
                for rid, t in (("a", 5.0), ("b", 5.0), ("c", 0.3), ("d", 5.0))
            }
            await blocked_clients(writer, 1)
            waits["b"].cancel()
            with pytest.raises(WaitTimeout):
                await waits["c"]
            for rid in ("a", "d"):
                await writer.rpush(keys.reply_key(PREFIX, MODEL, rid), a_reply(rid))
            assert (await waits["a"]).rid == "a"
            assert (await waits["d"]).rid == "d"
            with pytest.raises(asyncio.CancelledError):
                await waits["b"]

    run(scenario)


def test_two_calls_waiting_on_one_request_race_for_its_one_reply(redis_url: str) -> None:
    # As with two BLPOPs: one call gets the reply, the other waits out its own timeout.
    async def scenario() -> None:
        async with AsyncClient(MODEL, redis_url) as client:
            rid = await client.submit({"x": xs(1)})
            started = time.monotonic()
            outcomes = await asyncio.gather(
                client.wait(rid, timeout_s=1.0),
                client.wait(rid, timeout_s=1.0),
                return_exceptions=True,
            )
        assert sorted(type(o).__name__ for o in outcomes) == ["Result", "WaitTimeout"]
        assert time.monotonic() - started < 5

    with replying(redis_url):
        run(scenario)


def test_closing_the_client_ends_the_calls_still_waiting(redis_url: str) -> None:
    async def scenario() -> None:
        client = AsyncClient(MODEL, redis_url)
        observer = redis.asyncio.Redis.from_url(redis_url)
        try:
            waiting = asyncio.create_task(client.wait("never", timeout_s=30))
            await blocked_clients(observer, 1)
            started = time.monotonic()
            await client.close()
            with pytest.raises(RedbatchError, match="closed"):
                await waiting
            assert time.monotonic() - started < 2.0
        finally:
            await observer.aclose()

    run(scenario)


def test_closing_before_any_round_trip_ran_ends_every_call(redis_url: str) -> None:
    async def scenario() -> None:
        client = AsyncClient(MODEL, redis_url)
        waiting = asyncio.create_task(client.wait("never", timeout_s=1.0))
        submitting = asyncio.create_task(client.submit({"x": xs(1)}))
        await asyncio.sleep(0)  # both registered; their round trips not started
        await client.close()
        for call in (waiting, submitting):
            with pytest.raises(RedbatchError, match="closed"):
                await call
        with pytest.raises(RedbatchError, match="closed"):
            await client.wait("other", timeout_s=0.2)
        with pytest.raises(RedbatchError, match="closed"):
            await client.submit({"x": xs(1)})

    run(scenario)


def test_a_submit_cancelled_before_its_turn_is_not_sent(
    redis_url: str, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        gated = asyncio.Event()
        real_sleep = aio._sleep

        async def gate_sleep(seconds: float) -> None:
            gated.set()
            await real_sleep(seconds)

        monkeypatch.setattr(aio, "_sleep", gate_sleep)
        for _ in range(3):
            rconn.xadd(STREAM, {"filler": "1"})  # the backlog is full: the first send waits
        async with AsyncClient(MODEL, redis_url, max_backlog=3, wait_for_backlog=True) as client:
            first = asyncio.create_task(client.submit({"x": xs(1)}, rid="first"))
            await gated.wait()  # its send is under way, in the backlog gate
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.submit({"x": xs(1)}, rid="ghost"), 0.3)
            rconn.delete(STREAM)  # the backlog drains
            await first
        assert [f[b"rid"] for _, f in rconn.xrange(STREAM)] == [b"first"]

    run(scenario)


def test_a_reply_popped_after_its_callers_gave_up_is_kept_for_the_next_wait(
    redis_url: str,
) -> None:
    async def scenario() -> None:
        async with client_and_observer(redis_url) as (client, observer):
            gave_up = asyncio.create_task(client.wait("k", timeout_s=30))
            await blocked_clients(observer, 1)  # its BLPOP on the wire, blocking for long
            gave_up.cancel()
            with pytest.raises(WaitTimeout):
                await client.wait("k", timeout_s=0.3)
            # The reply comes while the first call's BLPOP still blocks, and is popped by it
            key = keys.reply_key(PREFIX, MODEL, "k")
            await observer.rpush(key, a_reply("k"))

            async def popped() -> bool:
                return not await observer.llen(key)

            await eventually(popped, "the reply popped")
            polled = await client.poll("k")
            assert polled is not None
            assert polled.ok
            assert (await client.wait("k", timeout_s=1.0)).rid == "k"

    run(scenario)


def test_a_key_given_up_and_awaited_again_is_watched_once() -> None:
    # Scripted BLPOPs, in the order a busy loop can produce: the first blocks on [b, k] until
    # released, k's caller gives up and waits again, and the first watcher then takes k too.
    async def scenario() -> None:
        released = asyncio.get_running_loop().create_future()
        calls: list[list[bytes]] = []
        first_on_the_wire = asyncio.Event()

        async def blpop(_tag: str, keys_: list[bytes], until: float) -> tuple[Any, bool]:
            calls.append(list(keys_))
            if len(calls) == 1:
                first_on_the_wire.set()
                return await released, False
            await asyncio.sleep(max(until - time.monotonic(), 0.001))  # a BLPOP timing out
            return None, False

        async def lpop(_tag: str, keys_: list[bytes]) -> list[Any]:
            return [None] * len(keys_)

        hub = ReplyHub(blpop, lpop)
        b = asyncio.create_task(pop_until(hub, b"b", 0.6))
        k = asyncio.create_task(pop_until(hub, b"k", 10))
        await first_on_the_wire.wait()
        k.cancel()
        with pytest.raises(asyncio.CancelledError):
            await k
        again = asyncio.create_task(pop_until(hub, b"k", 0.3))
        released.set_result(None)
        with pytest.raises(WaitTimeout, match="late k"):
            await again
        with pytest.raises(WaitTimeout, match="late b"):
            await b
        assert all(len(c) == len(set(c)) for c in calls)

    run(scenario)


def test_a_call_cancelled_during_an_outage_leaves_the_others_waiting() -> None:
    # A BLPOP whose retries end at the first deadline (a's), with Redis still down; a's caller
    # gives up meanwhile. b, with time left, keeps waiting and gets its reply once Redis is back.
    async def scenario() -> None:
        down = True
        rounds: list[float] = []  # each BLPOP's deadline
        on_the_wire = asyncio.Event()
        went_round = asyncio.Event()  # a BLPOP with a later deadline than the first's

        async def blpop(_tag: str, keys_: list[bytes], until: float) -> tuple[Any, bool]:
            rounds.append(until)
            on_the_wire.set()
            if until > rounds[0]:
                went_round.set()
            while down and time.monotonic() < until:  # retrying until the deadline
                await asyncio.sleep(0.01)
            if down:
                raise RedisUnavailable("Redis stayed unavailable, past the waiting call's timeout")
            key = b"b" if b"b" in keys_ else keys_[0]
            return [key, b"reply-" + key], False

        async def lpop(_tag: str, keys_: list[bytes]) -> list[Any]:
            raise RedisUnavailable("down")  # the sweep failed: its calls pop again

        hub = ReplyHub(blpop, lpop)
        a = asyncio.create_task(pop_until(hub, b"a", 0.2))
        b = asyncio.create_task(pop_until(hub, b"b", 5.0))
        c = asyncio.create_task(pop_until(hub, b"c", 5.0))
        await on_the_wire.wait()  # the first BLPOP, for all three
        a.cancel()
        await went_round.wait()  # past a's deadline: the BLPOP gave up and went round again
        assert not b.done()
        assert not c.done()
        down = False
        assert await b == b"reply-b"
        assert await c == b"reply-c"  # its sweep failed; its next pop found it

    run(scenario)


class ScriptedBlpops:
    """BLPOPs for a ``ReplyHub`` that each wait for the test's answer: ``calls`` holds the keys
    of each, in order, and ``answer(i, ...)`` returns the i-th."""

    def __init__(self) -> None:
        self.calls: list[list[bytes]] = []
        self._answers: list[asyncio.Future[tuple[Any, bool]]] = []

    async def __call__(self, _tag: str, keys_: list[bytes], until: float) -> tuple[Any, bool]:
        self.calls.append(list(keys_))
        self._answers.append(asyncio.get_running_loop().create_future())
        return await self._answers[-1]

    async def on_the_wire(self, count: int) -> None:
        while len(self.calls) < count:
            await asyncio.sleep(0)

    def answer(self, i: int, item: Any, retried: bool) -> None:
        self._answers[i].set_result((item, retried))


def test_a_blpop_that_needed_a_retry_interrupts_only_the_calls_it_watched() -> None:
    # a waits in one BLPOP; b, which came while it blocked, in another. a's needed a retry (a
    # reply it popped may be lost): a is told to send again, b waits on and gets its reply.
    async def scenario() -> None:
        blpops = ScriptedBlpops()

        async def lpop(_tag: str, keys_: list[bytes]) -> list[Any]:
            return [None] * len(keys_)

        hub = ReplyHub(blpops, lpop)
        until = time.monotonic() + 10
        a = asyncio.create_task(hub.pop(b"a", "", until))
        await blpops.on_the_wire(1)
        b = asyncio.create_task(hub.pop(b"b", "", until))
        await blpops.on_the_wire(2)
        assert blpops.calls == [[b"a"], [b"b"]]
        blpops.answer(0, None, retried=True)
        assert await a == (None, True)
        assert not b.done()
        blpops.answer(1, [b"b", b"reply-b"], retried=False)
        assert await b == ([b"b", b"reply-b"], False)

    run(scenario)


def test_a_failed_sweep_interrupts_only_the_calls_it_swept() -> None:
    # a and c wait in one BLPOP, b in another. a's reply comes; the sweep of c after it fails
    # (it may have popped c's reply and lost it): c is told to send again, b is not.
    async def scenario() -> None:
        blpops = ScriptedBlpops()
        swept: list[list[bytes]] = []

        async def lpop(_tag: str, keys_: list[bytes]) -> list[Any]:
            swept.append(list(keys_))
            raise RedisUnavailable("down")

        hub = ReplyHub(blpops, lpop)
        until = time.monotonic() + 10
        a = asyncio.create_task(hub.pop(b"a", "", until))
        c = asyncio.create_task(hub.pop(b"c", "", until))
        await blpops.on_the_wire(1)
        b = asyncio.create_task(hub.pop(b"b", "", until))
        await blpops.on_the_wire(2)
        assert blpops.calls == [[b"a", b"c"], [b"b"]]
        blpops.answer(0, [b"a", b"reply-a"], retried=False)
        assert await a == ([b"a", b"reply-a"], False)
        assert await c == (None, True)
        assert swept == [[b"c"]]
        assert not b.done()
        blpops.answer(1, [b"b", b"reply-b"], retried=False)
        assert await b == ([b"b", b"reply-b"], False)

    run(scenario)


def _lose_the_first_reply_popped_from(
    monkeypatch: pytest.MonkeyPatch, key: str, *, own_blpop: bool = False
) -> list[bool]:
    """Make AsyncClient drop its connection once, right after a BLPOP popped the reply at
    ``key`` (with ``own_blpop``, only a call's BLPOP of its own, not a shared one): the reply is
    gone from Redis and never reaches the call. Returns a list that holds True once it was."""
    lost: list[bool] = []
    original = AsyncClient._once

    async def once(client: AsyncClient, cmd: steps.Call | steps.Batch) -> Any:
        answer = await original(client, cmd)
        if own_blpop and not isinstance(cmd, steps.Pop):
            return answer
        if cmd.name == "BLPOP" and answer and as_bytes(answer[0]).decode() == key and not lost:
            lost.append(True)
            raise redis.ConnectionError("connection dropped with the reply in it (test)")
        return answer

    monkeypatch.setattr(AsyncClient, "_once", once)
    return lost


def _sent_rids(rconn: redis.Redis) -> list[bytes]:
    entries: Any = rconn.xrange(STREAM)
    return [fields[b"rid"] for _, fields in entries]


def test_only_the_calls_of_a_blpop_that_lost_a_reply_send_again(
    redis_url: str, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given two infers waiting in two shared BLPOPs (b came while a's blocked)
    key_a, key_b = (keys.reply_key(PREFIX, MODEL, rid) for rid in ("a", "b"))
    lost = _lose_the_first_reply_popped_from(monkeypatch, key_a)

    async def scenario() -> None:
        async with client_and_observer(redis_url) as (client, observer):
            a = asyncio.create_task(client.infer({"x": xs(1)}, timeout_s=10, rid="a"))
            await blocked_clients(observer, 1)
            b = asyncio.create_task(client.infer({"x": xs(1)}, timeout_s=10, rid="b"))
            await blocked_clients(observer, 2)
            # When a's BLPOP loses a's reply with its connection and is retried
            await observer.rpush(key_a, a_reply("a"))

            async def a_sent_again() -> bool:
                return _sent_rids(rconn).count(b"a") == 2

            await eventually(a_sent_again, "a sent again")
            await observer.rpush(key_a, a_reply("a"))
            await observer.rpush(key_b, a_reply("b"))
            assert await a == {}
            assert await b == {}

        # Then a alone sent its request again
        assert lost == [True]
        assert sorted(_sent_rids(rconn)) == [b"a", b"a", b"b"]

    run(scenario)


def test_a_second_call_on_an_awaited_request_sends_again_after_its_own_blpop_lost_the_reply(
    redis_url: str, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a wait on k (the hub's BLPOP), then an infer of k, which pops with a BLPOP of its
    # own as the hub already awaits k
    key = keys.reply_key(PREFIX, MODEL, "k")
    lost = _lose_the_first_reply_popped_from(monkeypatch, key, own_blpop=True)

    async def scenario() -> None:
        async with client_and_observer(redis_url) as (client, observer):
            waiting = asyncio.create_task(client.wait("k", timeout_s=10))
            await blocked_clients(observer, 1)
            inferring = asyncio.create_task(client.infer({"x": xs(1)}, timeout_s=10, rid="k"))
            await blocked_clients(observer, 2)
            # When one reply goes to each BLPOP, the infer's lost with its connection
            for _ in range(2):
                await observer.rpush(key, a_reply("k"))

                async def popped() -> bool:
                    return not await observer.llen(key)

                await eventually(popped, "the reply popped")
            assert (await waiting).rid == "k"
            assert lost == [True]

            # Then the infer sends its request again, and gets the reply to that
            async def sent_again() -> bool:
                return _sent_rids(rconn) == [b"k", b"k"]

            await eventually(sent_again, "k sent again")
            await observer.rpush(key, a_reply("k"))
            assert await inferring == {}

    run(scenario)


def test_a_shared_submit_fails_only_the_calls_whose_time_is_up() -> None:
    # A send whose retries end at the first deadline among its calls, with Redis down: the call
    # whose time is up fails; the others, one with no deadline, go again and get through.
    async def scenario() -> None:
        down = True
        sent: list[list[str]] = []

        async def send(items: list[str], until: float | None) -> None:
            sent.append(list(items))
            while down and (until is None or time.monotonic() < until):  # retrying
                await asyncio.sleep(0.01)
            if down:
                raise RedisUnavailable("Redis stayed unavailable, past infer's timeout_s")

        submits: Coalescer[str] = Coalescer(send, retry_s=30, unsent=lambda: WaitTimeout("-"))
        now = time.monotonic()
        short = asyncio.create_task(submits(["a"], now + 0.2))
        long = asyncio.create_task(submits(["b"], now + 10))
        plain = asyncio.create_task(submits(["c"]))
        with pytest.raises(RedisUnavailable):
            await short
        assert not long.done()
        assert not plain.done()
        down = False
        await long
        await plain
        assert sent == [["a", "b", "c"], ["b", "c"]]

    run(scenario)


def test_a_call_queued_behind_a_send_fails_at_its_own_deadline_unsent() -> None:
    # A send that takes long (a backlog wait, an outage) holds the calls queued behind it; one
    # whose deadline passes meanwhile fails then, with the client's error, and is never sent.
    async def scenario() -> None:
        release, on_the_wire = asyncio.Event(), asyncio.Event()
        sent: list[list[str]] = []

        async def send(items: list[str], until: float | None) -> None:
            sent.append(list(items))
            on_the_wire.set()
            await release.wait()

        submits: Coalescer[str] = Coalescer(
            send, retry_s=30, unsent=lambda: BacklogFull(5, 1, waited=True)
        )
        first = asyncio.create_task(submits(["a"]))
        await on_the_wire.wait()
        started = time.monotonic()
        with pytest.raises(BacklogFull, match="timeout_s ran out"):
            await submits(["b"], started + 0.2)
        assert time.monotonic() - started < 2  # it waited for the first send to end before
        release.set()
        await first
        assert sent == [["a"]]  # b was never sent

    run(scenario)


def _down_coalescer(retry_s: float) -> Coalescer[str]:
    """A coalescer whose sends retry, Redis down, until their deadline (for ever without one),
    then fail as a retry policy bounded by that deadline would."""

    async def send(items: list[str], until: float | None) -> None:
        while until is None or time.monotonic() < until:
            await asyncio.sleep(0.01)
        raise RedisUnavailable("Redis stayed unavailable, past infer's timeout_s")

    return Coalescer(send, retry_s=retry_s, unsent=lambda: WaitTimeout("-"))


def test_a_call_without_deadline_is_not_retried_past_retry_s_by_its_neighbours() -> None:
    # Redis down; infers with short deadlines keep arriving, so each round trip gives up at one
    # of their deadlines and the plain submit goes again: it must still fail within retry_s.
    async def scenario() -> None:
        submits = _down_coalescer(retry_s=0.5)

        async def infers() -> None:
            while True:
                call = submits(["i"], time.monotonic() + 0.1)
                asyncio.get_running_loop().create_task(call).add_done_callback(
                    lambda t: t.cancelled() or t.exception()
                )
                await asyncio.sleep(0.05)

        feeder = asyncio.create_task(infers())
        started = time.monotonic()
        try:
            with pytest.raises(RedisUnavailable):
                await asyncio.wait_for(submits(["plain"]), timeout=5)
        finally:
            feeder.cancel()
        assert time.monotonic() - started < 1.5  # its own retry_s, not the neighbours'

    run(scenario)


def test_a_call_without_deadline_sent_again_alone_still_ends_at_retry_s() -> None:
    # Redis down: one infer (deadline 0.9 s) shares the plain submit's first round trip, which
    # gives up at that deadline; the submit then goes alone, with no deadline of its own, and
    # must still fail once it has retried for retry_s since it was queued, not retry_s more.
    async def scenario() -> None:
        submits = _down_coalescer(retry_s=1.0)
        started = time.monotonic()
        infer = asyncio.create_task(submits(["i"], started + 0.9))
        plain = asyncio.create_task(submits(["plain"]))
        with pytest.raises(RedisUnavailable):
            await infer
        with pytest.raises(RedisUnavailable, match="retried for the client's retry_s, 1 s"):
            await asyncio.wait_for(plain, timeout=5)
        assert time.monotonic() - started < 1.5  # 1.9 s before: a fresh retry_s when alone

    run(scenario)
