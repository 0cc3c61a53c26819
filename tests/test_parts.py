"""Requests split across batches (worker/answer/parts.py): a lower class's rows fill the room a
higher class leaves, the parts are joined in row order, and one reply is written per request.

Without splitting, a one-row high request beside a backlog of 32-row low requests runs as a
batch of its own, and every such request costs the backlog a whole run.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import redis
from eventually import eventually
from harness import PREFIX, running_worker, write_config

from producer.protocol import keys
from producer.protocol.codec import decode_reply, encode_request
from producer.protocol.lanes import Lane, lane_stream, lanes_key
from worker.answer import parts
from worker.answer.batcher import Batcher
from worker.answer.scheduler import LaneQueue
from worker.config.settings import SchedulingConfig
from worker.errors import Rejected
from worker.items import Admitted, Outcome
from worker.model.schema import ValidRequest
from worker.redisio.cancels import CancelCheck
from worker.redisio.stream import RawEntry

HIGH = Lane("t", "high")
LOW = Lane("t", "low")


def _item(lane: Lane | None, seq: int, rows: int, deliveries: int = 1) -> Admitted:
    entry = RawEntry(f"1000-{seq}".encode(), {}, lane=lane)
    x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) + 1000 * seq
    request = ValidRequest({"x": x}, rows, ((2,),), ("y",))
    return Admitted(entry, f"r{seq}", request, CancelCheck(), deliveries=deliveries)


def _batcher(max_rows: int = 32) -> tuple[LaneQueue, Batcher]:
    q = LaneQueue(SchedulingConfig(), max_rows, 2)
    return q, Batcher(q, max_rows, 5.0, wall_ms=lambda: 1e12, split=True)


def _ran(batch: list[Any]) -> list[Outcome]:
    """Each item's outcome as a model that doubles its input would give it."""
    return [Outcome(i, {"y": i.request.inputs["x"] * 2}, None, 32, 1.0) for i in batch]


def test_a_low_request_fills_the_room_behind_a_high_row_and_every_batch_is_full() -> None:
    # Given a high request of one row and a low backlog of 32-row requests
    q, batcher = _batcher()
    q.put([_item(LOW, i, 32) for i in range(2)])
    q.put([_item(HIGH, 9, 1)])
    # When batches are formed
    batches = [batcher.next_batch(1.0) for _ in range(3)]
    # Then the high row leads a full batch, and the low rows follow it without a gap
    assert [i.rows for i in batches[0]] == [1, 31]
    assert [i.rows for i in batches[1]] == [1, 31]
    assert [i.rows for i in batches[2]] == [1]
    assert batches[0][0].entry.lane == HIGH
    # and the parts join back into each whole request, rows in order, as its outputs
    joined = parts.join(o for b in reversed(batches) for o in _ran(b))
    by_rid = {o.item.rid: o for o in joined}
    assert sorted(by_rid) == ["r0", "r1", "r9"]
    for rid in ("r0", "r1"):
        whole = by_rid[rid]
        assert whole.item.part is None
        assert whole.item.rows == 32
        np.testing.assert_array_equal(whole.outputs["y"], whole.item.request.inputs["x"] * 2)


def test_requests_of_one_class_are_never_split() -> None:
    q, batcher = _batcher()
    q.put([_item(LOW, i, 20) for i in range(3)])
    assert [i.rows for i in batcher.next_batch(1.0)] == [20]
    assert [i.rows for i in batcher.next_batch(1.0)] == [20]


def test_a_redelivered_request_is_never_split() -> None:
    q, batcher = _batcher()
    q.put([_item(HIGH, 9, 1)])
    q.put([_item(LOW, 1, 32, deliveries=2)])
    assert [i.rows for i in batcher.next_batch(1.0)] == [1]
    assert [i.rows for i in batcher.next_batch(1.0)] == [32]


def test_a_part_that_failed_fails_the_whole_request_once_all_parts_are_in() -> None:
    q, batcher = _batcher()
    q.put([_item(LOW, 1, 32)])
    q.put([_item(HIGH, 9, 1)])
    first, second = batcher.next_batch(1.0), batcher.next_batch(1.0)
    head, tail = first[1], second[0]
    error = Rejected("DEADLINE_EXCEEDED", "late")
    # the head ran; nothing is answered until the tail is in
    assert parts.join([Outcome(head, {"y": head.request.inputs["x"]}, None, 32, 1.0)]) == []
    [whole] = parts.join([Outcome(tail, None, error, 0, 0.0)])
    assert (whole.item.rid, whole.error, whole.outputs) == ("r1", error, None)


