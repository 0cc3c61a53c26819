"""What the GPU check needs, tested where there is no GPU: the resnet18 model, ``--providers``
reaching the workers' config and the ceilings, and ``scripts/gpu_check.sh`` refusing to report
CPU figures as GPU ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from producer.jobs.job import UsageError
from tools import bench, benchkit, synthetic
from tools.bench import cli as bench_cli
from tools.bench import phases, runner
from tools.bench.processes import WorkerProcess, WorkerSetup
from tools.bench.wire import Sender, row_bytes
from worker.config import PROVIDERS, load_config

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
IMAGE = [{"name": "image", "dtype": "float32", "shape": [-1, 3, 224, 224]}]


# -- resnet18 ---------------------------------------------------------------------------------


def test_resnet18_is_the_resnet18_architecture() -> None:
    onnx = pytest.importorskip("onnx")
    model = synthetic.BUILDERS["resnet18"]()
    onnx.checker.check_model(model)
    ops = Counter(node.op_type for node in model.graph.node)
    # stem + 8 blocks of two + 3 projection shortcuts; one residual Add per block
    assert ops["Conv"] == 1 + 16 + 3
    assert ops["Add"] == 8
    assert ops["MaxPool"] == ops["GlobalAveragePool"] == ops["Gemm"] == 1
    # torchvision's 11,689,512 less one of BatchNorm's two parameters per channel (4,800
    # channels): scale and shift are folded into each conv's weights and one bias.
    params = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
    assert params == 11_689_512 - 4_800
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {
        v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
        for v in inferred.graph.value_info
    }
    assert shapes["stem.pool"] == ["N", 64, 56, 56]
    assert shapes["layer2.0.out"] == ["N", 128, 28, 28]
    assert shapes["layer4.1.out"] == ["N", 512, 7, 7]


def test_resnet18_runs_one_row_on_the_cpu(tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime")
    path = synthetic.save("resnet18", tmp_path / "resnet18.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, bench.input_rows(IMAGE, 1, 0))
    assert logits.shape == (1, 1000)
    assert logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert logits.std() > 0


def test_image_rows_are_float32_and_few_bodies_are_kept() -> None:
    rows = bench.input_rows(IMAGE, 2, 0)["image"]
    assert rows.shape == (2, 3, 224, 224)
    assert rows.dtype == np.float32
    assert row_bytes(IMAGE) == 3 * 224 * 224 * 4
    # a producer keeps at most 8 MiB of distinct bodies: 13 image rows, 64 tiny ones
    conn = redis.Redis()  # never connects: Sender only builds bodies and a pipeline here
    assert len(Sender(conn, "p", "m", IMAGE, 0).bodies) == (8 << 20) // row_bytes(IMAGE)
    tiny = [{"name": "x", "dtype": "float32", "shape": [-1, 128]}]
    assert len(Sender(conn, "p", "m", tiny, 0).bodies) == 64


# -- --providers ------------------------------------------------------------------------------


def test_bench_knows_the_workers_providers() -> None:
    assert set(bench_cli.PROVIDERS) == set(PROVIDERS)


def _options(*argv: str) -> runner.Options:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return bench_cli._options(parser.parse_args(list(argv)))


def test_providers_option_defaults_to_cpu_and_keeps_the_order() -> None:
    assert _options().providers == ("cpu",)
    assert _options("--model", "resnet18", "--providers", "cuda,cpu").providers == ("cuda", "cpu")


def test_providers_reach_the_generated_worker_config(tmp_path: Path) -> None:
    model_file = synthetic.save("tiny", tmp_path / "tiny.onnx")
    setup = WorkerSetup("tiny", 32, 5.0)
    worker = WorkerProcess(setup, model_file, "redis://127.0.0.1:1/0", tmp_path, ("cuda", "cpu"))
    config = load_config(worker.config, environ={})
    assert [p.name for p in config.model.providers] == ["cuda", "cpu"]
    assert config.model.path == model_file.resolve()
    default = WorkerProcess(setup, model_file, "redis://127.0.0.1:1/0", tmp_path)
    assert [p.name for p in load_config(default.config, environ={}).model.providers] == ["cpu"]


def test_binding_reaches_the_generated_worker_config(tmp_path: Path) -> None:
    model_file = synthetic.save("tiny", tmp_path / "tiny.onnx")
    setup = WorkerSetup("tiny", 32, 5.0)
    url = "redis://127.0.0.1:1/0"
    for binding, expected in (("io_binding", (True, False)), ("cuda_graph", (True, True))):
        worker = WorkerProcess(setup, model_file, url, tmp_path, ("cuda", "cpu"), binding)
        cuda = load_config(worker.config, environ={}).model.providers[0]
        assert (cuda.name, cuda.io_binding, cuda.cuda_graph) == ("cuda", *expected)


def test_binding_needs_cuda_in_the_providers() -> None:
    assert _options().binding == "off"
    assert _options("--providers", "cuda,cpu", "--binding", "cuda_graph").binding == "cuda_graph"
    with pytest.raises(UsageError, match="add cuda to --providers"):
        _options("--binding", "io_binding")


def test_bench_passes_providers_to_workers_and_ceilings(
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given a bench asked for cuda,cpu whose benchkit runs are recorded (and answer as a
    # machine without a GPU would), when it measures its ceilings, then every session-building
    # run gets --providers cuda,cpu, and the fallback to the CPU is said.
    calls: list[tuple[str, ...]] = []

    def fake_benchkit(*args: str, timeout_s: float, redis_url: str | None = None) -> Any:
        calls.append(args)
        batch = {"rows_per_s": 1.0, "run_ms": {"mean": 1.0, "p50": 1.0, "p99": 1.0}}
        return {
            "onnxruntime": "test",
            "providers": ["CPUExecutionProvider"],
            "batch": {"1": batch},
            "throughput_per_s": 1.0,
        }

    monkeypatch.setattr(phases, "benchkit", fake_benchkit)
    options = runner.Options(model="resnet18", providers=("cuda", "cpu"))
    b = runner.Bench(options, redis_url, tmp_path)
    assert b.workers.providers == ("cuda", "cpu")
    b.bare("resnet18", [1], model_file=tmp_path / "resnet18.onnx")
    b.asyncio_batcher("resnet18")
    measured = [c for c in calls if c[0] in ("bare", "asyncio")]
    assert [c[0] for c in measured] == ["bare", "asyncio"]
    for argv in measured:
        assert argv[argv.index("--providers") + 1] == "cuda,cpu"
    assert "bare session.run runs without cuda" in capsys.readouterr().err


def test_benchkit_takes_providers_and_reports_the_fallback(tmp_path: Path) -> None:
    parser = benchkit.build_parser()
    for command in ("bare", "asyncio"):
        args = parser.parse_args([command, "--model-file", "m.onnx", "--providers", "cuda,cpu"])
        assert args.providers == ["cuda", "cpu"]
        assert parser.parse_args([command, "--model-file", "m.onnx"]).providers == ["cpu"]
    with pytest.raises(SystemExit):
        parser.parse_args(["bare", "--model-file", "m.onnx", "--providers", "gpu"])
    # On a machine without a GPU, cuda is asked for and the session runs on the CPU: the
    # result says both, which is what the GPU check reads.
    path = synthetic.save("tiny", tmp_path / "tiny.onnx")
    result = benchkit.measure_bare(path, [1], 0.05, ("cuda", "cpu"))
    assert result["requested_providers"] == ["cuda", "cpu"]
    assert "CPUExecutionProvider" in result["providers"]
    if shutil.which("nvidia-smi") is None:
        assert "CUDAExecutionProvider" not in result["providers"]


# -- scripts/gpu_check.sh ---------------------------------------------------------------------


def _run(
    argv: list[str], env: dict[str, str], timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _path_without(tool: str, shadows: Path) -> str:
    """$PATH with ``tool`` gone: a folder that holds it is replaced by links to the rest."""
    folders = []
    for n, folder in enumerate(os.environ["PATH"].split(os.pathsep)):
        if not folder or not (Path(folder) / tool).exists():
            folders.append(folder)
            continue
        shadow = shadows / f"path{n}"
        shadow.mkdir(parents=True)
        for entry in Path(folder).iterdir():
            if entry.name != tool:
                (shadow / entry.name).symlink_to(entry)
        folders.append(str(shadow))
    return os.pathsep.join(folders)


def test_script_parses() -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_script_fails_at_once_without_nvidia_smi(tmp_path: Path) -> None:
    path = _path_without("nvidia-smi", tmp_path / "shadows")
    assert shutil.which("nvidia-smi", path=path) is None
    env = {**os.environ, "PATH": path, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    done = _run([], env, timeout_s=60)
    said = done.stdout + done.stderr
    assert done.returncode != 0
    assert "gpu_check: FAILED: nvidia-smi is not on PATH" in said
    assert "== preflight" in said
    assert not (tmp_path / "out" / "heavy.json").exists()  # it stopped before any bench
    assert "nvidia-smi is not on PATH" in (tmp_path / "out" / "gpu_check.log").read_text()


def _report(served_with: list[str], binding: str = "off") -> dict[str, Any]:
    return {
        "settings": {"providers": ["cuda", "cpu"], "binding": binding},
        "ceilings": {"bare": {"heavy": {"providers": served_with}}},
        "phases": [
            {"id": "custom/closed-C1", "ok": 10, "worker": {"providers": served_with}},
            {"id": "custom/closed-C64", "ok": 10, "worker": {"providers": served_with}},
        ],
    }


@pytest.mark.parametrize(
    ("served_with", "ok"),
    [
        (["CUDAExecutionProvider", "CPUExecutionProvider"], True),
        (["CPUExecutionProvider"], False),
    ],
)
def test_script_rejects_a_report_that_fell_back_to_the_cpu(
    tmp_path: Path, served_with: list[str], ok: bool
) -> None:
    report = tmp_path / "heavy.json"
    report.write_text(json.dumps(_report(served_with)))
    done = _run(["--python", sys.executable, "--check-report", str(report)], dict(os.environ))
    said = done.stdout + done.stderr
    if ok:
        assert done.returncode == 0, said
        assert "every session ran with CUDAExecutionProvider" in said
    else:
        assert done.returncode == 1
        assert "is not a GPU run" in said
        assert "bare session.run of heavy ran with ['CPUExecutionProvider']" in said
        assert "the worker served 2 of 2 phases with ['CPUExecutionProvider']" in said


def test_script_rejects_a_graphs_report_whose_worker_ran_unbound(tmp_path: Path) -> None:
    report = tmp_path / "heavy-graphs.json"
    report.write_text(json.dumps(_report(["CUDAExecutionProvider"], binding="cuda_graph")))
    done = _run(["--python", sys.executable, "--check-report", str(report)], dict(os.environ))
    assert done.returncode == 1
    said = done.stdout + done.stderr
    assert "phase custom/closed-C1: the worker ran with binding off, not cuda_graph" in said


def _full_report(model: str, binding: str = "off") -> dict[str, Any]:
    """A report with every field the summary step reads, as a GPU run would write it."""
    run = {"rows_per_s": 9000.0, "run_ms": {"p50": 1.5}}
    phases = [
        {
            "load": {"concurrency": c},
            "throughput_per_s": 100.0 * c,
            "latency_ms": {"p50": 2.0, "p99": 4.0},
            "vs_ceiling": {"throughput_over_bare": c / 90},
            "batch_rows": {"mean": min(c, 32)},
            "worker_side": {"stages": {"inference": {"mean_ms": 1.25}}},
            "worker": {"providers": ["CUDAExecutionProvider"], "binding": binding},
            "lost": 0,
            "errors": 0,
        }
        for c in (1, 64)
    ]
    return {
        "machine": {
            "gpus": ["NVIDIA H200"],
            "onnxruntime": "1.31.1",
            "cpus_usable": 16,
            "providers": ["CUDAExecutionProvider"],
        },
        "ceilings": {"bare": {model: {"batch": {"1": run, "32": run}}}, "protocol": {}},
        "phases": phases,
    }


def test_summary_sets_the_graphs_run_against_the_heavy_runs_bare_ceiling(tmp_path: Path) -> None:
    for name, model, binding in (
        ("heavy", "heavy", "off"),
        ("resnet18", "resnet18", "off"),
        ("heavy-graphs", "heavy", "cuda_graph"),
    ):
        (tmp_path / f"{name}.json").write_text(json.dumps(_full_report(model, binding)))
    env = {**os.environ, "out": str(tmp_path), "py": sys.executable}
    done = _run(["--step", "summary"], env)
    assert done.returncode == 0, done.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert "heavy with [model.cuda] cuda_graph = true" in summary
    graphs = summary.split("cuda_graph = true", 1)[1]
    assert "6,400    0.71" in graphs  # 64 callers: 6,400 req/s over heavy's 9,000 rows/s
    assert "binding cuda_graph" in graphs


def test_script_help_names_its_steps() -> None:
    done = _run(["--help"], dict(os.environ))
    assert done.returncode == 0
    for step in ("preflight", "install", "probe", "heavy", "graphs", "resnet18", "summary"):
        assert step in done.stdout
