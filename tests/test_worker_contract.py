"""Contract conformance, driven as another language would: raw redis-py and hand-built msgpack.

The model here is built in the test (not one of the repository's), and results are compared
with a direct ONNX Runtime run.
"""

from __future__ import annotations

import struct
from pathlib import Path

import msgpack
import numpy as np
import onnx
import pytest
from harness import direct_run, running_worker, stream_is_empty
from onnx import TensorProto, helper

CONTRACT_BODY = bytes.fromhex(
    "81a6696e7075747381a17883a56474797065a7666c6f61743332a57368617065920102a464617461c4080000803f000020c0"
)
STREAM = "redbatch:{scaler}:requests"


def _scaler_model(path: Path) -> Path:
    """x float32 [N,2] -> y = tanh(x * [3, -1] + 0.5): a model that is not in the repository."""
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "w"], ["m"]),
            helper.make_node("Add", ["m", "b"], ["a"]),
            helper.make_node("Tanh", ["a"], ["y"]),
        ],
        "scaler",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])],
        initializer=[
            helper.make_tensor("w", TensorProto.FLOAT, [2], [3.0, -1.0]),
            helper.make_tensor("b", TensorProto.FLOAT, [], [0.5]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture
def scaler(tmp_path: Path, redis_url: str) -> tuple[Path, Path]:
    model = _scaler_model(tmp_path / "scaler.onnx")
    config = tmp_path / "scaler.toml"
    config.write_text(
        f"""
[redis]
url = "{redis_url}"
[model]
name = "scaler"
path = "scaler.onnx"
version = "2024.1"
[batching]
max_batch_size = 32
max_wait_ms = 50
[warmup]
runs = 1
"""
    )
    return model, config


def _tensor(arr: np.ndarray) -> dict[str, object]:
    """A tensor map built from primitives, as a client in another language would."""
    return {"dtype": "float32", "shape": list(arr.shape), "data": arr.astype("<f4").tobytes()}


def _blpop(rconn, rid: str) -> dict:
    got = rconn.blpop([f"redbatch:{{scaler}}:reply:{rid}"], timeout=20)
    assert got is not None, f"no reply for {rid}"
    return msgpack.unpackb(got[1], raw=False)


def test_contract_example_body_is_answered_exactly(scaler, rconn) -> None:
    model_path, config = scaler
    with running_worker(config) as worker:
        rconn.xadd(STREAM, {"rid": "example-1", "body": CONTRACT_BODY})
        reply = _blpop(rconn, "example-1")

    assert set(reply) == {
        "rid", "ok", "outputs", "model", "worker", "batch_rows", "timings_ms", "class"
    }  # fmt: skip
    assert reply["class"] == "normal"  # contract section 7 (v3): a version 2 request's class
    assert reply["rid"] == "example-1"
    assert reply["ok"] is True
    y = reply["outputs"]["y"]
    assert y["dtype"] == "float32"
    assert y["shape"] == [1, 2]
    got = struct.unpack("<2f", y["data"])
    want = direct_run(model_path, {"x": np.array([[1.0, -2.5]], np.float32)})["y"][0]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert reply["model"]["name"] == "scaler"
    assert reply["model"]["version"] == "2024.1"
    assert len(reply["model"]["sha256"]) == 64
    assert reply["worker"] == worker.name
    assert reply["batch_rows"] == 1
    assert set(reply["timings_ms"]) >= {"queued", "inference"}
    assert stream_is_empty(rconn, "scaler")


def test_burst_of_single_rows_is_batched_and_equals_direct_run(scaler, rconn) -> None:
    # Given a burst of 400 single-row requests sent faster than one batch runs
    model_path, config = scaler
    xs = np.random.default_rng(3).normal(size=(400, 2)).astype(np.float32)
    with running_worker(config):
        pipe = rconn.pipeline(transaction=False)
        for i in range(len(xs)):
            body = msgpack.packb({"inputs": {"x": _tensor(xs[i : i + 1])}}, use_bin_type=True)
            pipe.xadd(STREAM, {"rid": f"burst-{i}", "body": body})
        pipe.execute()
        replies = [_blpop(rconn, f"burst-{i}") for i in range(len(xs))]

    # Then they ran in batches, and each answer equals a bare session run of that row
    rows = [r["batch_rows"] for r in replies]
    assert np.mean(rows) > 8, f"mean batch_rows {np.mean(rows)}"
    got = np.stack([np.frombuffer(r["outputs"]["y"]["data"], "<f4") for r in replies])
    want = direct_run(model_path, {"x": xs})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert stream_is_empty(rconn, "scaler")


def test_requests_sent_before_any_worker_existed_are_served(scaler, rconn) -> None:
    _, config = scaler
    for i in range(5):
        rconn.xadd(STREAM, {"rid": f"early-{i}", "body": CONTRACT_BODY})
    with running_worker(config):
        replies = [_blpop(rconn, f"early-{i}") for i in range(5)]
    assert all(r["ok"] for r in replies)


def test_existing_reply_is_never_replaced(scaler, rconn) -> None:
    # Given a reply already written for a request id (as after a redelivery)
    _, config = scaler
    rconn.rpush("redbatch:{scaler}:reply:twice", b"first")
    rconn.xadd(STREAM, {"rid": "twice", "body": CONTRACT_BODY})
    rconn.xadd(STREAM, {"rid": "marker", "body": CONTRACT_BODY})
    with running_worker(config):
        _blpop(rconn, "marker")
        # Then the entry is finished but the first reply stays the only one
        assert rconn.lrange("redbatch:{scaler}:reply:twice", 0, -1) == [b"first"]
    assert stream_is_empty(rconn, "scaler")


def test_reply_ttl_is_the_smaller_of_request_and_worker(scaler, rconn) -> None:
    _, config = scaler
    body = msgpack.packb(
        {"inputs": {"x": _tensor(np.ones((1, 2), np.float32))}, "reply_ttl_s": 60},
        use_bin_type=True,
    )
    longer = msgpack.packb(
        {"inputs": {"x": _tensor(np.ones((1, 2), np.float32))}, "reply_ttl_s": 100_000},
        use_bin_type=True,
    )
    with running_worker(config):
        rconn.xadd(STREAM, {"rid": "ttl", "body": body})
        rconn.xadd(STREAM, {"rid": "ttl-longer", "body": longer})
        rconn.xadd(STREAM, {"rid": "ttl-default", "body": CONTRACT_BODY})
        rconn.xadd(STREAM, {"rid": "marker", "body": CONTRACT_BODY})
        _blpop(rconn, "marker")  # answered in order: the ones before it are written too
    assert 0 < rconn.ttl("redbatch:{scaler}:reply:ttl") <= 60
    assert (
        60 < rconn.ttl("redbatch:{scaler}:reply:ttl-longer") <= 3600
    )  # the worker's own is smaller
    assert 60 < rconn.ttl("redbatch:{scaler}:reply:ttl-default") <= 3600
