"""Batch assembly into reused buffers: one copy, right values, bounded memory, no aliasing."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from worker.answer.assemble import FeedBuffers
from worker.answer.run import run_batch
from worker.errors import Rejected
from worker.items import Admitted
from worker.model.axes import Axes
from worker.model.schema import ValidRequest
from worker.redisio.cancels import CancelCheck
from worker.redisio.stream import RawEntry


def _request(x: np.ndarray) -> ValidRequest:
    return ValidRequest({"x": x}, x.shape[0], (x.shape[1:],), ("y",))


def _item(seq: int, x: np.ndarray) -> Admitted:
    return Admitted(RawEntry(f"1000-{seq}".encode(), {}), f"r{seq}", _request(x), CancelCheck())


def _rows(seed: int, rows: int, width: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)


def test_batch_is_the_requests_in_order_in_a_reused_buffer() -> None:
    buffers = FeedBuffers(capacity_rows=32)
    first = [_request(_rows(i, 1 + i % 3)) for i in range(10)]
    feeds = buffers.assemble(first)["x"]
    np.testing.assert_array_equal(feeds, np.concatenate([r.inputs["x"] for r in first]))
    second = [_request(_rows(100 + i, 2)) for i in range(5)]
    again = buffers.assemble(second)["x"]
    np.testing.assert_array_equal(again, np.concatenate([r.inputs["x"] for r in second]))
    assert np.shares_memory(feeds, again)  # the second batch reused the first one's memory
    assert buffers.nbytes == 32 * 8 * 4


def test_one_request_is_not_copied() -> None:
    x = _rows(1, 4)
    feeds = FeedBuffers(32).assemble([_request(x)])
    assert feeds["x"] is x


def test_padding_repeats_the_first_row() -> None:
    a, b = _rows(1, 2), _rows(2, 1)
    feeds = FeedBuffers(8).assemble([_request(a), _request(b)], pad_to=8)["x"]
    assert feeds.shape == (8, 8)
    np.testing.assert_array_equal(feeds[:3], np.concatenate([a, b]))
    np.testing.assert_array_equal(feeds[3:], np.repeat(a[:1], 5, axis=0))


def test_a_batch_larger_than_the_buffer_grows_it() -> None:
    buffers = FeedBuffers(capacity_rows=4)
    requests = [_request(_rows(i, 3)) for i in range(3)]
    feeds = buffers.assemble(requests)["x"]
    np.testing.assert_array_equal(feeds, np.concatenate([r.inputs["x"] for r in requests]))
    assert buffers.nbytes == 9 * 8 * 4


def test_only_a_few_shapes_are_kept_per_input() -> None:
    buffers = FeedBuffers(capacity_rows=16, shapes_kept=4)
    for width in range(1, 11):  # ten request shapes, as free non-batch dimensions allow
        buffers.assemble([_request(_rows(width, 1, width)), _request(_rows(width, 1, width))])
    assert buffers.nbytes == 16 * 4 * (7 + 8 + 9 + 10)  # the four most recent widths


class AliasingModel:
    """Returns its input as its output (as an Identity graph may) and fails on a marker row."""

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        x = feeds["x"]
        if (x == -1.0).all(axis=1).any():
            raise RuntimeError("marker row")
        return [x]


class FakeSchema:
    fixed_batch = None
    axes = Axes()

    def screen(self, feeds: object, requests: object) -> dict[int, Rejected]:
        return {}


def test_an_output_aliasing_the_buffer_survives_bisection() -> None:
    """Bisection runs the halves one after the other through the same buffer: the first half's
    outputs must not be overwritten by the second half's inputs."""
    good = [_rows(i, 1) for i in range(7)]
    bad = np.full((1, 8), -1.0, np.float32)
    items = [_item(i, x) for i, x in enumerate([*good[:3], bad, *good[3:]])]
    outcomes = run_batch(AliasingModel(), FakeSchema(), items, ["y"], buffers=FeedBuffers(8))  # type: ignore[arg-type]
    by_rid = {o.item.rid: o for o in outcomes}
    assert by_rid["r3"].error is not None
    assert by_rid["r3"].error.code == "INFERENCE_FAILED"
    for i, item in enumerate(items):
        if i == 3:
            continue
        out = by_rid[item.rid].outputs
        assert out is not None
        np.testing.assert_array_equal(out["y"], item.request.inputs["x"])


class Session:
    """A real onnxruntime session behind the worker's Model seam."""

    def __init__(self) -> None:
        weights = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
            [helper.make_tensor("w", TensorProto.FLOAT, [8, 4], weights.ravel().tolist())],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        self.weights = weights
        self.session = ort.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        return list(self.session.run(output_names, feeds))


def test_successive_batches_through_a_real_session_are_each_right() -> None:
    model, buffers = Session(), FeedBuffers(32)
    kept = []
    for b in range(3):
        items = [_item(i, _rows(b * 100 + i, 1 + i % 2)) for i in range(12)]
        kept.append((items, run_batch(model, FakeSchema(), items, ["y"], buffers=buffers)))  # type: ignore[arg-type]
    for items, outcomes in kept:  # checked only after every batch ran
        for item, outcome in zip(items, outcomes, strict=True):
            assert outcome.outputs is not None
            expected = item.request.inputs["x"] @ model.weights
            np.testing.assert_allclose(outcome.outputs["y"], expected, rtol=1e-5, atol=1e-5)
