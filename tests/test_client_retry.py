"""Client and AsyncClient ride out Redis outages: a real redis-server, killed and started again.

Most tests run against both clients (``shell``: see ``tests/shells.py``); the ones named
``test_async_...`` are about calls that share a round trip, which only AsyncClient does. The
module's own redis-server (``redis_server``, see conftest) is stopped and restarted here, so
each test that stops it starts it again before it ends. Tests wait for the retry policy's log
records through ``LogSignal``, not for a guessed time.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import pytest
import redis
import redis.asyncio
import redis.exceptions as rex

from producer.client.aio import AsyncClient
from producer.ops.replay import replay
from producer.ops.status import gather_status
from producer.protocol import codec, keys
from producer.protocol.codec import ModelRef, Reply
from producer.protocol.errors import ConnectionFailed, RedisUnavailable
from producer.redisio.retry import RetryPolicy, is_transient
from tools.localredis import LocalRedis

if TYPE_CHECKING:
    from shells import Shell

pytest_plugins = ["shells"]

MODEL = "demo"
STREAM = keys.request_stream(keys.DEFAULT_PREFIX, MODEL)
RETRY_LOGGER = "producer.redisio.retry"


class LogSignal(logging.Handler):
    """Sets an event for each outage log record (``redis_down``, ``redis_up``) as it is emitted."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.events = {"redis_down": threading.Event(), "redis_up": threading.Event()}

    def emit(self, record: logging.LogRecord) -> None:
        event = self.events.get(getattr(record, "event", ""))
        if event is not None:
            event.set()

    def wait(self, name: str) -> None:
        assert self.events[name].wait(timeout=20), f"no {name} log record"


@pytest.fixture
def signal() -> Iterator[LogSignal]:
    handler = LogSignal()
    logger = logging.getLogger(RETRY_LOGGER)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


@pytest.fixture
def outage_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger=RETRY_LOGGER)
    return caplog


@pytest.fixture
def server(redis_server: LocalRedis, redis_url: str) -> Iterator[LocalRedis]:
    """The module's server, running again after the test whatever the test did to it."""
    yield redis_server
    try:
        redis.Redis.from_url(redis_url, socket_connect_timeout=0.5).ping()
    except rex.ConnectionError:
        redis_server.start()


def outage_events(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [getattr(r, "event", "") for r in caplog.records if r.name == RETRY_LOGGER]


def entries(url: str) -> list[dict[bytes, bytes]]:
    conn = redis.Redis.from_url(url)
    try:
        return [fields for _id, fields in conn.xrange(STREAM)]
    finally:
        conn.close()


def xs(rows: int) -> np.ndarray:
    return np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)


def reply_bytes(rid: str) -> bytes:
    model = ModelRef(MODEL, "1", "0" * 64)
    reply = Reply(rid=rid, ok=True, outputs={"y": xs(1)}, model=model, worker="w", timings_ms={})
    return codec.encode_reply(reply)


def test_submit_rides_out_a_redis_restart_and_logs_the_outage_once_each_way(
    shell: Shell,
    server: LocalRedis,
    redis_url: str,
    signal: LogSignal,
    outage_log: pytest.LogCaptureFixture,
) -> None:
    # Given a client that has talked to Redis, and a Redis that then dies
    with shell.Client(MODEL, redis_url, retry_s=30) as client:
        client.backlog()
        server.stop(kill=True)
        rids: list[str] = []
        sender = threading.Thread(target=lambda: rids.append(client.submit({"x": xs(1)})))

        # When a submit starts during the outage and Redis comes back while it retries
        sender.start()
        signal.wait("redis_down")
        server.start()
        sender.join(timeout=30)

    # Then the submit went through once, with one log line at each end of the outage
    assert not sender.is_alive()
    assert [f[b"rid"].decode() for f in entries(redis_url)] == rids
    assert outage_events(outage_log) == ["redis_down", "redis_up"]


