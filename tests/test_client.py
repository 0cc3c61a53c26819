"""The blocking Client against a real Redis, with a fake replier standing in for the worker.

The fake replier reads the request stream as the worker would (group ``workers``), answers
``y = x * 2``, and answers INVALID_INPUT for any request holding a negative value. The pure
pieces of ``producer.core`` are tested directly at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis

import producer
from producer import argtypes, codec, core, keys, resp, window
from producer import client as client_module
from producer.aio import AsyncClient
from producer.client import Client
from producer.codec import ErrorInfo, ModelRef, Reply
from producer.errors import (
    BacklogFull,
    ConnectionFailed,
    InvalidInput,
    NoWorkerInfo,
    WaitTimeout,
)
from tools.localredis import free_port

MODEL = "demo"
PREFIX = keys.DEFAULT_PREFIX
STREAM = keys.request_stream(PREFIX, MODEL)
FAKE_MODEL = ModelRef(MODEL, "1", "0" * 64)


def answer(entry_fields: dict[bytes, bytes]) -> tuple[str, bytes]:
    """The fake worker's reply to one stream entry: y = x * 2, or INVALID_INPUT for x < 0."""
    rid = entry_fields[b"rid"].decode()
    body = codec.decode_request(entry_fields[b"body"], max_bytes=1 << 24)
    x = body.inputs["x"]
    common = {"rid": rid, "model": FAKE_MODEL, "worker": "fake-1", "meta_raw": body.meta_raw}
    timings = {"queued": 0.1, "inference": 0.2}
    if (x < 0).any():
        error = ErrorInfo("INVALID_INPUT", "input 'x' holds a negative value.", False)
        reply = Reply(ok=False, error=error, timings_ms=timings, **common)
    else:
        outputs = {"y": x * 2}
        reply = Reply(ok=True, outputs=outputs, batch_rows=len(x), timings_ms=timings, **common)
    return rid, codec.encode_reply(reply)


