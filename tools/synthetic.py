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

from worker.errors import ModelError

__all__ = ["BUILDERS", "save"]

_OPSET = 17


def _onnx() -> Any:
    try:
        import onnx
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ModelError(
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


class _Net:
    """A graph being built: nodes and initialisers, weights He-initialised from one seed."""

    _BN_EPS = 1e-5

    def __init__(self, seed: int) -> None:
        self.helper = _onnx().helper
        self.rng = np.random.default_rng(seed)
        self.nodes: list[Any] = []
        self.inits: list[Any] = []

    def node(self, op: str, inputs: list[str], out: str, **attrs: Any) -> str:
        self.nodes.append(self.helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def he(self, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
        std = np.float32(np.sqrt(2.0 / fan_in))
        return self.rng.standard_normal(shape, dtype=np.float32) * std

    def conv(
        self, name: str, src: str, cin: int, cout: int, k: int, stride: int, relu: bool = True
    ) -> str:
        """Conv k x k (padding k // 2) with its BatchNorm folded in, then Relu if ``relu``.

        The BatchNorm is at its initial statistics (mean 0, variance 1, scale 1, shift 0), as
        in a freshly built network in eval mode; folded, it scales the weights by
        1/sqrt(1 + eps) and leaves a zero bias.
        """
        w = self.he((cout, cin, k, k), cin * k * k) / np.float32(np.sqrt(1.0 + self._BN_EPS))
        self.inits += [_init(f"{name}.w", w), _init(f"{name}.b", np.zeros(cout, np.float32))]
        out = self.node(
            "Conv",
            [src, f"{name}.w", f"{name}.b"],
            name,
            kernel_shape=[k, k],
            strides=[stride, stride],
            pads=[k // 2] * 4,
        )
        return self.node("Relu", [out], f"{name}.relu") if relu else out

    def basic_block(self, name: str, src: str, cin: int, cout: int, stride: int) -> str:
        """Two 3x3 convs and the shortcut: the input itself, or a 1x1 stride-``stride``
        projection where the block changes the shape."""
        h = self.conv(f"{name}.conv1", src, cin, cout, 3, stride)
        h = self.conv(f"{name}.conv2", h, cout, cout, 3, 1, relu=False)
        shortcut = src
        if stride != 1 or cin != cout:
            shortcut = self.conv(f"{name}.down", src, cin, cout, 1, stride, relu=False)
        return self.node("Relu", [self.node("Add", [h, shortcut], f"{name}.add")], f"{name}.out")


def resnet18(seed: int = 18) -> Any:
    """ResNet-18 (He et al. 2015) with random weights: image float32 [N,3,224,224] -> logits
    float32 [N,1000].

    Conv 7x7/2 (64), max pool 3x3/2, four stages of two basic blocks (64, 128, 256, 512
    channels; stages 2 to 4 start with stride 2 and a 1x1 projection shortcut), global average
    pool, FC 1000: 11.7 million parameters, 1.8 GFLOPs a row. BatchNorm is folded into the convs.
    """
    f32 = _onnx().TensorProto.FLOAT
    net = _Net(seed)
    h = net.conv("stem", "image", 3, 64, 7, 2)
    h = net.node("MaxPool", [h], "stem.pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4)
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            stride = 2 if stage > 1 and block == 0 else 1
            h = net.basic_block(f"layer{stage}.{block}", h, cin, cout, stride)
            cin = cout
    h = net.node("Flatten", [net.node("GlobalAveragePool", [h], "pool")], "flat", axis=1)
    net.inits += [
        _init("fc.w", net.he((512, 1000), 512)),
        _init("fc.b", np.zeros(1000, np.float32)),
    ]
    net.node("Gemm", [h, "fc.w", "fc.b"], "logits")
    return _model(
        net.nodes,
        [_value("image", f32, ["N", 3, 224, 224])],
        [_value("logits", f32, ["N", 1000])],
        net.inits,
    )


BUILDERS: dict[str, Callable[..., Any]] = {
    "demo": demo,
    "tiny": tiny,
    "heavy": heavy,
    "resnet18": resnet18,
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