def test_wait_blocks_through_an_outage_and_gets_the_reply_written_after_it(
    shell: Shell,
    server: LocalRedis,
    redis_url: str,
    signal: LogSignal,
    outage_log: pytest.LogCaptureFixture,
) -> None:
    # Given a caller blocked in wait() when Redis dies
    results: list[bool] = []
    with shell.Client(MODEL, redis_url, retry_s=30) as client:
        waiter = threading.Thread(target=lambda: results.append(client.wait("r-1", 30).ok))
        waiter.start()
        server.stop(kill=True)
        signal.wait("redis_down")

        # When Redis comes back and the reply is written only then
        server.start()
        writer = redis.Redis.from_url(redis_url)
        writer.rpush(keys.reply_key(keys.DEFAULT_PREFIX, MODEL, "r-1"), reply_bytes("r-1"))
        writer.close()
        waiter.join(timeout=30)

    # Then the wait returns that reply
    assert results == [True]
    assert outage_events(outage_log) == ["redis_down", "redis_up"]


def test_a_wait_never_outlasts_its_timeout_through_an_outage(
    shell: Shell, server: LocalRedis, redis_url: str
) -> None:
    # Given Redis down and a client that would retry for 30 s
    # (AsyncClient's waits share a BLPOP, whose retries end at the first waiting call's timeout)
    limit = {"sync": r"the wait's timeout_s=1", "async": r"the waiting call's timeout"}
    with shell.Client(MODEL, redis_url, retry_s=30) as client:
        client.backlog()  # connected
        server.stop(kill=True)
        started = time.monotonic()
        # When a caller waits 1 s for a reply, then it gives up at its timeout, not at retry_s
        with pytest.raises(RedisUnavailable, match=f"past {limit[shell.name]}"):
            client.wait("r-late", 1.0)
        assert time.monotonic() - started < 10  # 30 s (retry_s) before this change
        server.start()


def test_async_waits_each_end_at_their_own_timeout_through_an_outage(
    server: LocalRedis, redis_url: str
) -> None:
    # Given two calls sharing a BLPOP, with timeouts of 1 s and 30 s, when Redis dies
    async def scenario() -> tuple[BaseException | None, bool]:
        async with AsyncClient(MODEL, redis_url, retry_s=30) as client:
            short = asyncio.create_task(client.wait("r-short", 1.0))
            long = asyncio.create_task(client.wait("r-long", 30.0))
            await asyncio.sleep(0)
            await asyncio.to_thread(server.stop, True)
            # Then the short one fails at its timeout while Redis is still down
            error = None
            try:
                await short
            except RedisUnavailable as exc:
                error = exc
            # And the long one still gets its reply once Redis is back
            await asyncio.to_thread(server.start)
            writer = redis.asyncio.Redis.from_url(redis_url)
            await writer.rpush(
                keys.reply_key(keys.DEFAULT_PREFIX, MODEL, "r-long"), reply_bytes("r-long")
            )
            await writer.aclose()
            return error, (await long).ok

    error, long_ok = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert isinstance(error, RedisUnavailable)
    assert long_ok


def test_infer_ends_at_its_timeout_when_redis_is_down_for_its_submit(
    shell: Shell, server: LocalRedis, redis_url: str
) -> None:
    server.stop(kill=True)
    with shell.Client(MODEL, redis_url, retry_s=30) as client:
        started = time.monotonic()
        with pytest.raises(RedisUnavailable, match="past infer's timeout_s"):
            client.infer({"x": xs(1)}, timeout_s=0.5)
        assert time.monotonic() - started < 5  # 30 s (retry_s) before infer bounded its submit
    server.start()
    assert entries(redis_url) == []  # nothing was sent


