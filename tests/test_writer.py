"""Where a batch's replies are written: on the writer thread while another batch waits to run or
when the model is the bottleneck (its run took longer than a typical write), otherwise on the
serving thread (worker/answer/writer.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import redis
from harness import send, serve_in_thread, wait_reply, write_config

from producer.protocol import keys
from worker.answer.finisher import Finisher
from worker.answer.writer import Batch, ReplyWriter
from worker.config import load_config
from worker.errors import WorkerError
from worker.events import Events
from worker.intake.leases import Leases
from worker.intake.shardmap import ShardMap
from worker.redisio.stream import Finish, RequestStream
from worker.service import Worker, prepare

STREAM = "redbatch:{demo}:requests"


def _read_batch(rconn: redis.Redis, stream: RequestStream, rid: str) -> Batch:
    """One entry added and read by this consumer, as a batch answering it with ``rid``."""
    rconn.xadd(STREAM, {"rid": rid, "body": b"b"})
    got = rconn.xreadgroup("workers", stream.consumer, {STREAM: ">"}, count=1)
    entry_id = got[0][1][0][0]
    return Batch([Finish(entry_id, rid, rid.encode())])


class _Recorder:
    """The record a ReplyWriter counts each written batch in: notes each batch's writing thread;
    can hold the first."""

    def __init__(self, hold_first: bool = False) -> None:
        self.threads: list[str] = []
        self.first_written = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()

    def update(self, **changes: object) -> None:
        self.threads.append(threading.current_thread().name)
        self.first_written.set()
        assert self.release.wait(10)


@pytest.fixture
def stream(rconn: redis.Redis) -> RequestStream:
    stream = RequestStream(rconn, "redbatch", "demo", "me")
    stream.ensure_group()
    return stream


def _finisher(stream: RequestStream) -> Finisher:
    shards = ShardMap(stream.tag)
    shards.add(stream.tag, stream, Leases())
    return Finisher(shards)


def _writer(stream: RequestStream, recorder: _Recorder) -> tuple[ReplyWriter, threading.Event]:
    stopped = threading.Event()
    writer = ReplyWriter(_finisher(stream), threading.Event(), stopped, record=recorder)
    writer.start()
    return writer, stopped


class _DropAfterFinish(Events):
    """Drops a shard from the map once the write is in Redis, before its leases are released
    (its lane retired meanwhile)."""

    def __init__(self, shards: ShardMap, tag: str) -> None:
        self.shards = shards
        self.tag = tag

    def point(self, name: str) -> None:
        if name == "after_finish":
            self.shards.drop(self.tag)


def _two_shards(rconn: redis.Redis) -> tuple[ShardMap, Batch]:
    """A map of two shards, each with one entry read and held, and the batch answering both."""
    shards = ShardMap("demo")
    finishes = []
    for tag in ("demo", "demo~b"):
        stream = RequestStream(rconn, "redbatch", tag, "me")
        stream.ensure_group()
        leases = Leases()
        shards.add(tag, stream, leases)
        rconn.xadd(keys.request_stream("redbatch", tag), {"rid": f"in-{tag}", "body": b"b"})
        [entry] = stream.read(8, 0)
        leases.hold([entry.entry_id])
        finishes.append(Finish(entry.entry_id, f"in-{tag}", b"reply", shard=tag))
    return shards, Batch(finishes)


def test_a_mixed_shard_write_releases_each_shards_leases(rconn: redis.Redis) -> None:
    shards, batch = _two_shards(rconn)
    held = [shard.leases for tag in ("demo", "demo~b") if (shard := shards.get(tag))]
    writer = ReplyWriter(Finisher(shards), threading.Event(), threading.Event())
    writer.submit(batch, here=True)
    assert batch.finished == [True, True]
    assert [len(leases) for leases in held] == [0, 0]
    assert writer.served == {"requests": 2, "batches": 1}


def test_a_shard_dropped_during_a_write_is_skipped_when_leases_are_released(
    rconn: redis.Redis,
) -> None:
    # Given a mixed batch whose second shard leaves the map once the batch is in Redis
    shards, batch = _two_shards(rconn)
    first = shards.get("demo")
    assert first is not None
    events = _DropAfterFinish(shards, "demo~b")
    writer = ReplyWriter(Finisher(shards), threading.Event(), threading.Event(), events=events)
    # When it is written, then nothing raises and the shard still served has its lease released
    writer.submit(batch, here=True)
    assert batch.finished == [True, True]
    assert shards.get("demo~b") is None
    assert len(first.leases) == 0
    assert writer.failure is None


def test_with_nothing_queued_a_batch_is_written_before_submit_returns(rconn, stream) -> None:
    recorder = _Recorder()
    writer, _ = _writer(stream, recorder)
    writer.submit(_read_batch(rconn, stream, "r0"), here=True)
    # written on this thread, by the time submit returned
    assert recorder.threads == [threading.current_thread().name]
    assert rconn.lrange("redbatch:{demo}:reply:r0", 0, -1) == [b"r0"]
    writer.submit(_read_batch(rconn, stream, "r1"))  # without here: the writer's thread
    writer.close()
    assert recorder.threads[1] == "redbatch-writer"
    assert rconn.xpending(STREAM, "workers")["pending"] == 0


def test_a_batch_submitted_while_another_is_being_written_waits_on_the_writer(
    rconn, stream
) -> None:
    # Given the writer's thread busy with a first batch
    recorder = _Recorder(hold_first=True)
    writer, _ = _writer(stream, recorder)
    writer.submit(_read_batch(rconn, stream, "r0"))
    assert recorder.first_written.wait(10)
    # When a second is submitted to be written here, it queues behind the first instead
    writer.submit(_read_batch(rconn, stream, "r1"), here=True)
    assert recorder.threads == ["redbatch-writer"]
    assert not rconn.exists("redbatch:{demo}:reply:r1")
    recorder.release.set()
    writer.close()
    assert recorder.threads == ["redbatch-writer", "redbatch-writer"]
    assert rconn.xpending(STREAM, "workers")["pending"] == 0


def test_a_write_here_that_fails_is_raised_and_stops_the_writer(rconn, stream) -> None:
    # Given a key of another type where the request stream should be (no retry can fix that)
    writer, stopped = _writer(stream, _Recorder())
    batch = _read_batch(rconn, stream, "r0")
    rconn.delete(STREAM)
    rconn.set(STREAM, "not a stream")
    with pytest.raises(WorkerError, match="WRONGTYPE"):
        writer.submit(batch, here=True)
    # the service is told to stop, and every later batch is refused as it would be on the thread
    assert stopped.is_set()
    with pytest.raises(WorkerError, match="reply writer stopped"):
        writer.submit(batch)
    writer.join(timeout=10)  # and its thread has ended
    assert not writer.is_alive()


def test_the_typical_write_is_learnt_from_writes_that_needed_no_retry(
    rconn, stream, monkeypatch
) -> None:
    writer, _ = _writer(stream, _Recorder())
    assert writer.typical_s == 0.0  # nothing is written here until a write was timed
    writer.submit(_read_batch(rconn, stream, "r0"), here=True)
    learnt = writer.typical_s
    assert 0.0 < learnt < 1.0
    # A write that went through an outage says nothing about how long writes take
    finish = stream.finish_each
    failed = []

    def fail_once(finishes):
        if not failed:
            failed.append(True)
            raise redis.ConnectionError("Connection refused")
        return finish(finishes)

    monkeypatch.setattr(stream, "finish_each", fail_once)
    writer.submit(_read_batch(rconn, stream, "r2"), here=True)
    assert failed
    assert rconn.lrange("redbatch:{demo}:reply:r2", 0, -1) == [b"r2"]
    assert writer.typical_s == learnt
    writer.close()


class _Watched:
    """Hooks on a worker: ``second_read`` is set once the reader handed over two reads (their sizes
    in ``handed_over``), ``first_written`` once the writer is idle again after its first batch,
    and ``threads`` names the thread that wrote each batch."""

    def __init__(self, worker: Worker) -> None:
        self.handed_over: list[int] = []
        self.threads: list[str] = []
        self.second_read, self.first_written = threading.Event(), threading.Event()
        put, written = worker.queue.put, worker.writer._written
        done = worker.writer._queue.task_done

        def put_and_count(items, *args, **kwargs) -> None:
            put(items, *args, **kwargs)
            self.handed_over.append(len(items))
            if len(self.handed_over) == 2:
                self.second_read.set()

        def note_thread(batch: Batch, seconds: float) -> None:
            self.threads.append(threading.current_thread().name)
            written(batch, seconds)

        def done_and_note() -> None:  # the writer is idle again once its batch is marked done
            done()
            self.first_written.set()

        worker.queue.put = put_and_count  # type: ignore[method-assign]
        worker.writer._written = note_thread  # type: ignore[method-assign]
        worker.writer._queue.task_done = done_and_note  # type: ignore[method-assign]


def _tiny_worker(tmp_path: Path, redis_url: str) -> tuple[Worker, redis.Redis]:
    path = write_config(tmp_path, "tiny", redis_url, batching="max_batch_size = 4")
    client = redis.Redis.from_url(redis_url)
    return Worker(prepare(load_config(path), "w1"), client), client


_X = np.ones((1, 128), np.float32)


def test_writes_on_the_writer_thread_teach_the_typical_write_too(rconn, stream) -> None:
    # a worker's first writes go to the writer thread (nothing is known yet): they must teach
    # the average, or no write would ever be made on the serving thread
    writer, _ = _writer(stream, _Recorder())
    writer.submit(_read_batch(rconn, stream, "r0"))
    writer.close()
    assert 0.0 < writer.typical_s < 1.0


def test_the_rule_for_writing_here(tmp_path: Path, redis_url: str) -> None:
    worker, client = _tiny_worker(tmp_path, redis_url)
    try:
        worker.writer.typical_s = 0.010
        short, long = [(4, 0.001)], [(4, 0.001), (4, 0.010)]  # a batch may have several runs
        assert worker._write_here(short)
        assert not worker._write_here(long)  # the model is the bottleneck: keep it fed
        worker.batcher._buffer.append(object())  # type: ignore[arg-type]
        assert not worker._write_here(short)  # items taken from the reader wait for a batch
        worker.batcher._buffer.clear()
        worker.queue.put_nowait([])
        assert not worker._write_here(short)  # a read waits to be batched
    finally:
        client.close()


def _serve_two_reads(
    tmp_path: Path, redis_url: str, rconn: redis.Redis, write_s: float
) -> list[str]:
    """Two reads of four, each a batch: the first is held until the second is handed over (so
    a read waits behind it), the second until the first is written (so none does). Returns the
    thread that wrote each batch, given a typical write of ``write_s``."""
    rids = [send(rconn, "tiny", f"w-{i}", {"x": _X}) for i in range(8)]
    worker, client = _tiny_worker(tmp_path, redis_url)
    watched = _Watched(worker)
    turns = [watched.second_read, watched.first_written]
    process = worker.process

    def process_in_turn(batch) -> None:
        assert turns.pop(0).wait(10), "the worker never got to this batch's turn"
        worker.writer.typical_s = write_s  # as if writes had taken this long so far
        process(batch)

    worker.process = process_in_turn  # type: ignore[method-assign]
    thread, failure = serve_in_thread(worker, "w1")
    try:
        replies = [wait_reply(rconn, rid) for rid in rids]
    finally:
        worker.request_stop()
        thread.join(timeout=30)
        client.close()
    assert not failure, failure
    assert all(r.ok for r in replies)
    assert watched.handed_over == [4, 4]
    return watched.threads


def test_a_batch_that_ran_shorter_than_a_write_is_written_here_unless_a_read_waits(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    # the first batch's read waits behind it, so the writer takes it; nothing waits behind
    # the second, and its run (well under a second) was shorter than a write: written here
    threads = _serve_two_reads(tmp_path, redis_url, rconn, write_s=1.0)
    assert threads == ["redbatch-writer", "worker-w1"]


def test_a_batch_that_ran_longer_than_a_write_is_left_to_the_writer(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    # the model is the bottleneck: no batch may wait on a write, so the writer takes both
    threads = _serve_two_reads(tmp_path, redis_url, rconn, write_s=0.0)
    assert threads == ["redbatch-writer", "redbatch-writer"]


def test_a_write_that_fails_here_while_draining_stops_the_lease_keeper(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    """The second batch is written during the shutdown drain, on the serving thread, and Redis
    refuses it: the worker stops with the error and stops renewing, so that other workers can
    claim the entries it leaves pending."""
    for i in range(4):
        send(rconn, "tiny", f"a-{i}", {"x": _X})
    worker, client = _tiny_worker(tmp_path, redis_url)
    watched = _Watched(worker)
    first_running, go = threading.Event(), threading.Event()
    turns = [(first_running, go), (threading.Event(), watched.first_written)]
    run, finish = worker.model.run, worker.stream.finish_each

    def run_in_turn(feeds, names):
        started, wait_for = turns.pop(0)
        started.set()
        assert wait_for.wait(10), "the worker never got to this batch's turn"
        return run(feeds, names)

    def refused_off_the_writer(finishes):
        if threading.current_thread().name != "redbatch-writer":
            raise redis.ResponseError("NOPERM this user has no permissions to run 'evalsha'")
        return finish(finishes)

    worker.model.run = run_in_turn  # type: ignore[method-assign]
    worker.stream.finish_each = refused_off_the_writer  # type: ignore[method-assign]
    worker.writer.typical_s = 10.0  # every run is shorter than a write: written here
    thread, failure = serve_in_thread(worker, "w1")
    try:
        assert first_running.wait(10)
        pipe = rconn.pipeline(transaction=True)  # one transaction: one read of four
        for i in range(4):
            send(pipe, "tiny", f"b-{i}", {"x": _X})
        pipe.execute()
        assert watched.second_read.wait(10)
        worker.request_stop()  # the first batch is running: the second is answered draining
        go.set()
        thread.join(timeout=30)
    finally:
        client.close()
    assert not thread.is_alive()
    assert len(failure) == 1
    assert "NOPERM" in str(failure[0])
    assert not worker.keeper.is_alive()
    assert wait_reply(rconn, "a-0").ok  # the first batch went to the writer and was answered
    assert watched.handed_over == [4, 4]
    assert rconn.xpending("redbatch:{tiny}:requests", "workers")["pending"] == 4


def test_only_the_entries_finished_here_count_as_served(tmp_path: Path, redis_url: str) -> None:
    # Given a batch of two read by this worker, one of which another consumer claimed meanwhile
    # (a batch taken for hung, say): its reply is that consumer's to write
    worker, client = _tiny_worker(tmp_path, redis_url)
    worker.stream.ensure_group()
    stream_key = worker.stream.key
    for rid in ("mine", "claimed"):
        client.xadd(stream_key, {"rid": rid, "body": b"b"})
    got = client.xreadgroup("workers", "w1", {stream_key: ">"}, count=2)
    ids = [entry_id for entry_id, _ in got[0][1]]
    client.xclaim(stream_key, "workers", "other", 0, [ids[1]])
    batch = Batch([Finish(ids[0], "mine", b"r"), Finish(ids[1], "claimed", b"r")])

    # When the worker writes it
    worker.writer.submit(batch, here=True)

    # Then one reply is written and one request counted, not two
    assert batch.finished == [True, False]
    assert client.exists("redbatch:{tiny}:reply:mine")
    assert not client.exists("redbatch:{tiny}:reply:claimed")
    assert worker.served["requests"] == 1
    assert worker.metrics.requests.labels(code="OK")._value.get() == 1
    worker.writer.close()


@pytest.mark.parametrize("error", [redis.ConnectionError, ValueError])
def test_giving_up_on_redis_when_told_is_one_line_not_a_traceback(
    rconn, stream, monkeypatch, caplog, error
) -> None:
    # A second stop signal during an outage sets give_up: the writer stops retrying, as asked,
    # and says so in one line (a traceback of the Redis error would read as a crash).
    give_up = threading.Event()
    writer = ReplyWriter(_finisher(stream), give_up, threading.Event(), record=_Recorder())
    tries = []

    def down(finishes):
        tries.append(1)
        if len(tries) == 2:
            give_up.set()  # the second signal comes while it retries
        raise error("Connection refused")

    if error is ValueError:  # not an outage: no retry, and after a stop signal all the same
        give_up.set()
    monkeypatch.setattr(stream, "finish_each", down)
    with pytest.raises(WorkerError):
        writer.submit(_read_batch(rconn, stream, "r0"), here=True)
    assert isinstance(writer.failure, error)
    [record] = [r for r in caplog.records if r.name == "worker.answer.writer"]
    if error is ValueError:  # a bug, whenever it comes, keeps its traceback
        assert record.exc_info is not None
        return
    assert "gave up on Redis as told" in record.getMessage()
    assert record.exc_info is None
