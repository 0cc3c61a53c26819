"""I/O binding and CUDA-graph buckets, run through real onnxruntime sessions on the CPU.

The runner is device-generic, so its buffer handling, padding to buckets and slicing back are
tested here with host buffers; on a GPU, scripts/gpu_check.sh runs the same code with CUDA.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import redis
from harness import direct_run, running_worker, send, wait_reply, write_config
from onnx import TensorProto, helper

from worker.config import ProviderConfig, load_config
from worker.errors import ConfigError, ModelError
from worker.model import gpu
from worker.model.binding import BoundRunner, buckets_for, check_graph_shapes
from worker.model.schema import Schema
from worker.model.session import TensorSpec, _provider_options
from worker.service import Prepared, prepare
from worker.warmup import warm_up

_CUDA = "CUDAExecutionProvider"
_REAL_SESSION = ort.InferenceSession
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


def _runner(out_dims: list[int | str], graphs: bool = False) -> BoundRunner:
    f32 = np.dtype("float32")
    inputs = (TensorSpec("x", f32, ("N", WIDTH)),)
    outputs = (TensorSpec("y", f32, tuple(out_dims)), TensorSpec("z", f32, tuple(out_dims)))
    session = _session(out_dims)
    return BoundRunner(ort, session, inputs, outputs, buckets_for(32), graphs=graphs, device="cpu")


def _x(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, WIDTH)).astype(np.float32)


@pytest.mark.parametrize(
    ("out_dims", "graphs"),
    [
        (["N", OUT], False),  # io_binding: preallocated outputs per bucket
        (["N", "M"], False),  # outputs of unknown shape: onnxruntime allocates them
        (["N", OUT], True),  # cuda_graph: the same buckets, each with a graph id
    ],
)
def test_bound_runs_match_session_run(out_dims: list[int | str], graphs: bool) -> None:
    runner = _runner(out_dims, graphs)
    kept = []
    for seed, rows in enumerate([1, 3, 32, 3, 17, 1, 5, 32]):
        x = _x(rows, seed)
        kept.append((x, runner.run({"x": x}, ["z", "y"])))
    for x, (z, y) in kept:  # checked after every run: no result was overwritten by a later one
        assert y.shape == (x.shape[0], OUT)
        np.testing.assert_allclose(y, x @ WEIGHTS, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(z, np.maximum(x @ WEIGHTS, 0), rtol=1e-5, atol=1e-5)
    assert {key[0] for key in runner._slots} == {1, 4, 8, 32}  # padded up to buckets


def test_only_the_outputs_asked_for_come_back() -> None:
    (y,) = _runner(["N", OUT]).run({"x": _x(2, 0)}, ["y"])
    np.testing.assert_allclose(y, _x(2, 0) @ WEIGHTS, rtol=1e-5, atol=1e-5)


def test_buckets_are_powers_of_two_and_the_maximum() -> None:
    assert buckets_for(32) == (1, 2, 4, 8, 16, 32)
    assert buckets_for(24) == (1, 2, 4, 8, 16, 24)
    assert buckets_for(1) == (1,)
    runner = _runner(["N", OUT])
    assert [runner.padded_rows(n) for n in (1, 2, 3, 5, 9, 17, 32)] == [1, 2, 4, 8, 16, 32, 32]


def test_graphs_refuse_free_non_batch_dimensions() -> None:
    f32 = np.dtype("float32")
    fixed = (TensorSpec("x", f32, ("N", 8)),)
    check_graph_shapes(fixed, fixed)
    free = (TensorSpec("y", f32, ("N", "M")),)
    with pytest.raises(ModelError, match=r"output 'y' has shape \[-1, -1\]"):
        check_graph_shapes(fixed, free)
    with pytest.raises(ModelError, match="cuda_graph = true needs every dimension"):
        _runner(["N", "M"], graphs=True)


def test_a_batch_over_the_largest_bucket_is_an_error() -> None:
    with pytest.raises(ValueError, match="exceeds the largest bucket 32"):
        _runner(["N", OUT]).run({"x": _x(33, 0)}, ["y"])


def test_an_input_that_does_not_fit_its_buffer_is_refused() -> None:
    """update_inplace copies raw bytes: float64 into a float32 buffer would be garbage."""
    with pytest.raises(ValueError, match=r"input 'x' is float64 \[2, 8\] but its bound buffer"):
        _runner(["N", OUT]).run({"x": _x(2, 0).astype(np.float64)}, ["y"])


def test_without_graphs_only_a_few_buffer_sets_are_kept() -> None:
    f32 = np.dtype("float32")
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "W"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    spec = (TensorSpec("x", f32, ("N", "W")),)
    out = (TensorSpec("y", f32, ("N", "W")),)
    runner = BoundRunner(ort, session, spec, out, buckets_for(8), device="cpu")
    for width in range(1, 41):  # forty request shapes, as a free dimension allows
        x = np.full((3, width), -1.0, np.float32)
        (y,) = runner.run({"x": x}, ["y"])
        assert y.shape == (3, width)
    assert len(runner._slots) == 16


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


@pytest.mark.parametrize(("has_gpu", "level"), [(True, logging.WARNING), (False, logging.INFO)])
def test_without_cuda_a_worker_serves_unbound_with_one_line(
    tmp_path: Path,
    redis_url: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    has_gpu: bool,
    level: int,
) -> None:
    """A warning where a GPU exists; without one, CUDA not running is expected: information."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    monkeypatch.setattr(gpu, "present", lambda: has_gpu)
    config = _cuda_config(tmp_path, redis_url, "cuda_graph = true")
    with caplog.at_level(logging.INFO):
        prepared = prepare(load_config(config, environ={}), "w")
    assert prepared.record["runtime"]["binding"] == "off"
    assert prepared.record["runtime"]["batch_buckets"] == []
    assert [(r.levelno, r.getMessage()) for r in caplog.records if "cuda_graph" in r.msg] == [
        (level, "io_binding and cuda_graph need the CUDA provider; running without them")
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


def _bind_on_host(prepared: Prepared, graphs: bool = False) -> None:
    """Bind the prepared model as a CUDA worker would, with host buffers (no GPU here)."""
    model = prepared.model
    model.providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]  # as if CUDA started
    cuda = ProviderConfig("cuda", io_binding=True, cuda_graph=graphs)
    model._bind((cuda,), prepared.config.batching.max_batch_size, device="cpu")