def test_async_infers_sharing_a_submit_each_end_at_their_own_timeout(
    server: LocalRedis, redis_url: str
) -> None:
    # Given Redis down and two infers whose submits share one round trip
    async def scenario() -> tuple[float, dict[str, np.ndarray]]:
        async with AsyncClient(MODEL, redis_url, retry_s=30) as client:
            await asyncio.to_thread(server.stop, True)
            started = time.monotonic()
            short = asyncio.create_task(client.infer({"x": xs(1)}, timeout_s=0.5))
            long = asyncio.create_task(client.infer({"x": xs(1)}, timeout_s=30, rid="r-long"))
            # Then the short one fails at its timeout, not at retry_s (30 s)
            with pytest.raises(RedisUnavailable, match="past infer's timeout_s"):
                await short
            elapsed_s = time.monotonic() - started
            # And the long one is still sent, and answered, once Redis is back
            await asyncio.to_thread(server.start)
            writer = redis.asyncio.Redis.from_url(redis_url)
            await writer.rpush(
                keys.reply_key(keys.DEFAULT_PREFIX, MODEL, "r-long"), reply_bytes("r-long")
            )
            await writer.aclose()
            return elapsed_s, await long

    elapsed_s, outputs = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert elapsed_s < 5
    np.testing.assert_array_equal(outputs["y"], xs(1))
    assert [f[b"rid"] for f in entries(redis_url)] == [b"r-long"]


def test_a_restart_between_commands_is_not_an_outage(
    shell: Shell, server: LocalRedis, redis_url: str, outage_log: pytest.LogCaptureFixture
) -> None:
    with shell.Client(MODEL, redis_url, retry_s=30) as client:
        client.backlog()
        server.restart(kill=True)  # the client's pooled connection is now dead
        assert client.backlog() == 0

    assert outage_events(outage_log) == []


def test_the_budget_runs_out_with_redis_unavailable(
    shell: Shell, server: LocalRedis, redis_url: str, outage_log: pytest.LogCaptureFixture
) -> None:
    server.stop(kill=True)
    with shell.Client(MODEL, redis_url, retry_s=0.3) as client:
        started = time.monotonic()
        with pytest.raises(RedisUnavailable, match=r"retry_s=0\.3") as info:
            client.submit({"x": xs(1)})
        elapsed_s = time.monotonic() - started
        with pytest.raises(RedisUnavailable, match=r"retry_s=0\.3"):
            client.poll("r-1")

    assert 0.3 <= elapsed_s < 5
    assert isinstance(info.value.__cause__, rex.ConnectionError)
    assert outage_events(outage_log) == ["redis_down"]


def test_a_rejected_command_is_not_retried(
    shell: Shell, redis_url: str, rconn: redis.Redis, outage_log: pytest.LogCaptureFixture
) -> None:
    rconn.set(STREAM, "not a stream")
    rconn.config_resetstat()
    with (
        shell.Client(MODEL, redis_url, retry_s=30) as client,
        pytest.raises(ConnectionFailed, match="WRONGTYPE") as info,
    ):
        client.backlog()

    assert not isinstance(info.value, RedisUnavailable)
    assert rconn.info("commandstats")["cmdstat_xlen"]["calls"] == 1
    assert outage_events(outage_log) == []