def ensure_group(conn: redis.Redis) -> None:
    try:
        conn.xgroup_create(STREAM, keys.CONSUMER_GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def reply_to_entries(conn: redis.Redis, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
    """Write replies the way the worker does: reply (if absent) + EXPIRE, XACK, XDEL."""
    pipe = conn.pipeline(transaction=False)
    for entry_id, fields in entries:
        rid, reply = answer(fields)
        key = keys.reply_key(PREFIX, rid)
        pipe.rpush(key, reply)
        pipe.expire(key, 60)
        pipe.xack(STREAM, keys.CONSUMER_GROUP, entry_id)
        pipe.xdel(STREAM, entry_id)
    pipe.execute()


class FakeReplier:
    """A thread that answers requests like a worker would, until stopped."""

    def __init__(self, url: str) -> None:
        self._conn = redis.Redis.from_url(url)
        ensure_group(self._conn)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-replier", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> FakeReplier:
        self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                got = self._conn.xreadgroup(
                    keys.CONSUMER_GROUP, "fake-1", {STREAM: ">"}, count=256, block=1000
                )
                for _stream, entries in got or []:
                    work = [(eid, f) for eid, f in entries if b"stop" not in f]
                    reply_to_entries(self._conn, work)
        except BaseException as exc:  # reported by stop(), so a test fails loudly
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._conn.xadd(STREAM, {"stop": "1"})  # wakes the blocked read at once
            self._thread.join(timeout=10)
        self._conn.close()
        if self.error is not None:
            raise self.error


@pytest.fixture
def replier(redis_url: str) -> Iterator[FakeReplier]:
    fake = FakeReplier(redis_url).start()
    yield fake
    fake.stop()


@pytest.fixture
def client(redis_url: str) -> Iterator[Client]:
    with Client(MODEL, redis_url) as c:
        yield c


def register_worker(conn: redis.Redis, name: str, max_batch_size: int) -> None:
    """Register a worker record by hand, as a worker's heartbeat would."""
    record = {"name": name, "state": "ready", "batching": {"max_batch_size": max_batch_size}}
    conn.set(keys.worker_key(PREFIX, MODEL, name), json.dumps(record), ex=15)
    conn.sadd(keys.workers_key(PREFIX, MODEL), name)


def xs(rows: int, cols: int = 3) -> np.ndarray:
    return np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)


# ---------------------------------------------------------------------------------------------
# submit, poll, wait


def test_submit_then_wait_returns_outputs_and_echoes_meta(
    client: Client, replier: FakeReplier
) -> None:
    meta = {"trace": "abc", "n": [1, 2.5, None]}

    rid = client.submit({"x": xs(2)}, meta=meta, deadline_s=30)
    result = client.wait(rid, timeout_s=10)

    assert result.rid == rid
    assert result.ok
    assert result.error is None
    assert result.outputs is not None
    np.testing.assert_array_equal(result.outputs["y"], xs(2) * 2)
    assert result.meta == meta
    assert result.model == FAKE_MODEL
    assert result.worker == "fake-1"
    assert result.batch_rows == 2
    assert result.timings_ms == {"queued": 0.1, "inference": 0.2}
    result.raise_for_error()  # ok: does nothing


def test_submit_writes_contract_entry(client: Client, rconn: redis.Redis) -> None:
    before_ms = int(time.time() * 1000)

    rid = client.submit({"x": xs(1)}, rid="my-id:1", deadline_s=5, reply_ttl_s=60, outputs=["y"])

    [(_entry_id, fields)] = rconn.xrange(STREAM)
    assert list(fields) == [b"rid", b"body"]
    assert rid == "my-id:1"
    assert fields[b"rid"] == b"my-id:1"
    body = codec.decode_request(fields[b"body"], max_bytes=1 << 20)
    assert body.outputs == ("y",)
    assert body.reply_ttl_s == 60
    assert body.deadline_ms is not None
    assert before_ms + 5000 <= body.deadline_ms <= int(time.time() * 1000) + 5000
    np.testing.assert_array_equal(body.inputs["x"], xs(1))


class BlockedReader:
    """One ``XREADGROUP ... BLOCK`` of the group, on its own thread, as a waiting worker's."""

    def __init__(self, url: str) -> None:
        self._conn = redis.Redis.from_url(url)
        ensure_group(self._conn)
        self.got: list[bytes] = []
        self._thread = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> BlockedReader:
        self._thread.start()
        deadline = time.monotonic() + 10
        while int(self._conn.info("clients")["blocked_clients"]) < 1:  # its read is waiting
            assert time.monotonic() < deadline, "the reader never blocked"
            time.sleep(0.005)
        return self

    def _read(self) -> None:
        got = self._conn.xreadgroup(
            keys.CONSUMER_GROUP, "w", {STREAM: ">"}, count=100, block=10_000
        )
        self.got = [fields[b"rid"] for _stream, entries in got for _id, fields in entries]

    def __exit__(self, *_: object) -> None:
        self._thread.join(timeout=10)
        self._conn.close()


def test_a_batch_of_submits_reaches_a_waiting_worker_in_one_read(redis_url: str) -> None:
    # Redis wakes a blocked reader after each command, so a plain pipeline of XADDs would be
    # read as its first entry, then the rest; the client sends a batch as one transaction.
    with Client(MODEL, redis_url) as client, BlockedReader(redis_url) as reader:
        rids = client.submit_many([{"x": xs(1)} for _ in range(32)])
    assert reader.got == [rid.encode() for rid in rids]

    async def submit_async() -> list[str]:
        async with AsyncClient(MODEL, redis_url) as aclient:
            return await aclient.submit_many([{"x": xs(1)} for _ in range(32)])

    with BlockedReader(redis_url) as reader:
        rids = asyncio.run(submit_async())
    assert reader.got == [rid.encode() for rid in rids]


def test_big_batches_of_submits_go_in_several_capped_transactions(
    client: Client, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core, "_TXN_ENTRIES", 4)
    monkeypatch.setattr(core, "_TXN_BYTES", 1000)
    small = [core.Submission(f"s{i}", b"x" * 10) for i in range(9)]
    big = [core.Submission(f"b{i}", b"x" * 600) for i in range(3)]
    assert core.pack_xadds(STREAM, small).blocks == ((4, True), (4, True), (1, False))
    assert core.pack_xadds(STREAM, big).blocks == ((2, True), (1, False))
    rids = client.submit_many([{"x": xs(1)} for _ in range(10)])
    assert [f[b"rid"] for _, f in rconn.xrange(STREAM)] == [rid.encode() for rid in rids]
    xadds = core.pack_xadds(STREAM, small + big)
    core.check_xadds(xadds, resp.round_trip(rconn, xadds.packer))
    assert rconn.xlen(STREAM) == 10 + 12


def test_default_rids_are_uuid4_hex(client: Client) -> None:
    rids = client.submit_many([{"x": xs(1)}, {"x": xs(1)}])
    assert len(set(rids)) == 2
    assert all(len(rid) == 32 and int(rid, 16) >= 0 for rid in rids)


def test_poll_is_none_until_the_reply_arrives_and_does_not_consume(
    client: Client, rconn: redis.Redis
) -> None:
    rid = client.submit({"x": xs(1)})
    assert client.poll(rid) is None

    ensure_group(rconn)
    entries = rconn.xreadgroup(keys.CONSUMER_GROUP, "t", {STREAM: ">"})[0][1]
    reply_to_entries(rconn, entries)

    first = client.poll(rid)
    assert first is not None
    assert first.ok
    second = client.poll(rid)
    assert second is not None  # still there: poll does not consume
    assert client.wait(rid, timeout_s=1).ok
    assert client.poll(rid) is None  # wait consumed it


def test_wait_times_out_with_wait_timeout(client: Client) -> None:
    rid = client.submit({"x": xs(1)})
    started = time.monotonic()

    with pytest.raises(WaitTimeout, match=rid):
        client.wait(rid, timeout_s=0.2)

    assert time.monotonic() - started < 2
    assert issubclass(WaitTimeout, TimeoutError)


def test_invalid_rid_is_rejected(client: Client, rconn: redis.Redis) -> None:
    for bad in ["", "has space", "a/b", "x" * 129, "é"]:
        with pytest.raises(ValueError, match="does not match"):
            client.submit({"x": xs(1)}, rid=bad)
        with pytest.raises(ValueError, match="does not match"):
            client.poll(bad)
    assert rconn.exists(STREAM) == 0


def test_bad_arguments_are_rejected_before_anything_is_sent(client: Client) -> None:
    with pytest.raises(ValueError, match="reply_ttl_s"):
        client.submit({"x": xs(1)}, reply_ttl_s=0)
    with pytest.raises(ValueError, match="outputs"):
        client.submit({"x": xs(1)}, outputs="y")
    with pytest.raises(ValueError, match="Model name"):
        Client("bad model", "redis://127.0.0.1:1/0")
    with pytest.raises(ValueError, match="max_backlog"):
        Client(MODEL, "redis://127.0.0.1:1/0", max_backlog=0)


@pytest.mark.parametrize("timeout_s", [float("nan"), -1, True, "1"])
def test_a_bad_timeout_is_refused_by_name_before_anything_is_sent(
    client: Client, rconn: redis.Redis, timeout_s: float
) -> None:
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds >= 0"):
        client.infer({"x": xs(1)}, timeout_s=timeout_s)
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds >= 0"):
        client.wait("r-1", timeout_s)
    assert rconn.exists(STREAM) == 0


@pytest.mark.parametrize("deadline_s", [float("nan"), float("inf"), 1e20, 0, -1, True])
def test_a_bad_deadline_is_refused_by_name(
    client: Client, rconn: redis.Redis, deadline_s: float
) -> None:
    with pytest.raises(ValueError, match="deadline_s must be a number of seconds above 0"):
        client.submit({"x": xs(1)}, deadline_s=deadline_s)
    assert rconn.exists(STREAM) == 0


def test_a_reply_ttl_past_the_longest_span_is_refused(client: Client) -> None:
    with pytest.raises(ValueError, match="reply_ttl_s must be a whole number"):
        client.submit({"x": xs(1)}, reply_ttl_s=2**64)


@pytest.mark.parametrize("ttl_s", [0, -5, 1.5, True, core.MAX_SPAN_S + 1])
def test_a_bad_cancel_ttl_is_refused_before_redis_sees_it(
    client: Client, rconn: redis.Redis, ttl_s: int
) -> None:
    with pytest.raises(ValueError, match="ttl_s must be a whole number of seconds"):
        client.cancel("abc", ttl_s=ttl_s)
    assert rconn.exists(keys.cancel_key(PREFIX, "abc")) == 0


@pytest.mark.parametrize("prefix", ["", "a b", "a{b}", "a}", "tab\there", "line\n", 7])
def test_a_prefix_the_workers_and_cli_refuse_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="is not a key prefix"):
        Client(MODEL, "redis://127.0.0.1:1/0", prefix=prefix)
    if isinstance(prefix, str):  # the CLI's rule is the same one
        with pytest.raises(argparse.ArgumentTypeError):
            argtypes.prefix(prefix)