def test_a_worker_serves_bound_runs_padded_to_buckets(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    """Five requests queued before the worker starts run as one batch of 5, padded to 8 rows
    in the bound buffers; each reply is still exactly its own row's result."""
    config = write_config(tmp_path, "tiny", redis_url)
    model_path = tmp_path / "tiny.onnx"
    rng = np.random.default_rng(3)
    rows = {f"bound-{i}": rng.standard_normal((1, 128)).astype(np.float32) for i in range(5)}
    for rid, x in rows.items():
        send(rconn, "tiny", rid, {"x": x})
    fed: list[int] = []  # rows of every batch handed to the runner

    def bind_and_watch(prepared: Prepared) -> None:
        _bind_on_host(prepared)
        runner = prepared.model._runner
        run = runner.run
        runner.run = lambda feeds, names: fed.append(len(feeds["x"])) or run(feeds, names)

    with running_worker(config, adjust=bind_and_watch) as worker:
        replies = {rid: wait_reply(rconn, rid) for rid in rows}
        assert worker.model.binding == "io_binding"
    assert fed == [8]  # assembled already padded to the bucket: one copy, in the worker's buffer
    for rid, x in rows.items():
        assert replies[rid].ok, replies[rid].error
        assert replies[rid].batch_rows == 5
        expected = direct_run(model_path, {"x": x})["y"]
        np.testing.assert_allclose(replies[rid].outputs["y"], expected, rtol=1e-5, atol=1e-6)


def test_a_fixed_batch_model_binds_its_one_batch_size(tmp_path: Path, redis_url: str) -> None:
    path = write_config(tmp_path, "fixed_batch", redis_url, batching="max_batch_size = 4")
    config = load_config(path, environ={})
    prepared = prepare(config, "w")
    _bind_on_host(prepared, graphs=True)
    assert prepared.model.buckets == (prepared.schema.fixed_batch,)
    assert prepared.model.padded_rows(1) == prepared.schema.fixed_batch


class _GraphRefusingSession:
    """onnxruntime as it behaves on a GPU machine with a model that cannot be one CUDA graph:
    asked for graphs, it quietly falls back to the CPU; without them, CUDA starts."""

    def __init__(self, path: str, sess_options: Any = None, providers: Any = ()) -> None:
        self._real = _REAL_SESSION(path, sess_options, providers=["CPUExecutionProvider"])
        options = {p[0]: p[1] for p in providers if isinstance(p, tuple)}
        cuda_listed = any(p == _CUDA or (isinstance(p, tuple) and p[0] == _CUDA) for p in providers)
        graphs = options.get(_CUDA, {}).get("enable_cuda_graph") == "1"
        self._providers = (
            [_CUDA, "CPUExecutionProvider"]
            if cuda_listed and not graphs
            else ["CPUExecutionProvider"]
        )

    def get_providers(self) -> list[str]:
        return self._providers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def test_a_model_that_cannot_be_a_cuda_graph_is_refused_by_name(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ort, "get_available_providers", lambda: [_CUDA, "CPUExecutionProvider"])
    monkeypatch.setattr(ort, "InferenceSession", _GraphRefusingSession)
    config = load_config(_cuda_config(tmp_path, redis_url, "cuda_graph = true"), environ={})
    with pytest.raises(ModelError, match="cannot run this model as one CUDA graph"):
        prepare(config, "w")