def test_async_calls_ride_out_a_redis_restart_with_one_outage_logged(
    server: LocalRedis, redis_url: str, signal: LogSignal, outage_log: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> tuple[str, object]:
        async with AsyncClient(MODEL, redis_url, retry_s=30) as client:
            await client.backlog()
            await asyncio.to_thread(server.stop, True)
            # Two commands retry at once: a pipelined submit and a plain LINDEX
            submit = asyncio.create_task(client.submit({"x": xs(2)}, rid="job-7"))
            poll = asyncio.create_task(client.poll("job-7"))
            await asyncio.to_thread(signal.wait, "redis_down")
            await asyncio.to_thread(server.start)
            return await submit, await poll

    rid, polled = asyncio.run(asyncio.wait_for(scenario(), timeout=60))

    assert (rid, polled) == ("job-7", None)
    assert [f[b"rid"] for f in entries(redis_url)] == [b"job-7"]
    assert outage_events(outage_log) == ["redis_down", "redis_up"]


def test_async_waits_sharing_a_blpop_ride_out_an_outage(
    server: LocalRedis, redis_url: str, signal: LogSignal, outage_log: pytest.LogCaptureFixture
) -> None:
    # Given two calls waiting together (one shared BLPOP) when Redis dies
    async def scenario() -> list[bool]:
        async with AsyncClient(MODEL, redis_url, retry_s=30) as client:
            waits = [asyncio.create_task(client.wait(rid, 30)) for rid in ("r-1", "r-2")]
            await asyncio.sleep(0)  # both registered before the BLPOP goes out
            await asyncio.to_thread(server.stop, True)
            await asyncio.to_thread(signal.wait, "redis_down")
            # When Redis comes back and the replies are written only then
            await asyncio.to_thread(server.start)
            writer = redis.asyncio.Redis.from_url(redis_url)
            for rid in ("r-2", "r-1"):
                await writer.rpush(
                    keys.reply_key(keys.DEFAULT_PREFIX, MODEL, rid), reply_bytes(rid)
                )
            await writer.aclose()
            return [(await w).ok for w in waits]

    # Then both get their reply
    assert asyncio.run(asyncio.wait_for(scenario(), timeout=60)) == [True, True]
    assert outage_events(outage_log) == ["redis_down", "redis_up"]


# ---------------------------------------------------------------------------------------------
# The policy without Redis


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (rex.ConnectionError("Connection refused"), True),
        (rex.TimeoutError("Timeout reading from socket"), True),
        (rex.BusyLoadingError("Redis is loading the dataset in memory"), True),
        (rex.OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'"), True),
        (rex.ResponseError("BUSY Redis is busy running a script"), True),
        (rex.ResponseError("Command # 2 (XADD s * a b) of pipeline caused error: BUSY x"), True),
        (rex.TryAgainError("TRYAGAIN Multiple keys request during rehashing"), True),
        (rex.ResponseError("BUSYGROUP Consumer Group name already exists"), False),
        (rex.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"), False),
        (rex.ExecAbortError("Transaction discarded because of: OOM command not allowed"), True),
        (rex.ExecAbortError("Transaction discarded because of previous errors."), False),
        (
            rex.ReadOnlyError("You can't write against a read only replica."),
            True,
        ),  # a failover (contract v3)
        (rex.AuthenticationError("invalid username-password pair"), False),
        (rex.NoPermissionError("NOPERM this user has no permissions"), False),
    ],
)
def test_only_errors_a_later_try_may_not_hit_are_transient(exc: Exception, transient: bool) -> None:
    assert is_transient(exc) is transient


@pytest.mark.parametrize("retry_s", [-1, True, "30", float("nan")])
def test_retry_s_must_be_a_non_negative_number(retry_s: object) -> None:
    with pytest.raises(ValueError, match="retry_s"):
        RetryPolicy("redis://h:6379/0", retry_s)  # type: ignore[arg-type]


def test_retry_s_zero_tries_once() -> None:
    tries: list[int] = []

    def refuse() -> None:
        tries.append(1)
        raise rex.ConnectionError("Connection refused")

    with pytest.raises(RedisUnavailable, match="not retried"):
        RetryPolicy("redis://h:6379/0", 0).call(refuse)
    assert len(tries) == 1


def test_status_and_replay_ride_out_an_outage(
    server: LocalRedis, redis_url: str, signal: LogSignal
) -> None:
    # Given a Redis that dies before the operator's commands
    conn = redis.Redis.from_url(redis_url, socket_timeout=10)
    server.stop(kill=True)
    results: list[object] = []

    def operator() -> None:
        results.append(gather_status(conn, MODEL, retry_s=30).dead.count)
        results.append(len(replay(conn, MODEL, retry_s=30, same_ids=True).resent))

    thread = threading.Thread(target=operator)
    # When they start during the outage and Redis comes back while they retry
    thread.start()
    signal.wait("redis_down")
    server.start()
    thread.join(timeout=30)
    # Then both complete against the restarted (empty) server instead of failing
    assert not thread.is_alive()
    assert results == [0, 0]
    conn.close()
