"""map() and the worker registry, run against both clients (``shell``: see ``tests/shells.py``),
on a real Redis with a fake replier standing in for the worker."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import redis
from fakes import (
    MODEL,
    PREFIX,
    STREAM,
    FakeReplier,
    ensure_group,
    register_worker,
    reply_to_entries,
    xs,
)
from test_run_sources import EchoWorker

from producer.client import mapwindow
from producer.client.maprows import Blocks, RowFeed
from producer.client.settings import Settings
from producer.protocol import codec, keys
from producer.protocol.errors import InvalidInput, NoWorkerInfo

if TYPE_CHECKING:
    from shells import Shell

pytest_plugins = ["shells"]


def test_map_yields_chunks_in_order_and_reports_a_failed_chunk(
    client: Any, replier: FakeReplier
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


def test_map_keeps_at_most_concurrency_requests_in_flight(client: Any, rconn: redis.Redis) -> None:
    # With no replier, map sends one window, waits it out, then refills it once
    chunks = client.map({"x": xs(100)}, rows_per_request=3, concurrency=5, timeout_s=0.3)
    first = next(chunks)
    assert first.error is not None
    assert first.error.code == "WAIT_TIMEOUT"
    assert rconn.xlen(STREAM) == 10
    assert len(rconn.keys(f"{PREFIX}:{{{MODEL}}}:cancel:*")) == 5  # the late ones, cancelled
    chunks.close()  # stopping early cancels what is still in flight
    assert len(rconn.keys(f"{PREFIX}:{{{MODEL}}}:cancel:*")) == 10


def test_map_with_stop_on_timeout_sends_nothing_after_a_late_reply(
    client: Any, rconn: redis.Redis
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
    assert len(rconn.keys(f"{PREFIX}:{{{MODEL}}}:cancel:*")) == 5


def test_map_late_request_does_not_lose_the_answers_behind_it(
    client: Any, rconn: redis.Redis
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
    assert rconn.exists(keys.cancel_key(PREFIX, MODEL, results[0].rid))


def test_map_of_zero_rows_yields_nothing(client: Any) -> None:
    # No worker is registered, and none is needed for zero rows
    assert list(client.map({"x": np.zeros((0, 3), np.float32)})) == []


def test_map_takes_rows_per_request_from_the_live_workers(
    client: Any, replier: FakeReplier, rconn: redis.Redis
) -> None:
    # Given two live workers and one whose record expired
    register_worker(rconn, "w-big", 8)
    register_worker(rconn, "w-small", 5)
    rconn.sadd(keys.workers_key(PREFIX, MODEL), "w-dead")

    chunks = list(client.map({"x": xs(23)}, concurrency=4))

    assert [(c.start, c.stop) for c in chunks] == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 23)]
    assert rconn.smembers(keys.workers_key(PREFIX, MODEL)) == {b"w-big", b"w-small"}


def test_map_without_a_live_worker_raises_no_worker_info(client: Any, shell: Shell) -> None:
    if shell.name == "sync":  # Client looks the workers up at the call
        with pytest.raises(NoWorkerInfo, match="rows_per_request"):
            client.map({"x": xs(3)})
        return
    chunks = client.map({"x": xs(3)})  # AsyncClient, on first use
    with pytest.raises(NoWorkerInfo, match="rows_per_request"):
        next(chunks)


def test_workers_lists_live_records_and_forgets_expired_ones(
    client: Any, rconn: redis.Redis
) -> None:
    register_worker(rconn, "b", 4)
    register_worker(rconn, "a", 2)
    rconn.sadd(keys.workers_key(PREFIX, MODEL), "gone")
    rconn.sadd(keys.workers_key(PREFIX, MODEL), "not a name")

    records = client.workers()

    assert [r["name"] for r in records] == ["a", "b"]
    assert rconn.smembers(keys.workers_key(PREFIX, MODEL)) == {b"a", b"b"}


# ---------------------------------------------------------------------------------------------
# string and bytes inputs, and inputs streamed from iterators


@pytest.fixture
def echo(redis_url: str) -> Iterator[EchoWorker]:
    """Answers each string or bytes input ``s`` with ``s`` and ``s_len``, numbers doubled."""
    worker = EchoWorker(redis_url, MODEL)
    worker.start()
    yield worker
    worker.stop()


@pytest.mark.usefixtures("echo")
def test_map_sends_lists_and_generators_of_str_and_bytes_rows_in_order(client: Any) -> None:
    words = [f"w{i}" * (i % 4 + 1) for i in range(50)]
    blobs = (bytes([i]) * (i % 3) + b"\x00" for i in range(50))  # trailing NULs kept

    chunks = list(
        client.map({"s": words, "b": blobs, "x": xs(50)}, rows_per_request=3, concurrency=4)
    )

    assert [(c.start, c.stop) for c in chunks] == [(i, min(i + 3, 50)) for i in range(0, 50, 3)]
    outputs = {
        name: np.concatenate([c.outputs[name] for c in chunks]).tolist()
        for name in ("s", "s_len", "b", "x")
    }
    assert outputs["s"] == words
    assert outputs["s_len"] == [len(w) for w in words]
    assert outputs["b"] == [bytes([i]) * (i % 3) + b"\x00" for i in range(50)]
    assert outputs["x"] == (xs(50) * 2).tolist()


@pytest.mark.usefixtures("echo")
def test_map_takes_numpy_text_arrays(client: Any) -> None:
    unicode = np.array(["é", "üb", "c"])  # 'U'
    raw = np.array([b"a", b"bb", b"ccc"])  # 'S'
    objects = np.array(["x", "yy", "zzz"], dtype=object)  # named by its first element

    [chunk] = list(client.map({"u": unicode, "r": raw, "o": objects}, rows_per_request=3))

    assert chunk.outputs["u"].tolist() == ["é", "üb", "c"]
    assert chunk.outputs["r"].tolist() == [b"a", b"bb", b"ccc"]
    assert chunk.outputs["o_len"].tolist() == [1, 2, 3]


@pytest.mark.usefixtures("echo")
def test_map_reads_an_iterator_only_as_it_sends(client: Any) -> None:
    # Given a generator that counts the rows taken from it
    taken = 0

    def lines() -> Iterator[str]:
        nonlocal taken
        for i in range(2000):
            taken += 1
            yield f"line {i}"

    chunks = client.map({"s": lines()}, rows_per_request=2, concurrency=4)

    # Then the first chunk comes back before the generator was read beyond the window (at
    # most 2 * concurrency requests held, one row read ahead), and every row comes back
    first = next(chunks)
    assert taken <= 2 * 4 * 2 + 1
    rest = list(chunks)
    assert taken == 2000
    assert [r for c in [first, *rest] for r in c.outputs["s"]] == [f"line {i}" for i in range(2000)]


def test_map_inputs_that_end_apart_raise_value_error(client: Any, replier: FakeReplier) -> None:
    chunks = client.map(
        {"x": xs(4), "y": (v for v in xs(6))}, rows_per_request=2, concurrency=2, timeout_s=20
    )
    with pytest.raises(ValueError, match="same number of rows: after row 4"):
        list(chunks)


def test_map_of_an_empty_iterator_yields_nothing(client: Any) -> None:
    # No worker is registered, and none is needed for zero rows
    assert list(client.map({"s": iter([])})) == []


def test_map_of_an_iterator_takes_rows_per_request_from_the_live_workers(
    client: Any, rconn: redis.Redis, replier: FakeReplier
) -> None:
    register_worker(rconn, "w-small", 4)

    chunks = list(client.map({"x": (row for row in xs(10))}, concurrency=2))

    assert [(c.start, c.stop) for c in chunks] == [(0, 4), (4, 8), (8, 10)]
    np.testing.assert_array_equal(np.concatenate([c.outputs["y"] for c in chunks]), xs(10) * 2)


def test_map_request_bodies_are_the_rows_encoded_whatever_feeds_them() -> None:
    # Given the same float rows as an array, as blocks of other sizes, and as a row iterator
    settings = Settings.create(MODEL, PREFIX, None, False)
    x = np.random.default_rng(3).random((23, 5), dtype=np.float32)
    feeds = {
        "array": x,
        "blocks": Blocks([x[:4], x[4:4], x[4:15], x[15:]]),
        "rows": iter(list(x)),
    }
    # Then each request's body is the codec's encoding of its rows, byte for byte
    expected = [codec.encode_request({"x": x[i : i + 5]}) for i in range(0, 23, 5)]
    for feed in feeds.values():
        plan = mapwindow.MapPlan(
            settings, {"x": feed}, rows_per_request=5, concurrency=8, outputs=None, timeout_s=5
        )
        assert [sub.body for sub in plan.take(now_s=0)] == expected


def test_map_reads_objects_numpy_converts_as_arrays_not_as_iterators() -> None:
    class Frame:  # a pandas Series or a tensor: iterable, but an array to numpy
        def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
            return xs(4)

        def __iter__(self) -> Iterator[np.ndarray]:
            raise AssertionError("read as an array, not row by row")

    feed = RowFeed({"x": Frame(), "t": ["a", "b", "c", "d"]})

    assert feed.rows == 4
    taken = feed.take(3)
    assert taken is not None
    np.testing.assert_array_equal(taken["x"], xs(4)[:3])
    assert codec.wire_dtype(taken["t"]) == "string"