@pytest.mark.parametrize("requests", ["ab", b"ab", {"x": np.zeros((1, 3))}, 5])
def test_submit_many_wants_a_list_of_requests(client: Client, requests: object) -> None:
    with pytest.raises(TypeError, match="submit_many takes a list of requests"):
        client.submit_many(requests)  # type: ignore[arg-type]


def test_a_request_must_be_a_mapping_of_inputs(client: Client, rconn: redis.Redis) -> None:
    with pytest.raises(TypeError, match="inputs must be a mapping of input name to array"):
        client.submit("ab")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="inputs must be a mapping of input name to array"):
        client.submit_many([{"x": xs(1)}, "ab"])  # type: ignore[list-item]
    assert rconn.exists(STREAM) == 0


# ---------------------------------------------------------------------------------------------
# infer and wait_many


def test_infer_returns_outputs(client: Client, replier: FakeReplier) -> None:
    outputs = client.infer({"x": xs(3)}, timeout_s=10)
    np.testing.assert_array_equal(outputs["y"], xs(3) * 2)


def test_infer_raises_the_typed_error(client: Client, replier: FakeReplier) -> None:
    with pytest.raises(InvalidInput) as info:
        client.infer({"x": -xs(2) - 1}, timeout_s=10, rid="bad-one")

    assert info.value.code == "INVALID_INPUT"
    assert info.value.message == "input 'x' holds a negative value."
    assert info.value.rid == "bad-one"
    assert info.value.retryable is False


