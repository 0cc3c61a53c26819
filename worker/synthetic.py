"""Small ONNX models built with ``onnx.helper`` from a fixed seed: the demo, tests and benchmarks.

Nothing is downloaded; ``onnx`` comes with the ``demo`` and ``dev`` extras. Each builder returns a
ModelProto; ``save(name, path)`` writes one by name.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BUILDERS", "save"]

_OPSET = 17


def _onnx() -> Any:
    try:
        import onnx
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "Building models needs the onnx package: pip install 'redbatch[demo]'."
        ) from exc
    return onnx


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any], inits: list[Any]) -> Any:
    onnx = _onnx()
    graph = onnx.helper.make_graph(nodes, "redbatch", inputs, outputs, initializer=inits)
    model = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", _OPSET)], producer_name="redbatch"
    )
    model.ir_version = 9  # readable by every onnxruntime >= 1.16
    onnx.checker.check_model(model)
    return model


def _value(name: str, elem: int, shape: list[Any]) -> Any:
    return _onnx().helper.make_tensor_value_info(name, elem, shape)


def _init(name: str, array: np.ndarray) -> Any:
    return _onnx().numpy_helper.from_array(array, name)


def _mlp(widths: list[int], in_name: str, out_name: str, seed: int) -> tuple[list[Any], list[Any]]:
    """Gemm layers with Relu between them; He-initialised weights from ``seed``."""
    helper = _onnx().helper
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    current = in_name
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        w = (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        b = (rng.standard_normal(fan_out) * 0.01).astype(np.float32)
        inits += [_init(f"w{i}", w), _init(f"b{i}", b)]
        last = i == len(widths) - 2
        gemm_out = out_name if last else f"h{i}"
        nodes.append(helper.make_node("Gemm", [current, f"w{i}", f"b{i}"], [gemm_out]))
        if not last:
            nodes.append(helper.make_node("Relu", [gemm_out], [f"r{i}"]))
            current = f"r{i}"
    return nodes, inits


def demo(seed: int = 7) -> Any:
    """A small classifier: features [N,16] -> probs [N,4] (softmax) and label [N] (argmax)."""
    onnx = _onnx()
    f32, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    nodes, inits = _mlp([16, 64, 4], "features", "logits", seed)
    nodes += [
        onnx.helper.make_node("Softmax", ["logits"], ["probs"], axis=1),
        onnx.helper.make_node("ArgMax", ["logits"], ["label"], axis=1, keepdims=0),
    ]
    return _model(
        nodes,
        [_value("features", f32, ["batch", 16])],
        [_value("probs", f32, ["batch", 4]), _value("label", i64, ["batch"])],
        inits,
    )


def tiny(seed: int = 1) -> Any:
    """[N,128] -> Gemm 128x64 -> Relu -> [N,64]: Redis, not the model, is the limit."""
    onnx = _onnx()
    f32 = onnx.TensorProto.FLOAT
    nodes, inits = _mlp([128, 64], "x", "h", seed)
    nodes.append(onnx.helper.make_node("Relu", ["h"], ["y"]))
    return _model(nodes, [_value("x", f32, ["N", 128])], [_value("y", f32, ["N", 64])], inits)


def heavy(seed: int = 2) -> Any:
    """[N,512] -> 4 Gemm layers of width 2048 (Relu between) -> [N,1000]."""
    f32 = _onnx().TensorProto.FLOAT
    nodes, inits = _mlp([512, 2048, 2048, 2048, 1000], "x", "y", seed)
    return _model(nodes, [_value("x", f32, ["N", 512])], [_value("y", f32, ["N", 1000])], inits)


def slow(seed: int = 3, depth: int = 24) -> Any:
    """x float32 [N,512] -> ``depth`` Tanh(Gemm) layers sharing one weight: slow, small file."""
    onnx = _onnx()
    helper, f32 = onnx.helper, onnx.TensorProto.FLOAT
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((512, 512)) / np.sqrt(512)).astype(np.float32)
    nodes, current = [], "x"
    for i in range(depth):
        nodes += [
            helper.make_node("Gemm", [current, "w"], [f"g{i}"]),
            helper.make_node("Tanh", [f"g{i}"], [f"t{i}"]),
        ]
        current = f"t{i}"
    nodes.append(helper.make_node("Identity", [current], ["y"]))
    return _model(
        nodes, [_value("x", f32, ["N", 512])], [_value("y", f32, ["N", 512])], [_init("w", w)]
    )


def multi_io(seed: int = 0) -> Any:
    """a float32 [N,3], b int64 [N,2] -> twice float32 [N,3] (a*2), total int64 [N] (sum of b)."""
    onnx = _onnx()
    helper, f32, i64 = onnx.helper, onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    nodes = [
        helper.make_node("Mul", ["a", "two"], ["twice"]),
        helper.make_node("ReduceSum", ["b", "axes"], ["total"], keepdims=0),
    ]
    inits = [_init("two", np.array(2.0, np.float32)), _init("axes", np.array([1], np.int64))]
    return _model(
        nodes,
        [_value("a", f32, ["N", 3]), _value("b", i64, ["N", 2])],
        [_value("twice", f32, ["N", 3]), _value("total", i64, ["N"])],
        inits,
    )


def gather(seed: int = 0) -> Any:
    """idx int64 [N,1] -> rows of a 10x4 table [N,1,4]; an index >= 10 fails in the runtime."""
    onnx = _onnx()
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    node = onnx.helper.make_node("Gather", ["table", "idx"], ["rows"], axis=0)
    return _model(
        [node],
        [_value("idx", onnx.TensorProto.INT64, ["N", 1])],
        [_value("rows", onnx.TensorProto.FLOAT, ["N", 1, 4])],
        [_init("table", table)],
    )


def free_dim(seed: int = 0) -> Any:
    """x float32 [N,S] -> doubled [N,S] and total [N]: a free non-batch dimension."""
    onnx = _onnx()
    helper, f32 = onnx.helper, onnx.TensorProto.FLOAT
    nodes = [
        helper.make_node("Add", ["x", "x"], ["doubled"]),
        helper.make_node("ReduceSum", ["x", "axes"], ["total"], keepdims=0),
    ]
    return _model(
        nodes,
        [_value("x", f32, ["N", "S"])],
        [_value("doubled", f32, ["N", "S"]), _value("total", f32, ["N"])],
        [_init("axes", np.array([1], np.int64))],
    )


def fixed_batch(seed: int = 0) -> Any:
    """x float32 [4,3] -> Relu -> [4,3]: a model exported with a fixed batch of 4."""
    onnx = _onnx()
    f32 = onnx.TensorProto.FLOAT
    node = onnx.helper.make_node("Relu", ["x"], ["y"])
    return _model([node], [_value("x", f32, [4, 3])], [_value("y", f32, [4, 3])], [])


def no_batch_output(seed: int = 0) -> Any:
    """x float32 [N,3] -> column sums [3]: an output without a batch axis (cannot be split)."""
    onnx = _onnx()
    f32 = onnx.TensorProto.FLOAT
    node = onnx.helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)
    return _model(
        [node],
        [_value("x", f32, ["N", 3])],
        [_value("y", f32, [3])],
        [_init("axes", np.array([0], np.int64))],
    )


BUILDERS: dict[str, Callable[..., Any]] = {
    "demo": demo,
    "tiny": tiny,
    "heavy": heavy,
    "slow": slow,
    "multi_io": multi_io,
    "gather": gather,
    "free_dim": free_dim,
    "fixed_batch": fixed_batch,
    "no_batch_output": no_batch_output,
}


def save(name: str, path: str | Path) -> Path:
    """Build model ``name`` and write it to ``path`` (parents created); returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(BUILDERS[name]().SerializeToString())
    return target
