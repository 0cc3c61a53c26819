"""The chaos model, built here with ``onnx.helper``: ``y = tanh(x @ W + b)``, ``[N, 8] -> [N, 4]``,
optionally with a fixed-cost side chain that adds exactly zero."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def build_model(path: Path, *, work_width: int = 0, work_depth: int = 0, seed: int = 11) -> Path:
    """Write ``y = tanh(x @ W + b)``; ``work_depth`` > 0 adds a fixed-cost chain of
    ``work_width``-square MatMul+Tanh layers whose result is multiplied by zero and added, so
    the run is slow but ``y`` is exactly the fast model's."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((8, 4)) * 0.5).astype(np.float32)
    b = (rng.standard_normal(4) * 0.1).astype(np.float32)
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")]
    nodes = [
        helper.make_node("Gemm", ["x", "W", "b"], ["g"]),
        helper.make_node("Tanh", ["g"], ["t"]),
    ]
    if work_depth:
        m = (rng.standard_normal((work_width, work_width)) / np.sqrt(work_width)).astype(np.float32)
        inits += [
            numpy_helper.from_array(m, "M"),
            numpy_helper.from_array(np.array(0, np.float32), "zero"),
        ]
        # The chain depends on x (times zero), so onnxruntime cannot fold it into a constant.
        nodes += [
            helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
            helper.make_node("Mul", ["s", "zero"], ["s0"]),
            helper.make_node("Add", ["M", "s0"], ["h0"]),
        ]
        for i in range(work_depth):
            nodes += [
                helper.make_node("MatMul", [f"h{i}", "M"], [f"m{i}"]),
                helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}"]),
            ]
        nodes += [
            helper.make_node("ReduceSum", [f"h{work_depth}"], ["hs"], keepdims=0),
            helper.make_node("Mul", ["hs", "zero"], ["hz"]),
            helper.make_node("Add", ["t", "hz"], ["y"]),
        ]
    else:
        nodes.append(helper.make_node("Identity", ["t"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "chaos",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    path.write_bytes(model.SerializeToString())
    return path


def slow_depth(batch_ms: float, width: int = 1024) -> int:
    """Side-chain depth for a run of about ``batch_ms`` on this machine (one thread), measured
    here, so "slower than claim_idle_ms" holds on a fast CI machine too."""
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "probe.onnx", work_width=width, work_depth=4)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        feed = {"x": np.zeros((32, 8), np.float32)}
        session.run(None, feed)
        t0 = time.perf_counter()
        for _ in range(3):
            session.run(None, feed)
        per_layer_ms = (time.perf_counter() - t0) * 1000 / 12
    return max(4, min(400, math.ceil(batch_ms / per_layer_ms)))