def test_wait_many_yields_every_reply(client: Client, replier: FakeReplier) -> None:
    requests = [{"x": xs(1) + i} for i in range(200)]
    rids = client.submit_many(requests, meta="batch-7")

    results = list(client.wait_many(rids, timeout_s=10))

    assert sorted(r.rid for r in results) == sorted(rids)
    by_rid = {r.rid: r for r in results}
    for rid, request in zip(rids, requests, strict=True):
        outputs = by_rid[rid].outputs
        assert outputs is not None
        np.testing.assert_array_equal(outputs["y"], request["x"] * 2)
        assert by_rid[rid].meta == "batch-7"


def test_wait_many_raises_for_leftovers_at_the_deadline(client: Client, rconn: redis.Redis) -> None:
    # Given two requests of which only the first gets an answer
    rids = client.submit_many([{"x": xs(1)}, {"x": xs(1)}])
    ensure_group(rconn)
    entries = rconn.xreadgroup(keys.CONSUMER_GROUP, "t", {STREAM: ">"}, count=1)[0][1]
    reply_to_entries(rconn, entries)

    # When waiting for both, the answered one is yielded, then the other times out
    seen = []
    with pytest.raises(WaitTimeout, match=rids[1]):
        seen.extend(r.rid for r in client.wait_many(rids, timeout_s=0.3))
    assert seen == [rids[0]]


# ---------------------------------------------------------------------------------------------
# map


def test_map_yields_chunks_in_order_and_reports_a_failed_chunk(
    client: Client, replier: FakeReplier
) -> None:
    x = xs(3000)
    x[1000, 1] = -1.0  # the chunk holding row 1000 fails

    chunks = list(client.map({"x": x}, rows_per_request=7, concurrency=16, timeout_s=20))

    assert [(c.start, c.stop) for c in chunks] == [
        (start, min(start + 7, 3000)) for start in range(0, 3000, 7)
    ]
    failed = [c for c in chunks if not c.ok]
    assert [(c.start, c.stop) for c in failed] == [(994, 1001)]
    assert failed[0].error is not None
    assert failed[0].error.code == "INVALID_INPUT"
    with pytest.raises(InvalidInput):
        failed[0].raise_for_error()
    for chunk in chunks:
        if chunk.ok:
            assert chunk.outputs is not None
            np.testing.assert_array_equal(chunk.outputs["y"], x[chunk.start : chunk.stop] * 2)
    assert len({c.rid for c in chunks}) == len(chunks)
    assert all(c.result.worker == "fake-1" and c.latency_ms >= 0 for c in chunks)
    assert chunks[0].result.batch_rows == 7


