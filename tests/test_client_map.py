"""map() and the worker registry, run against both clients (``shell``: see ``tests/shells.py``),
on a real Redis with a fake replier standing in for the worker."""

from __future__ import annotations

import threading
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

from producer import keys
from producer.errors import InvalidInput, NoWorkerInfo

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
    assert len(rconn.keys(f"{PREFIX}:cancel:*")) == 5  # the late ones, cancelled
    chunks.close()  # stopping early cancels what is still in flight
    assert len(rconn.keys(f"{PREFIX}:cancel:*")) == 10


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
    assert len(rconn.keys(f"{PREFIX}:cancel:*")) == 5


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
    assert rconn.exists(keys.cancel_key(PREFIX, results[0].rid))


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
