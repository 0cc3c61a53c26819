"""Layouts: a body laid out like one admitted before is admitted without decoding, and exactly as
the full path would admit it; anything else takes the full path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from fuzzing import FuzzTarget, schema_for
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.protocol import codec
from worker.config import BatchingConfig, ModelConfig, RedisConfig, WorkerConfig
from worker.errors import Rejected
from worker.intake import admit as admit_module
from worker.intake.admit import admit
from worker.intake.layouts import Layouts
from worker.intake.spans import body_spans
from worker.items import Admitted, Item, Refused
from worker.model.schema import Schema
from worker.model.session import TensorSpec
from worker.redisio.stream import RawEntry

MAX_BYTES = 1 << 20
MULTI = schema_for(FuzzTarget("multi_io"))


def free_schema() -> Schema:
    """One float32 input of shape [N, D], D free: bodies of one length may differ in shape."""
    spec = TensorSpec("x", np.dtype("float32"), ("N", "D"))
    config = WorkerConfig(
        RedisConfig(), ModelConfig("free", Path("free.onnx")), batching=BatchingConfig()
    )
    return Schema([spec], [TensorSpec("y", np.dtype("float32"), ("N", "D"))], config)


FREE = free_schema()


def multi_body(seed: int, **options: Any) -> bytes:
    rng = np.random.default_rng(seed)
    inputs = {
        "a": rng.standard_normal((2, 3)).astype(np.float32),
        "b": rng.integers(-9, 9, (2, 2)).astype(np.int64),
    }
    return codec.encode_request(inputs, **options)


def run(body: bytes, schema: Schema, layouts: Layouts | None) -> Item:
    return admit(RawEntry(b"1-0", {b"rid": b"r1", b"body": body}), schema, MAX_BYTES, 1, layouts)


def admitted(item: Item) -> Admitted:
    assert isinstance(item, Admitted), item
    return item


def refusal(item: Item) -> Rejected:
    assert isinstance(item, Refused), item
    return item.error


def same(a: Item, b: Item) -> None:
    """Two admissions agree on everything a batch and a reply use."""
    assert type(a) is type(b)
    if isinstance(a, Refused):
        assert isinstance(b, Refused)
        assert (a.error.code, a.error.message) == (b.error.code, b.error.message)
        assert (a.reply_ttl_s, a.meta_raw) == (b.reply_ttl_s, b.meta_raw)
        return
    a, b = admitted(a), admitted(b)
    assert (a.reply_ttl_s, a.deadline_ms, a.meta_raw) == (b.reply_ttl_s, b.deadline_ms, b.meta_raw)
    assert (a.request.rows, a.request.signature, a.request.outputs) == (
        b.request.rows,
        b.request.signature,
        b.request.outputs,
    )
    assert list(a.request.inputs) == list(b.request.inputs)
    for name, array in a.request.inputs.items():
        other = b.request.inputs[name]
        assert (array.dtype, array.shape) == (other.dtype, other.shape)
        assert array.tobytes() == other.tobytes()


def test_a_body_laid_out_like_an_admitted_one_is_not_decoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layouts = Layouts()
    run(multi_body(0, outputs=["total"], reply_ttl_s=30), MULTI, layouts)
    monkeypatch.setattr(admit_module, "decode_request", lambda *_: pytest.fail("decoded again"))
    body = multi_body(1, outputs=["total"], reply_ttl_s=30)
    item = admitted(run(body, MULTI, layouts))
    monkeypatch.undo()
    same(item, run(body, MULTI, None))
    assert item.request.outputs == ("total",)
    assert item.reply_ttl_s == 30
    # The arrays are views of the body: decoding copies nothing.
    assert all(
        np.shares_memory(a, np.frombuffer(body, np.uint8)) for a in item.request.inputs.values()
    )


def test_same_length_but_another_shape_is_decoded_and_gets_its_own_shape() -> None:
    layouts = Layouts()
    x = np.arange(16, dtype=np.float32)
    first = codec.encode_request({"x": x.reshape(1, 16)})
    second = codec.encode_request({"x": x.reshape(2, 8)})
    assert len(first) == len(second)
    run(first, FREE, layouts)
    item = admitted(run(second, FREE, layouts))
    assert item.request.inputs["x"].shape == (2, 8)
    assert item.request.rows == 2
    same(item, run(second, FREE, None))


def test_meta_whose_bytes_change_per_request_is_not_kept() -> None:
    layouts = Layouts()
    run(multi_body(0, meta={"user": 7}), MULTI, layouts)
    assert len(layouts) == 0


def test_deadlines_are_read_from_their_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    layouts = Layouts()
    now_ms = 1_764_000_000_000  # epoch milliseconds: a uint64, as clients pack them
    run(multi_body(0, deadline_ms=now_ms), MULTI, layouts)
    monkeypatch.setattr(admit_module, "decode_request", lambda *_: pytest.fail("decoded again"))
    for deadline_ms in (now_ms + 1, now_ms + 10**9, 2**40):
        body = multi_body(1, deadline_ms=deadline_ms)
        assert admitted(run(body, MULTI, layouts)).deadline_ms == deadline_ms


def test_a_deadline_packed_small_is_not_kept() -> None:
    layouts = Layouts()
    run(multi_body(0, deadline_ms=5), MULTI, layouts)  # a fixint: its one byte is its value
    assert len(layouts) == 0


def test_bool_inputs_are_not_kept() -> None:
    spec = TensorSpec("flags", np.dtype("bool"), ("N", 4))
    config = WorkerConfig(RedisConfig(), ModelConfig("b", Path("b.onnx")))
    schema = Schema([spec], [TensorSpec("y", np.dtype("bool"), ("N", 4))], config)
    layouts = Layouts()
    run(codec.encode_request({"flags": np.ones((1, 4), bool)}), schema, layouts)
    assert len(layouts) == 0
    # So a bool byte other than 0 or 1 is still refused, as the full path refuses it.
    bad = codec.encode_request({"flags": np.ones((1, 4), bool)}).replace(
        b"\x01\x01\x01\x01", b"\x01\x02\x01\x01"
    )
    assert refusal(run(bad, schema, layouts)) is not None


def test_layouts_stay_bounded_under_ever_new_layouts() -> None:
    layouts = Layouts(capacity=8)
    for ttl in range(1, 400):
        run(multi_body(0, reply_ttl_s=ttl), MULTI, layouts)
        assert len(layouts) <= 8
    assert len(layouts) > 0


BASE = multi_body(0, outputs=["twice", "total"], reply_ttl_s=100)
# A deadline packed as a signed 64-bit integer, as some msgpack libraries pack every integer:
# an edit of its first byte can make it negative, which the full path refuses.
DEADLINE_KEY = msgpack.packb("deadline_ms")
SIGNED_DEADLINE = multi_body(0, deadline_ms=2**40).replace(
    DEADLINE_KEY + b"\xcf", DEADLINE_KEY + b"\xd3"
)


@pytest.mark.parametrize("base", [BASE, SIGNED_DEADLINE], ids=["plain", "signed-deadline"])
@settings(max_examples=400, derandomize=True, database=None, deadline=None)
@given(
    edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=3)
)
def test_any_edit_of_a_known_body_is_admitted_as_the_full_path_admits_it(
    base: bytes, edits: list[tuple[int, int]]
) -> None:
    layouts = Layouts()
    run(base, MULTI, layouts)
    assert len(layouts) == 1
    body = bytearray(base)
    for position, value in edits:
        body[position % len(body)] = value
    edited = bytes(body)
    same(run(edited, MULTI, layouts), run(edited, MULTI, None))


def test_a_negative_signed_deadline_is_refused_as_the_full_path_refuses_it() -> None:
    layouts = Layouts()
    run(SIGNED_DEADLINE, MULTI, layouts)
    at = SIGNED_DEADLINE.index(DEADLINE_KEY + b"\xd3") + len(DEADLINE_KEY) + 1
    negative = SIGNED_DEADLINE[:at] + b"\xff" + SIGNED_DEADLINE[at + 1 :]
    item = run(negative, MULTI, layouts)
    assert refusal(item).code == "MALFORMED"
    same(item, run(negative, MULTI, None))


def test_body_spans_point_at_each_inputs_data() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((1, 300), 7, dtype=np.int64)  # a bin of over 255 bytes: a 2-byte length
    body = codec.encode_request({"a": a, "b": b}, outputs=["total"], reply_ttl_s=5)
    spans = body_spans(body).data
    assert body[spans["a"][0] : sum(spans["a"])] == a.tobytes()
    assert body[spans["b"][0] : sum(spans["b"])] == b.tobytes()