def test_map_keeps_at_most_concurrency_requests_in_flight(
    client: Client, rconn: redis.Redis
) -> None:
    # With no replier, map sends one window, waits it out, then refills it once
    chunks = client.map({"x": xs(100)}, rows_per_request=3, concurrency=5, timeout_s=0.3)
    first = next(chunks)
    assert first.error is not None
    assert first.error.code == "WAIT_TIMEOUT"
    assert rconn.xlen(STREAM) == 10
    assert len(rconn.keys(f"{PREFIX}:cancel:*")) == 5  # the late ones, cancelled
    chunks.close()  # stopping early cancels what is still in flight
    assert len(rconn.keys(f"{PREFIX}:cancel:*")) == 10


def test_map_with_stop_on_timeout_sends_nothing_after_a_late_reply(
    client: Client, rconn: redis.Redis
) -> None:
    # With no replier and stop_on_timeout, the first window times out and no other is sent:
    # the iteration ends after the window's chunks, short of the input's end
    chunks = list(
        client.map(
            {"x": xs(100)}, rows_per_request=3, concurrency=5, timeout_s=0.3, stop_on_timeout=True
        )
    )
    assert [(c.start, c.stop) for c in chunks] == [(i, i + 3) for i in range(0, 15, 3)]
    assert all(c.error is not None and c.error.code == "WAIT_TIMEOUT" for c in chunks)
    assert rconn.xlen(STREAM) == 5
    assert len(rconn.keys(f"{PREFIX}:cancel:*")) == 5


def test_map_late_request_does_not_lose_the_answers_behind_it(
    client: Client, rconn: redis.Redis
) -> None:
    # Given a worker that answers every request except the first
    ensure_group(rconn)
    chunks = client.map({"x": xs(10)}, rows_per_request=1, concurrency=4, timeout_s=0.5)

    def answer_all_but_first() -> None:
        skipped, answered = False, 0
        while answered < 9:
            got = rconn.xreadgroup(keys.CONSUMER_GROUP, "fake", {STREAM: ">"}, block=2000)
            entries = [e for _, batch in got or [] for e in batch]
            if not skipped and entries:
                entries, skipped = entries[1:], True  # the oldest entry is row 0's request
            reply_to_entries(rconn, entries)
            answered += len(entries)

    replier = threading.Thread(target=answer_all_but_first)
    replier.start()
    results = list(chunks)
    replier.join(timeout=10)

    # Then the first is a WAIT_TIMEOUT failure and every other row has its answer, in order
    assert [c.start for c in results] == list(range(10))
    assert results[0].error is not None
    assert results[0].error.code == "WAIT_TIMEOUT"
    assert all(c.ok for c in results[1:])
    np.testing.assert_array_equal(results[5].outputs["y"], xs(10)[5:6] * 2)
    assert rconn.exists(keys.cancel_key(PREFIX, results[0].rid))


def test_map_of_zero_rows_yields_nothing(client: Client) -> None:
    # No worker is registered, and none is needed for zero rows
    assert list(client.map({"x": np.zeros((0, 3), np.float32)})) == []


def test_map_rejects_inputs_of_unequal_rows(client: Client) -> None:
    with pytest.raises(ValueError, match="same number of rows"):
        client.map({"x": xs(3), "z": xs(4)}, rows_per_request=2)


def test_map_takes_rows_per_request_from_the_live_workers(
    client: Client, replier: FakeReplier, rconn: redis.Redis
) -> None:
    # Given two live workers and one whose record expired
    register_worker(rconn, "w-big", 8)
    register_worker(rconn, "w-small", 5)
    rconn.sadd(keys.workers_key(PREFIX, MODEL), "w-dead")

    chunks = list(client.map({"x": xs(23)}, concurrency=4))

    assert [(c.start, c.stop) for c in chunks] == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 23)]
    assert rconn.smembers(keys.workers_key(PREFIX, MODEL)) == {b"w-big", b"w-small"}