def test_a_higher_class_is_never_split_behind_a_lower_part_nor_rows_of_another_shape() -> None:
    q, batcher = _batcher()
    q.put([_item(LOW, 1, 32)])
    q.put([_item(HIGH, 9, 1)])
    batcher.next_batch(1.0)
    [tail] = batcher.next_batch(1.0)
    assert tail.part is not None
    # a high request never waits behind a low tail for the rest of its rows
    assert parts.split([tail], _item(HIGH, 2, 20), 31) is None
    # a low request whose rows have another shape would not share the high rows' run
    other = _item(LOW, 3, 32)
    other.request = dataclasses.replace(other.request, signature=((3,),))
    assert parts.split([_item(HIGH, 4, 1)], other, 31) is None
    assert parts.split([_item(HIGH, 4, 1)], _item(LOW, 5, 32), 31) is not None


def test_once_a_part_failed_the_rest_is_refused_with_its_error() -> None:
    q, batcher = _batcher()
    q.put([_item(LOW, 1, 32)])
    q.put([_item(HIGH, 9, 1)])
    head = batcher.next_batch(1.0)[1]
    [tail] = batcher.next_batch(1.0)
    assert parts.failed(tail) is None
    error = Rejected("CANCELLED", "the caller cancelled it")
    assert parts.join([Outcome(head, None, error, 0, 0.0)]) == []
    assert parts.failed(tail) == error


MODEL = "demo"


def _send(r: redis.Redis, cls: str, rid: str, x: np.ndarray) -> None:
    stream = lane_stream(PREFIX, MODEL, cls)
    pipe = r.pipeline(transaction=True)
    pipe.sadd(lanes_key(PREFIX, MODEL), stream)
    pipe.xadd(stream, {"rid": rid, "body": encode_request({"features": x})})
    pipe.execute()


def test_a_worker_joins_split_low_requests_into_their_exact_outputs(tmp_path: Path, rconn) -> None:
    # Given a worker, a backlog of 32-row low requests of distinct rows, and a high caller that
    # keeps sending one-row requests while the backlog drains
    port = rconn.connection_pool.connection_kwargs["port"]
    config = write_config(tmp_path, MODEL, f"redis://127.0.0.1:{port}/0")
    rng = np.random.default_rng(3)
    low = {f"low{i}": rng.normal(size=(32, 16)).astype(np.float32) for i in range(60)}
    session = ort.InferenceSession(str(tmp_path / f"{MODEL}.onnx"))
    with running_worker(config) as worker:
        _send(rconn, "high", "warm", low["low0"][:1])  # both lanes learnt before the backlog
        _send(rconn, "low", "warm-low", low["low0"])
        eventually(lambda: rconn.llen(keys.reply_key(PREFIX, MODEL, "warm-low")) == 1)
        done = threading.Event()

        def caller() -> None:
            n = 0
            while not done.is_set():
                key = keys.reply_key(PREFIX, MODEL, f"h{n}")
                _send(rconn, "high", f"h{n}", low["low1"][:1])
                eventually(lambda key=key: rconn.llen(key) == 1)
                n += 1

        thread = threading.Thread(target=caller, daemon=True)
        thread.start()
        try:
            for rid, x in low.items():
                _send(rconn, "low", rid, x)
            for rid in low:
                eventually(lambda rid=rid: rconn.llen(keys.reply_key(PREFIX, MODEL, rid)) > 0)
        finally:
            done.set()
            thread.join(30)
        # Then requests were split (rows of a low request ran in two batches) ...
        assert worker.batcher.splits > 0
        counted = worker.metrics.registry.get_sample_value(
            "redbatch_requests_split_total", {"class": "low"}
        )
        assert counted == worker.batcher.splits
    # ... and each low request has one reply, its outputs exactly its own rows' in order
    for rid, x in low.items():
        key = keys.reply_key(PREFIX, MODEL, rid)
        assert rconn.llen(key) == 1
        reply = decode_reply(rconn.lindex(key, 0))
        assert reply.ok, reply.error
        names = [o.name for o in session.get_outputs()]
        for name, expected in zip(names, session.run(None, {"features": x}), strict=True):
            np.testing.assert_allclose(reply.outputs[name], expected, rtol=1e-6)


def test_splitting_is_off_when_configured_so(tmp_path: Path, rconn) -> None:
    port = rconn.connection_pool.connection_kwargs["port"]
    url = f"redis://127.0.0.1:{port}/0"
    on = write_config(tmp_path, MODEL, url, name="on")
    off = write_config(
        tmp_path, MODEL, url, name="off", extra="[scheduling]\nsplit_requests = false"
    )
    with running_worker(on, name="w-on") as worker:
        assert worker.batcher.split
    with running_worker(off, name="w-off") as worker:
        assert not worker.batcher.split
