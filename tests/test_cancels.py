"""Cancel checks answered while the batch runs, and the read sent behind each check.

The reading thread hands a read over before its cancel check's answer is in
(worker/redisio/cancels.py, worker/redisio/readahead.py):
a request whose answer comes before its batch starts is left out of the run; one whose answer
comes during the run is answered CANCELLED after it. Both cases are forced here by holding the
answer back until a chosen moment, on a real worker and a real Redis.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import numpy as np
import pytest
import redis
from harness import (
    PREFIX,
    running_worker,
    send,
    serve_in_thread,
    stream_is_empty,
    wait_reply,
    write_config,
)

from producer.protocol import keys
from producer.redisio import resp
from worker.answer import answerer as answer_module
from worker.answer import batcher as batcher_module
from worker.config import load_config
from worker.intake.leases import Leases, Stuck
from worker.intake.read import Reader
from worker.intake.settings import IntakeSettings
from worker.items import Admitted, Item
from worker.ops.metrics import Metrics
from worker.redisio import cancels as cancels_module
from worker.redisio.cancels import CancelCheck
from worker.redisio.readahead import CheckThenRead
from worker.redisio.stream import RawEntry, RequestStream
from worker.service import Worker, prepare

MODEL = "multi_io"


@pytest.fixture
def config(tmp_path: Path, redis_url: str) -> Path:
    return write_config(tmp_path, MODEL, redis_url)


def _inputs() -> dict[str, np.ndarray]:
    return {"a": np.ones((1, 3), np.float32), "b": np.zeros((1, 2), np.int64)}


class HeldAnswers:
    """Wraps ``CancelQuery.receive`` so that each answer waits for ``release``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        receive = cancels_module.CancelQuery.receive

        def held(query: cancels_module.CancelQuery) -> set[str]:
            answer = receive(query)
            assert self.release.wait(20), "the answer was never released"
            return answer

        monkeypatch.setattr(cancels_module.CancelQuery, "receive", held)