def test_map_without_a_live_worker_raises_no_worker_info(client: Client) -> None:
    with pytest.raises(NoWorkerInfo, match="rows_per_request"):
        client.map({"x": xs(3)})


def test_workers_lists_live_records_and_forgets_expired_ones(
    client: Client, rconn: redis.Redis
) -> None:
    register_worker(rconn, "b", 4)
    register_worker(rconn, "a", 2)
    rconn.sadd(keys.workers_key(PREFIX, MODEL), "gone")

    records = client.workers()

    assert [r["name"] for r in records] == ["a", "b"]
    assert rconn.smembers(keys.workers_key(PREFIX, MODEL)) == {b"a", b"b"}


# ---------------------------------------------------------------------------------------------
# backpressure, cancel, connection errors


def test_submit_refuses_at_max_backlog(redis_url: str) -> None:
    with Client(MODEL, redis_url, max_backlog=3) as c:
        c.submit_many([{"x": xs(1)}] * 3)
        assert c.backlog() == 3

        with pytest.raises(BacklogFull) as info:
            c.submit({"x": xs(1)})

        assert info.value.backlog == 3
        assert info.value.max_backlog == 3
        assert c.backlog() == 3


def test_waiting_submit_goes_through_once_the_backlog_drains(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a full backlog and a replier that starts only once the submit has begun waiting
    fake = FakeReplier(redis_url)
    real_sleep: Callable[[float], None] = time.sleep

    def sleep_and_start_replier(seconds: float) -> None:
        if not fake.started:
            fake.start()
        real_sleep(seconds)

    monkeypatch.setattr(client_module, "_sleep", sleep_and_start_replier)
    try:
        with Client(MODEL, redis_url, max_backlog=2, wait_for_backlog=True) as c:
            c.submit_many([{"x": xs(1)}] * 2)

            # When submitting one more, it waits, then goes through
            rid = c.submit({"x": xs(1)})

            assert fake.started
            assert c.wait(rid, timeout_s=10).ok
    finally:
        fake.stop()


@pytest.mark.timeout(20)  # it waited for ever before infer's timeout_s bounded its submit
def test_infer_on_a_full_backlog_ends_at_its_timeout_with_nothing_sent(
    redis_url: str, rconn: redis.Redis
) -> None:
    rconn.xadd(STREAM, {"filler": "1"})
    with Client(MODEL, redis_url, max_backlog=1, wait_for_backlog=True) as c:
        started = time.monotonic()
        with pytest.raises(BacklogFull, match="max_backlog=1"):
            c.infer({"x": xs(1)}, timeout_s=0.3)
        elapsed_s = time.monotonic() - started

    assert 0.3 <= elapsed_s < 3
    assert rconn.xlen(STREAM) == 1


def test_cancel_sets_the_key_with_a_ttl(client: Client, rconn: redis.Redis) -> None:
    client.cancel("job-1", ttl_s=120)

    key = keys.cancel_key(PREFIX, "job-1")
    assert rconn.get(key) == b"1"
    assert 0 < rconn.ttl(key) <= 120


def test_unreachable_redis_raises_connection_failed_without_the_password() -> None:
    port = free_port()
    with Client(MODEL, f"redis://user:s3cret@127.0.0.1:{port}/0", retry_s=0) as c:
        with pytest.raises(ConnectionFailed) as info:
            c.backlog()
        with pytest.raises(ConnectionFailed):
            c.submit({"x": xs(1)})

    message = str(info.value)
    assert f"redis://user@127.0.0.1:{port}/0" in message
    assert "s3cret" not in message
    assert isinstance(info.value.__cause__, redis.ConnectionError)


def test_a_rejected_command_raises_connection_failed(client: Client, rconn: redis.Redis) -> None:
    rconn.set(STREAM, "not a stream")
    with pytest.raises(ConnectionFailed, match="WRONGTYPE"):
        client.backlog()


def test_a_rejected_submit_raises_connection_failed_sync_and_async(
    client: Client, rconn: redis.Redis, redis_url: str
) -> None:
    # Given a request stream key that is not a stream: every XADD of a batch is refused
    rconn.set(STREAM, "not a stream")
    with pytest.raises(ConnectionFailed, match="WRONGTYPE"):
        client.submit_many([{"x": xs(1)}, {"x": xs(1)}])

    async def submit_async() -> None:
        async with AsyncClient(MODEL, redis_url) as aclient:
            await aclient.submit_many([{"x": xs(1)}, {"x": xs(1)}])

    with pytest.raises(ConnectionFailed, match="WRONGTYPE"):
        asyncio.run(submit_async())
    # And the connections went back clean: the next commands read their own replies
    rconn.delete(STREAM)
    rid = client.submit({"x": xs(1)})
    assert rconn.xrange(STREAM)[0][1][b"rid"] == rid.encode()


def test_client_accepts_a_redis_client_and_leaves_it_open(
    redis_url: str, replier: FakeReplier
) -> None:
    conn = redis.Redis.from_url(redis_url)
    with Client(MODEL, redis_client=conn) as c:
        assert "127.0.0.1" in repr(c)
        np.testing.assert_array_equal(c.infer({"x": xs(1)}, timeout_s=10)["y"], xs(1) * 2)
    assert conn.ping()
    conn.close()

    text = redis.Redis.from_url(redis_url, decode_responses=True)
    with pytest.raises(ValueError, match="decode_responses"):
        Client(MODEL, redis_client=text)
    text.close()


# ---------------------------------------------------------------------------------------------
# the sans-I/O core, without Redis


SETTINGS = core.Settings.create(MODEL, PREFIX, None, False)


def fake_reply(rid: str, rows: int) -> bytes:
    outputs = {"y": np.full((rows, 1), 1.0, np.float32)}
    reply = Reply(rid, True, FAKE_MODEL, "w", {}, outputs=outputs, batch_rows=rows)
    return codec.encode_reply(reply)


def make_plan(rows: int, rows_per_request: int, concurrency: int) -> window.MapPlan:
    return window.MapPlan(
        SETTINGS,
        {"x": np.zeros((rows, 1), np.float32)},
        rows_per_request=rows_per_request,
        concurrency=concurrency,
        outputs=None,
        timeout_s=5,
    )


def send(plan: window.MapPlan) -> list[core.Submission]:
    subs = plan.take(now_s=0)
    plan.sent(subs, now=0)
    return subs


def reply(plan: window.MapPlan, subs: list[core.Submission]) -> None:
    """Feed replies for ``subs`` through the plan's waiter, as a pipelined LPOP would."""
    reply_keys = [SETTINGS.reply_key(s.rid).encode() for s in subs]
    raws = [fake_reply(s.rid, 1) for s in subs]
    plan.answered(plan.waiter.take_popped(reply_keys, raws), now=0.25)


def test_map_plan_yields_in_input_order_whatever_order_replies_come_in() -> None:
    plan = make_plan(rows=10, rows_per_request=3, concurrency=2)
    first, second = send(plan)
    assert send(plan) == []  # the window is full

    reply(plan, [second])
    assert plan.ready() == []  # rows 0-3 are still outstanding
    [third] = send(plan)
    reply(plan, [first])

    ready = plan.ready()
    assert [(c.start, c.stop) for c in ready] == [(0, 3), (3, 6)]
    assert [c.latency_ms for c in ready] == [250.0, 250.0]  # sent at 0, answered at 0.25
    assert ready[0].result.rid == ready[0].rid == first.rid
    reply(plan, [third, *send(plan)])
    assert [(c.start, c.stop) for c in plan.ready()] == [(6, 9), (9, 10)]
    assert plan.finished
    assert plan.waiter.pending == 0


def test_map_plan_holds_at_most_twice_concurrency_behind_a_slow_head() -> None:
    plan = make_plan(rows=100, rows_per_request=1, concurrency=2)
    _head, *rest = send(plan)
    sent = 2
    for _ in range(10):  # everything but the head is answered at once
        reply(plan, rest)
        rest = send(plan)
        sent += len(rest)

    assert sent == 4
    assert plan.waiter.pending == 1
    assert plan.ready() == []


def test_reply_waiter_blocks_until_the_first_deadline_then_times_out() -> None:
    waiter = window.ReplyWaiter(SETTINGS, timeout_s=5)
    waiter.add("a", now=100)
    waiter.add("b", now=101)
    assert waiter.block_s(now=100, cap_s=2) == 2
    assert waiter.block_s(now=104.9999, cap_s=2) == 0.001  # never 0, which blocks forever
    assert waiter.block_s(now=106, cap_s=2) == 0.001  # a late request still gets one look
    assert waiter.take_blpopped(None, now=104) == []
    with pytest.raises(WaitTimeout, match="for 1 request\\(s\\) to model 'demo': a\\. "):
        waiter.take_blpopped(None, now=105)


def test_wait_with_zero_timeout_still_finds_a_reply_that_is_there(
    client: Client, rconn: redis.Redis
) -> None:
    rid = client.submit({"x": xs(1)})
    [(_entry_id, fields)] = rconn.xrange(STREAM)
    rconn.rpush(keys.reply_key(PREFIX, rid), answer(fields)[1])

    assert client.wait(rid, timeout_s=0).ok


def test_backlog_gate_backs_off_exponentially_up_to_a_cap() -> None:
    gate = core.BacklogGate(max_backlog=10, wait=True)
    assert gate.delay_s(9, now=0) is None
    delays = [gate.delay_s(10, now=0) for _ in range(8)]
    assert delays == [0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.2, 0.2]
    with pytest.raises(BacklogFull):
        core.BacklogGate(max_backlog=10, wait=False).delay_s(11, now=0)
    assert not core.BacklogGate(max_backlog=None, wait=False).active


def test_backlog_gate_waits_no_longer_than_its_deadline() -> None:
    gate = core.BacklogGate(max_backlog=10, wait=True, until=100.0)
    assert gate.delay_s(10, now=99.0) == 0.005
    assert gate.delay_s(10, now=99.995) == pytest.approx(0.005)  # cut to end at the deadline
    assert gate.delay_s(9, now=100.5) is None  # room: go ahead, late or not
    with pytest.raises(BacklogFull) as info:
        gate.delay_s(10, now=100.0)
    assert "timeout_s ran out" in str(info.value)
    assert "wait_for_backlog=True" not in str(info.value)  # it did wait: other advice


def test_deadlines_and_ttls_up_to_the_longest_span_are_accepted() -> None:
    sub = core.build_submission(
        {"x": xs(1)}, deadline_s=core.MAX_SPAN_S, reply_ttl_s=core.MAX_SPAN_S, now_s=2e9
    )
    body = codec.decode_request(sub.body, max_bytes=1 << 20)
    assert body.deadline_ms == (2e9 + core.MAX_SPAN_S) * 1000
    assert body.reply_ttl_s == core.MAX_SPAN_S


def test_a_numpy_ttl_and_an_unlimited_timeout_are_taken() -> None:
    assert core.check_ttl_s("ttl_s", np.int64(60)) == 60
    assert type(core.check_ttl_s("ttl_s", np.int64(60))) is int  # as Redis's client wants it
    assert core.check_timeout_s(math.inf) == math.inf  # wait with no limit, as before


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@host:6379/0", "redis://host:6379/0"),
        ("rediss://alice:pw@host/2", "rediss://alice@host/2"),
        ("redis://host:1/0?password=pw&db=1", "redis://host:1/0?db=1"),
        ("unix:///tmp/r.sock?password=pw", "unix:///tmp/r.sock"),
    ],
)
def test_redact_url_drops_passwords(url: str, shown: str) -> None:
    assert core.redact_url(url) == shown


def test_block_cap_stays_under_the_socket_timeout() -> None:
    assert core.block_cap_s(None) == core.MAX_BLOCK_S
    assert core.block_cap_s(5) == 2.0
    assert core.block_cap_s(1) == 0.5


def test_package_exports_exactly_its_public_names() -> None:
    public = {
        name
        for name, value in vars(producer).items()
        if not name.startswith("_") and not inspect.ismodule(value) and name != "annotations"
    }
    assert sorted(producer.__all__) == sorted(public)
