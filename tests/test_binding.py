"""I/O binding and CUDA-graph buckets, run through real onnxruntime sessions on the CPU.

The runner is device-generic, so its buffer handling, padding to buckets and slicing back are
tested here with host buffers; on a GPU, scripts/gpu_check.sh runs the same code with CUDA.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from harness import write_config
from onnx import TensorProto, helper

from worker.binding import BoundRunner, buckets_for, check_graph_shapes
from worker.config import ProviderConfig, load_config
from worker.errors import ConfigError, ModelError
from worker.model import TensorSpec, _provider_options
from worker.schema import Schema
from worker.service import prepare
from worker.warmup import warm_up

WIDTH, OUT = 8, 4
WEIGHTS = np.random.default_rng(0).standard_normal((WIDTH, OUT)).astype(np.float32)


def _session(out_dims: list[int | str]) -> ort.InferenceSession:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", WIDTH])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, out_dims),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, out_dims),
        ],
        [helper.make_tensor("w", TensorProto.FLOAT, [WIDTH, OUT], WEIGHTS.ravel().tolist())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _runner(out_dims: list[int | str], buckets: tuple[int, ...] | None = None) -> BoundRunner:
    f32 = np.dtype("float32")
    inputs = (TensorSpec("x", f32, ("N", WIDTH)),)
    outputs = (TensorSpec("y", f32, tuple(out_dims)), TensorSpec("z", f32, tuple(out_dims)))
    return BoundRunner(ort, _session(out_dims), inputs, outputs, device="cpu", buckets=buckets)


def _x(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, WIDTH)).astype(np.float32)


@pytest.mark.parametrize(
    ("out_dims", "buckets"),
    [
        (["N", OUT], None),  # io_binding: preallocated outputs, one slot per batch size
        (["N", "M"], None),  # outputs of unknown shape: onnxruntime allocates them
        (["N", OUT], buckets_for(32)),  # cuda_graph's buckets: padded, then sliced back
    ],
)
def test_bound_runs_match_session_run(
    out_dims: list[int | str], buckets: tuple[int, ...] | None
) -> None:
    runner = _runner(out_dims, buckets)
    kept = []
    for seed, rows in enumerate([1, 3, 32, 3, 17, 1, 5, 32]):
        x = _x(rows, seed)
        kept.append((x, runner.run({"x": x}, ["z", "y"])))
    for x, (z, y) in kept:  # checked after every run: no result was overwritten by a later one
        assert y.shape == (x.shape[0], OUT)
        np.testing.assert_allclose(y, x @ WEIGHTS, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(z, np.maximum(x @ WEIGHTS, 0), rtol=1e-5, atol=1e-5)
    sizes = {key[0] for key in runner._slots}
    assert sizes == ({1, 4, 8, 32} if buckets else {1, 3, 5, 17, 32})


def test_buckets_are_powers_of_two_and_the_maximum() -> None:
    assert buckets_for(32) == (1, 2, 4, 8, 16, 32)
    assert buckets_for(24) == (1, 2, 4, 8, 16, 24)
    assert buckets_for(1) == (1,)


def test_graphs_refuse_free_non_batch_dimensions() -> None:
    f32 = np.dtype("float32")
    fixed = (TensorSpec("x", f32, ("N", 8)),)
    check_graph_shapes(fixed, fixed)
    free = (TensorSpec("y", f32, ("N", "M")),)
    with pytest.raises(ModelError, match=r"output 'y' has shape \[-1, -1\]"):
        check_graph_shapes(fixed, free)
    with pytest.raises(ModelError, match="cuda_graph = true needs every dimension"):
        _runner(["N", "M"], buckets_for(8))


def test_a_batch_over_the_largest_bucket_is_an_error() -> None:
    runner = _runner(["N", OUT], (1, 2, 4))
    with pytest.raises(ValueError, match="exceeds the largest graph size 4"):
        runner.run({"x": _x(5, 0)}, ["y"])


def _cuda_config(tmp_path: Path, redis_url: str, options: str) -> Path:
    config = write_config(tmp_path, "demo", redis_url)
    text = config.read_text().replace(
        'providers = ["cpu"]', f'providers = ["cuda", "cpu"]\n[model.cuda]\n{options}'
    )
    config.write_text(text)
    return config


def test_cuda_graph_config_implies_io_binding_and_sets_the_provider_option(
    tmp_path: Path, redis_url: str
) -> None:
    cfg = load_config(_cuda_config(tmp_path, redis_url, "cuda_graph = true"), environ={})
    cuda = cfg.model.providers[0]
    assert (cuda.io_binding, cuda.cuda_graph) == (True, True)
    assert _provider_options(cuda)["enable_cuda_graph"] == "1"
    plain = ProviderConfig("cuda", io_binding=True)
    assert "enable_cuda_graph" not in _provider_options(plain)


def test_binding_keys_must_be_booleans(tmp_path: Path, redis_url: str) -> None:
    with pytest.raises(ConfigError, match="io_binding"):
        load_config(_cuda_config(tmp_path, redis_url, 'io_binding = "yes"'), environ={})


def test_without_cuda_a_worker_serves_unbound_with_one_warning(
    tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = _cuda_config(tmp_path, redis_url, "cuda_graph = true")
    with caplog.at_level(logging.WARNING):
        prepared = prepare(load_config(config, environ={}), "w")
    assert prepared.record["runtime"]["binding"] == "off"
    assert prepared.record["runtime"]["graph_batch_sizes"] == []
    assert [r.getMessage() for r in caplog.records if "cuda_graph" in r.getMessage()] == [
        "io_binding and cuda_graph need the CUDA provider; running without them"
    ]


class CountingModel:
    def __init__(self) -> None:
        self.rows: list[int] = []

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        self.rows.append(next(iter(feeds.values())).shape[0])
        return []


def test_warmup_runs_every_graph_size_often_enough_to_capture_it(
    tmp_path: Path, redis_url: str
) -> None:
    cfg = load_config(write_config(tmp_path, "demo", redis_url), environ={})
    prepared = prepare(cfg, "w")
    schema = Schema(prepared.model.inputs, prepared.model.outputs, cfg)
    model = CountingModel()
    summary = warm_up(model, schema, runs=1, extra_sizes=(1, 2, 4))  # type: ignore[arg-type]
    assert summary["batch_sizes"] == sorted({1, 2, 4, cfg.batching.max_batch_size})
    for size in summary["batch_sizes"]:
        assert model.rows.count(size) == 3