@pytest.fixture
def run_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every run the worker makes."""
    rows: list[int] = []
    run_batch = answer_module.run_batch

    def counted(model, schema, items, *args, **kwargs):  # type: ignore[no-untyped-def]
        rows.append(sum(item.rows for item in items))
        return run_batch(model, schema, items, *args, **kwargs)

    monkeypatch.setattr(answer_module, "run_batch", counted)
    return rows


def test_an_answer_that_comes_during_the_run_still_cancels(
    config: Path, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch, run_rows: list[int]
) -> None:
    held = HeldAnswers(monkeypatch)
    run_batch = answer_module.run_batch

    def release_then_run(*args, **kwargs):  # type: ignore[no-untyped-def]
        held.release.set()  # the answer arrives once the run has started
        return run_batch(*args, **kwargs)

    monkeypatch.setattr(answer_module, "run_batch", release_then_run)
    rconn.set(keys.cancel_key(PREFIX, MODEL, "late"), 1, ex=60)
    send(rconn, MODEL, "late", _inputs(), meta="m")
    send(rconn, MODEL, "kept", _inputs())
    metrics = Metrics()
    with running_worker(config, metrics=metrics):
        late = wait_reply(rconn, "late")
        kept = wait_reply(rconn, "kept")
    assert run_rows == [2]  # both ran: the answer was not in when the batch started
    assert metrics.registry.get_sample_value("redbatch_cancelled_after_run_total") == 1
    assert late.error is not None
    assert late.error.code == "CANCELLED"
    assert late.meta == "m"
    assert kept.ok
    assert kept.batch_rows == 2
    assert stream_is_empty(rconn, MODEL)


def test_an_answer_in_before_the_batch_starts_keeps_the_request_out_of_the_run(
    config: Path, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch, run_rows: list[int]
) -> None:
    next_batch = batcher_module.Batcher.next_batch

    def after_the_answers(self, timeout_s):  # type: ignore[no-untyped-def]
        batch = next_batch(self, timeout_s)
        for item in batch:
            if isinstance(item, Admitted):
                item.cancel.confirmed("")  # waits for the answer
        return batch

    monkeypatch.setattr(batcher_module.Batcher, "next_batch", after_the_answers)
    rconn.set(keys.cancel_key(PREFIX, MODEL, "early"), 1, ex=60)
    send(rconn, MODEL, "early", _inputs())
    send(rconn, MODEL, "kept", _inputs())
    metrics = Metrics()
    with running_worker(config, metrics=metrics):
        early = wait_reply(rconn, "early")
        kept = wait_reply(rconn, "kept")
    assert run_rows == [1]
    assert metrics.registry.get_sample_value("redbatch_cancelled_after_run_total") == 0
    assert early.error is not None
    assert early.error.code == "CANCELLED"
    assert kept.ok
    assert kept.batch_rows == 1


def _held_runs(monkeypatch: pytest.MonkeyPatch, hold_s: float) -> threading.Event:
    """Each run waits until the returned event is set, or ``hold_s``."""
    gate = threading.Event()
    run_batch = answer_module.run_batch

    def held(*args, **kwargs):  # type: ignore[no-untyped-def]
        gate.wait(hold_s)
        return run_batch(*args, **kwargs)

    monkeypatch.setattr(answer_module, "run_batch", held)
    return gate


def test_no_read_goes_out_after_a_stop(
    tmp_path: Path, redis_url: str, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a backlog, and the reader blocked handing a read to the full queue while a run is held
    config = write_config(
        tmp_path, MODEL, redis_url, batching="max_batch_size = 4\nmax_wait_ms = 1"
    )
    for i in range(200):
        send(rconn, MODEL, f"r{i}", _inputs())
    gate = _held_runs(monkeypatch, 30)
    running = threading.Event()
    held = answer_module.run_batch

    def marked(*args, **kwargs):  # type: ignore[no-untyped-def]
        running.set()
        return held(*args, **kwargs)

    monkeypatch.setattr(answer_module, "run_batch", marked)
    worker = Worker(prepare(load_config(config), "w1"), redis.Redis.from_url(redis_url))
    blocked = threading.Event()
    put = worker.queue.put

    def put_when_full(items, *args, **kwargs):  # type: ignore[no-untyped-def]
        # The queue's one taker (the serving thread) is held in a run: this put blocks until
        # the stop. The reader sends a read behind a check only after its put, and takes that
        # read's reply before its next put, so every read it sent has been served by now.
        # (A put that finds the queue full before the first run starts waits for that run:
        # held, it cannot take from the queue, so the queue is still full then.)
        if worker.queue.full() and running.wait(20) and worker.queue.full():
            blocked.set()
        put(items, *args, **kwargs)

    monkeypatch.setattr(worker.queue, "put", put_when_full)
    thread, failure = serve_in_thread(worker)
    assert blocked.wait(20)
    read_before = _entries_read(rconn)
    # When the worker is stopped, then the put goes through
    worker.request_stop()
    gate.set()
    thread.join(30)
    # Then nothing more was read, and everything read was answered
    assert not thread.is_alive()
    assert not failure
    assert _entries_read(rconn) == read_before
    assert rconn.xpending(keys.request_stream(PREFIX, MODEL), keys.CONSUMER_GROUP)["pending"] == 0


def _entries_read(conn: redis.Redis) -> int:
    return int(conn.xinfo_groups(keys.request_stream(PREFIX, MODEL))[0]["entries-read"])


def test_a_health_check_between_the_check_and_the_read_behind_it_changes_nothing(
    tmp_path: Path, redis_url: str, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A client that PINGs before a send once health_check_interval has passed: its PING must
    # not read the cancel check's reply, still owed while the reader waits on a full queue.
    config = write_config(
        tmp_path, MODEL, redis_url, batching="max_batch_size = 1\nmax_wait_ms = 1"
    )
    rids = [send(rconn, MODEL, f"r{i}", _inputs()) for i in range(5)]
    _held_runs(monkeypatch, 1.5)
    url = urlsplit(redis_url)
    # redis.Redis() retries a failed command on a new connection (from_url does not)
    client = redis.Redis(host=url.hostname or "", port=url.port or 6379, health_check_interval=1)
    worker = Worker(prepare(load_config(config), "w1"), client)
    thread, failure = serve_in_thread(worker)
    replies = {rid: wait_reply(rconn, rid, 30) for rid in rids}
    worker.request_stop()
    thread.join(30)
    assert not failure
    assert {rid: reply.ok for rid, reply in replies.items()} == dict.fromkeys(rids, True)


def test_a_check_asked_again_after_a_failure_never_cancels_a_run_already_started(
    config: Path, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a check whose first MGET cannot be sent, so it is asked again after the hand-over
    # (and no second check as the batch forms, which this test is not about)
    monkeypatch.setattr(cancels_module, "RECHECK_AFTER_S", 3600.0)
    ask = cancels_module.ask
    asked: list[int] = []

    def first_unsendable(stream, rids):  # type: ignore[no-untyped-def]
        asked.append(1)
        if len(asked) == 1:
            raise redis.ConnectionError("dropped")
        return ask(stream, rids)

    monkeypatch.setattr(cancels_module, "ask", first_unsendable)
    key_set = threading.Event()
    cancelled = cancels_module.cancelled

    def after_the_key(stream, rids):  # type: ignore[no-untyped-def]
        assert key_set.wait(20)
        return cancelled(stream, rids)

    monkeypatch.setattr(cancels_module, "cancelled", after_the_key)
    run_batch = answer_module.run_batch

    def cancel_during_the_run(*args, **kwargs):  # type: ignore[no-untyped-def]
        # When the caller cancels only once the batch runs
        rconn.set(keys.cancel_key(PREFIX, MODEL, "ran"), 1, ex=60)
        key_set.set()
        return run_batch(*args, **kwargs)

    monkeypatch.setattr(answer_module, "run_batch", cancel_during_the_run)
    send(rconn, MODEL, "ran", _inputs())
    with running_worker(config):
        reply = wait_reply(rconn, "ran")
    # Then the late answer, which sees the key, does not turn the result into CANCELLED
    assert reply.ok


def test_a_cancel_set_while_the_request_waits_in_the_worker_cancels_it(
    tmp_path: Path,
    redis_url: str,
    rconn: redis.Redis,
    run_rows: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a lone request read at once but batched only when its window closes, 1.5 s later
    batching = "max_batch_size = 32\nmax_wait_ms = 1500\nadaptive_wait = false"
    config = write_config(tmp_path, MODEL, redis_url, batching=batching)
    checked = threading.Event()
    answer = CancelCheck.answer

    def answered(self: CancelCheck, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        answer(self, *args, **kwargs)
        checked.set()

    monkeypatch.setattr(CancelCheck, "answer", answered)
    metrics = Metrics()
    with running_worker(config, metrics=metrics):
        send(rconn, MODEL, "waits", _inputs(), meta="m")
        assert checked.wait(20)  # the read's own check has answered: nothing cancelled yet
        # When the caller cancels after that, before the batch formed
        rconn.set(keys.cancel_key(PREFIX, MODEL, "waits"), 1, ex=60)
        reply = wait_reply(rconn, "waits")
    # Then the key that existed when the batch formed cancels it (it ran: answered after)
    assert reply.error is not None, reply
    assert reply.error.code == "CANCELLED"
    assert reply.meta == "m"
    assert run_rows == [1]
    assert metrics.registry.get_sample_value("redbatch_cancelled_after_run_total") == 1


def test_a_check_is_answered_once() -> None:
    check = CancelCheck()
    assert not check.answered
    assert not check.known("a")
    check.answer({"a"})
    check.answer(set())  # a second answer is ignored
    assert check.known("a")
    assert check.confirmed("a")
    assert not check.confirmed("b")


class _Recorded(CancelCheck):
    """A check that notes how it was answered."""

    def __init__(self) -> None:
        super().__init__()
        self.before_hand_over: list[bool] = []

    def answer(self, cancelled: Iterable[str], *, asked_before_hand_over: bool = True) -> None:
        self.before_hand_over.append(asked_before_hand_over)
        super().answer(cancelled, asked_before_hand_over=asked_before_hand_over)


class _RefusingHandoff:
    def put(self, items: list[Item]) -> None:
        raise RuntimeError("hand-over failed (test)")


def test_a_hand_over_that_fails_still_answers_the_check_as_asked_before_it(
    rconn: redis.Redis,
) -> None:
    # Given a reader whose hand-over raises after the read's MGET went out
    stream = _stream(rconn)
    settings = IntakeSettings(
        prefix=PREFIX,
        consumer="me",
        schema=SimpleNamespace(axes=SimpleNamespace(trivial=False)),  # type: ignore[arg-type]
        max_request_bytes=1 << 20,
        max_element_bytes=None,
        read_count=8,
        claim_idle_ms=30_000,
        max_deliveries=3,
        out=_RefusingHandoff(),
        stop=threading.Event(),
        stuck=Stuck(),
    )
    reader = Reader(stream, Leases(), settings)
    check = _Recorded()
    request = SimpleNamespace(rows=1)
    item = Admitted(RawEntry(b"1-0", {}), "r0", request, check)  # type: ignore[arg-type]
    # When the read is handed over
    with pytest.raises(RuntimeError, match="hand-over failed"):
        reader._hand_over([item], check)
    # Then its check is answered (nothing cancelled) as one asked before the hand-over
    assert check.before_hand_over == [True]
    assert check.answered
    assert not check.known("r0")


# ---------------------------------------------------------------------------------------------
# The read sent behind a check


def _stream(conn: redis.Redis) -> RequestStream:
    stream = RequestStream(conn, PREFIX, MODEL, "me")
    stream.ensure_group()
    return stream


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_read_behind_a_check_returns_what_read_would(redis_url: str, protocol: int) -> None:
    conn = redis.Redis.from_url(redis_url, protocol=protocol)
    stream = _stream(conn)
    conn.set(keys.cancel_key(PREFIX, MODEL, "r1"), 1, ex=60)
    sent = [send(conn, MODEL, f"r{i}", _inputs()) for i in range(3)]

    ahead = CheckThenRead(stream, ["r0", "r1"])
    ahead.read_next(2, 0)
    assert ahead.cancelled() == {"r1"}
    assert ahead.read_owed
    entries = ahead.entries()
    assert entries is not None
    assert not ahead.read_owed
    assert [e.fields[b"rid"] for e in entries] == [rid.encode() for rid in sent[:2]]
    assert set(entries[0].fields) == {b"rid", b"body"}
    # the same as a plain read gives: the third entry, then nothing
    assert [e.fields[b"rid"] for e in stream.read(5, 0)] == [b"r2"]
    blocked = CheckThenRead(stream, ["r2"])
    blocked.read_next(5, 50)
    assert blocked.cancelled() == set()
    assert blocked.entries() == []
    conn.close()


def test_the_read_behind_a_check_recreates_a_lost_group(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    stream = _stream(conn)
    conn.delete(keys.request_stream(PREFIX, MODEL))  # the group goes with the stream
    ahead = CheckThenRead(stream, ["r0"])
    ahead.read_next(5, 0)
    assert ahead.cancelled() == set()
    assert ahead.entries() == []
    groups = conn.xinfo_groups(keys.request_stream(PREFIX, MODEL))
    assert [g["name"] for g in groups] == [keys.CONSUMER_GROUP.encode()]
    conn.close()


def test_replies_received_in_parts_and_an_abandoned_connection(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    packer = resp.Packer()
    for value in (b"1", b"2"):
        packer.add(b"ECHO", value)
    in_flight = resp.send(conn, packer)
    assert in_flight.receive(1) == [b"1"]
    more = resp.Packer()
    more.add(b"ECHO", b"3")
    more.add(b"BLPOP", b"nothing", b"5")  # a reply still owed when abandoned
    in_flight.send(more)  # behind what is still owed
    assert in_flight.owed == 3
    assert in_flight.receive(2) == [b"2", b"3"]
    assert in_flight.owed == 1
    in_flight.abandon()
    assert in_flight.owed == 0
    with pytest.raises(RuntimeError, match="already received or abandoned"):
        in_flight.receive()
    # the connection with the owed BLPOP reply was dropped, not handed to the next caller
    assert conn.echo(b"next") == b"next"
    conn.close()


def test_a_run_that_raises_still_reads_its_recheck_and_frees_the_connection(
    config: Path, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given every run rechecked, and every run failing in the runtime
    monkeypatch.setattr(cancels_module, "RECHECK_AFTER_S", -1.0)

    def failing(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("the runtime broke (test)")

    monkeypatch.setattr(answer_module, "run_batch", failing)
    with running_worker(config) as worker:
        pool = worker.stream.client.connection_pool
        for i in range(6):
            send(rconn, MODEL, f"f{i}", _inputs())
            assert wait_reply(rconn, f"f{i}").error is not None
    # Then once the worker stopped, no connection is still checked out: each failed run's
    # recheck gave its connection back
    assert len(pool._in_use_connections) == 0  # type: ignore[attr-defined]
