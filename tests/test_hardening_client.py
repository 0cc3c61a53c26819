"""The client refuses what Redis or the workers would refuse, keeps what it popped when one key
misbehaves, cancels what it stops waiting for, and never sends trimming options (issue 26,
contract v3 sections 2 and 4), through both clients (``shell``) where it fits."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import redis
from fakes import FAKE_MODEL, MODEL, PREFIX, STREAM, FakeReplier, xs

from producer.client.aio import AsyncClient
from producer.client.blocking import Client
from producer.protocol import codec, keys
from producer.protocol.codec import Reply
from producer.protocol.errors import InternalError, StreamExhausted, TooLarge
from tools.localredis import LocalRedis

if TYPE_CHECKING:
    from shells import Shell

pytest_plugins = ["shells"]

#: Redis refuses a proto-max-bulk-len under 1 MB.
BULK_LIMIT = 1024 * 1024
LAST_ID = "18446744073709551615-18446744073709551615"


@pytest.fixture(scope="module")
def small_bulk() -> Iterator[LocalRedis]:
    """A Redis whose bulk limit is 1 MiB: a larger body makes it drop the connection."""
    with LocalRedis("--proto-max-bulk-len", str(BULK_LIMIT)) as server:
        yield server


@pytest.fixture
def small_bulk_url(small_bulk: LocalRedis) -> Iterator[str]:
    yield small_bulk.url
    conn = small_bulk.client()
    conn.flushall()
    conn.close()


def oversized() -> dict[str, np.ndarray]:
    return {"x": np.zeros((1, BULK_LIMIT // 4 + 1024), np.float32)}  # a body just over 1 MiB


def a_reply(rid: str) -> bytes:
    outputs = {"y": xs(1)}
    reply = Reply(rid=rid, ok=True, model=FAKE_MODEL, worker="hand", timings_ms={}, outputs=outputs)
    return codec.encode_reply(reply)


def register(conn: redis.Redis, name: str, max_request_bytes: int) -> None:
    record = {"name": name, "batching": {"max_batch_size": 64}}
    record["limits"] = {"max_request_bytes": max_request_bytes}
    conn.set(keys.worker_key(PREFIX, MODEL, name), json.dumps(record), ex=60)
    conn.sadd(keys.workers_key(PREFIX, MODEL), name)


# ---------------------------------------------------------------------------------------------
# Bodies over the limits


def test_an_oversized_infer_fails_at_once_while_30_concurrent_infers_succeed(
    small_bulk_url: str,
) -> None:
    async def scenario() -> tuple[list[Any], float]:
        async with AsyncClient(MODEL, small_bulk_url, retry_s=5) as client:

            async def big() -> float:
                started = time.monotonic()
                with pytest.raises(TooLarge, match="proto-max-bulk-len") as info:
                    await client.infer(oversized(), timeout_s=20)
                assert info.value.code == "TOO_LARGE"
                assert not info.value.retryable
                return time.monotonic() - started

            honest = [client.infer({"x": xs(1) + i}, timeout_s=20) for i in range(30)]
            *outs, elapsed_s = await asyncio.gather(*honest, big())
            return outs, elapsed_s

    replier = FakeReplier(small_bulk_url).start()
    try:
        outs, elapsed_s = asyncio.run(scenario())
    finally:
        replier.stop()
    print(f"\nFIGURE too_large_s={elapsed_s:.3f}")
    assert elapsed_s < 2
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out["y"], (xs(1) + i) * 2)


def test_an_oversized_submit_is_refused_before_anything_is_sent(
    shell: Shell, small_bulk_url: str
) -> None:
    with shell.Client(MODEL, small_bulk_url, retry_s=5) as client:
        started = time.monotonic()
        with pytest.raises(TooLarge, match=r"over Redis's proto-max-bulk-len \(1\.0 MiB\)"):
            client.submit(oversized())
        assert time.monotonic() - started < 2
        client.submit({"x": xs(1)})  # the client is unharmed
    conn = redis.Redis.from_url(small_bulk_url)
    assert conn.xlen(STREAM) == 1
    conn.close()


def test_a_body_over_the_live_workers_max_request_bytes_is_refused(
    shell: Shell, redis_url: str, rconn: redis.Redis
) -> None:
    register(rconn, "w-small", 1000)
    register(rconn, "w-large", 5000)
    with shell.Client(MODEL, redis_url) as client:
        with pytest.raises(TooLarge, match=r"limits\.max_request_bytes=1000 .*the smallest of 2"):
            client.submit({"x": xs(100)})  # 1,200 bytes of data
        client.submit({"x": xs(10)})
    assert rconn.xlen(STREAM) == 1


def test_submit_many_with_one_oversized_body_sends_none_and_names_it(
    shell: Shell, redis_url: str, rconn: redis.Redis
) -> None:
    register(rconn, "w-1", 1000)
    many = [{"x": xs(1)} for _ in range(30)]
    many[7] = {"x": xs(100)}
    refused = pytest.raises(TooLarge, match=r"request at index 7: .* None of the 30 requests")
    with shell.Client(MODEL, redis_url) as client, refused:
        client.submit_many(many)
    assert rconn.xlen(STREAM) == 0


def test_map_keeps_each_request_under_the_byte_limit(
    client: Any, rconn: redis.Redis, replier: FakeReplier
) -> None:
    register(rconn, "w-1", 600)  # about 40 rows of 3 float32 per request, not the 64 asked
    rows = np.arange(300, dtype=np.float32).reshape(100, 3)
    chunks = list(client.map({"x": rows}, rows_per_request=64))
    assert all(chunk.ok for chunk in chunks)
    assert len(chunks) > 2
    assert all(chunk.stop - chunk.start <= 32 for chunk in chunks)
    np.testing.assert_array_equal(np.concatenate([c.outputs["y"] for c in chunks]), rows * 2)


def test_map_fails_each_row_over_the_byte_limit_without_sending_it(
    client: Any, rconn: redis.Redis
) -> None:
    register(rconn, "w-1", 600)
    chunks = list(client.map({"x": xs(3, cols=200)}, rows_per_request=3))  # 800 bytes a row
    assert [(c.start, c.stop, c.ok) for c in chunks] == [
        (0, 1, False),
        (1, 2, False),
        (2, 3, False),
    ]
    for chunk in chunks:
        with pytest.raises(TooLarge, match="max_request_bytes=600"):
            chunk.raise_for_error()
    assert rconn.xlen(STREAM) == 0


# ---------------------------------------------------------------------------------------------
# A reply key of another type


def test_wait_many_returns_every_reply_beside_a_key_of_the_wrong_type(
    client: Any, rconn: redis.Redis
) -> None:
    rids = [f"r{i}" for i in range(10)]
    for rid in rids[1:]:
        rconn.rpush(keys.reply_key(PREFIX, MODEL, rid), a_reply(rid))
    bad = keys.reply_key(PREFIX, MODEL, rids[0])
    rconn.set(bad, "not a list")

    results = {r.rid: r for r in client.wait_many(rids, timeout_s=5)}
    assert sorted(results) == rids
    assert all(results[rid].ok for rid in rids[1:])
    with pytest.raises(InternalError, match=f"reply key '{bad}' holds a value that is not a list"):
        results[rids[0]].raise_for_error()


def test_concurrent_waits_keep_their_replies_beside_a_key_of_the_wrong_type(
    redis_url: str, rconn: redis.Redis
) -> None:
    # The hub's BLPOP over every waiting call's key fails for all of them on one bad key
    rids = [f"r{i}" for i in range(10)]
    rconn.set(keys.reply_key(PREFIX, MODEL, rids[0]), "not a list")

    async def scenario() -> list[Any]:
        async with AsyncClient(MODEL, redis_url) as client:
            waits = [client.wait(rid, timeout_s=10) for rid in rids]
            writer = asyncio.create_task(asyncio.to_thread(write_replies))
            results = await asyncio.gather(*waits)
            await writer
            return results

    def write_replies() -> None:
        for rid in rids[1:]:
            rconn.rpush(keys.reply_key(PREFIX, MODEL, rid), a_reply(rid))

    results = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert [r.ok for r in results] == [False] + [True] * 9
    assert results[0].error.code == "INTERNAL"


# ---------------------------------------------------------------------------------------------
# Calls that stop waiting cancel their requests


def cancel_key_ttl(conn: redis.Redis, rid: str) -> int:
    return int(conn.ttl(keys.cancel_key(PREFIX, MODEL, rid)))


@pytest.mark.parametrize("how", ["cancel", "wait_for"])
def test_an_async_infer_cancelled_sets_its_cancel_key(
    how: str, redis_url: str, rconn: redis.Redis
) -> None:
    async def scenario() -> None:
        async with AsyncClient(MODEL, redis_url) as client:
            call = client.infer({"x": xs(1)}, timeout_s=30, rid="gone")
            if how == "wait_for":
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(call, 0.5)
            else:
                task = asyncio.create_task(call)
                for _ in range(2000):  # until sent (no worker takes it), at most 20 s
                    if rconn.xlen(STREAM):
                        break
                    await asyncio.sleep(0.01)
                assert rconn.xlen(STREAM), "the request was never sent"
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            # Other calls still work (the hub and the coalescer are unharmed)
            replier = FakeReplier(redis_url).start()
            try:
                out = await client.infer({"x": xs(2)}, timeout_s=10)
            finally:
                await asyncio.to_thread(replier.stop)
            np.testing.assert_array_equal(out["y"], xs(2) * 2)

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert cancel_key_ttl(rconn, "gone") > 0


def test_a_blocking_infer_interrupted_sets_its_cancel_key(
    redis_url: str, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = Client._once

    def once(client: Client, cmd: Any) -> Any:
        if cmd.name == "BLPOP":  # Ctrl-C while the call waits for its reply
            raise KeyboardInterrupt
        return original(client, cmd)

    monkeypatch.setattr(Client, "_once", once)
    with Client(MODEL, redis_url) as client, pytest.raises(KeyboardInterrupt):
        client.infer({"x": xs(1)}, timeout_s=30, rid="gone")
    assert rconn.xlen(STREAM) == 1
    assert cancel_key_ttl(rconn, "gone") > 0


# ---------------------------------------------------------------------------------------------
# A damaged stream, and no trimming


def test_an_exhausted_stream_raises_stream_exhausted_at_once(
    shell: Shell, redis_url: str, rconn: redis.Redis
) -> None:
    rconn.xadd(STREAM, {"rid": "hostile", "body": "x"}, id=LAST_ID)
    with shell.Client(MODEL, redis_url) as client:
        for send in (
            lambda: client.submit({"x": xs(1)}),
            lambda: client.submit_many([{"x": xs(1)}] * 3),
        ):
            started = time.monotonic()
            with pytest.raises(StreamExhausted, match=r"XSETID.* XGROUP SETID") as info:
                send()
            assert time.monotonic() - started < 2
            assert STREAM in str(info.value)


def test_the_client_never_sends_trimming_options_or_ids(
    client: Any, redis_url: str, replier: FakeReplier
) -> None:
    commands: list[str] = []
    watching = threading.Event()

    def monitor() -> None:
        conn = redis.Redis.from_url(redis_url)
        with conn.monitor() as m:
            watching.set()
            for each in m.listen():
                commands.append(each["command"])
                if "stop-monitor" in each["command"]:
                    break
        conn.close()

    thread = threading.Thread(target=monitor, daemon=True)
    thread.start()
    watching.wait(5)
    client.submit({"x": xs(1)})
    client.submit_many([{"x": xs(1)}, {"x": xs(2)}])
    client.infer({"x": xs(1)}, timeout_s=10)
    list(client.map({"x": xs(20)}, rows_per_request=4))
    conn = redis.Redis.from_url(redis_url)
    conn.echo("stop-monitor")
    conn.close()
    thread.join(10)

    xadds = [c for c in commands if c.upper().startswith("XADD ") and STREAM in c]
    assert len(xadds) >= 9
    for each in xadds:
        words = each.split(" ")
        assert words[2] == "*", each  # no MAXLEN, MINID, NOMKSTREAM or explicit id
        assert [words[3], words[5]] == ["rid", "body"], each
    assert not any(c.upper().startswith("XTRIM") for c in commands)
