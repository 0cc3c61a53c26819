"""The pipeline preset: what a worker's pre- and post-processing threads buy, in one run.

Two measurements, each against a reference taken in the same run:

- ``pipeline/cpu-t1`` and ``pipeline/cpu-t2``: a preprocessing-bound pipeline (``burn.py``: the
  tiny model behind a preprocess that hashes a few megabytes outside the GIL, sized here to take
  ``BURN_MS`` on one thread) served with ``pipeline.threads`` 1, then 2. Its throughput should
  nearly double on two free cores (target: 1.5x).
- ``pipeline/image``: the image example (``examples/image``: JPEG bytes in, Pillow decoding,
  the PP-LCNet orientation model), served with its own config's pipeline, batching and limits,
  against the lesser of its preprocessing alone on the same threads (``tools.bench.hooks``) and
  bare ``session.run`` at its max_batch_size: a pipeline should cost little beyond its slowest
  stage (target: 0.8). On a CPU-only machine both stages share the same cores, so the run also
  states the shared-cores bound: the rate at which the cores could do both for every request.

Each pipeline phase carries its stages (``phase["pipeline"]``: hook ms per request, busy
shares, the verdict ``producer.ops.stages`` gives), which the report prints.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from tools import ROOT
from tools.bench.burn import work_bytes_for
from tools.bench.errors import BenchError
from tools.bench.load import CALLERS
from tools.bench.phases import HOOKS, Phases
from tools.bench.processes import WorkerSetup, flags, run_json
from tools.bench.report import say

__all__ = ["BURN_MS", "IMAGE_CONFIG", "image_again", "pipelines", "threads_again"]

#: What one request's preprocessing costs the preprocessing-bound pipeline, on one thread.
BURN_MS = 5.0
#: The image example's worker config: its pipeline, batching and limits are the phase's.
IMAGE_CONFIG = ROOT / "examples" / "image" / "config.toml"
_BURN_HANDLER = "tools.bench.burn:BurnPipeline"


def pipelines(b: Phases) -> None:
    """The preprocessing-bound pipeline at 1 and 2 threads, then the image example."""
    work_bytes = work_bytes_for(BURN_MS)
    say(f"pipeline: {work_bytes / 2**20:.1f} MiB of SHA-256 per request ({BURN_MS:g} ms here)")
    for threads in (1, 2):
        pipeline = {
            "handler": _BURN_HANDLER,
            "threads": threads,
            "options": {"work_bytes": work_bytes, "width": 128},
        }
        setup = WorkerSetup(
            "tiny", 32, b.o.max_wait_ms, name="tiny-burn", extra=toml_tables(pipeline=pipeline)
        )
        b.phase(f"pipeline/cpu-t{threads}", setup, {"mode": "closed", "concurrency": CALLERS})
    _image(b)


def _image(b: Phases) -> None:
    example = _example(IMAGE_CONFIG)
    body_file = b.workdir / "image-request.msgpack"
    name, setup = example["model"], example["setup"]
    alone = bare = None
    if b.o.ceilings:  # each measured just before the phase: this machine's speed drifts
        alone = b.preprocess_alone(name, example["pipeline"], IMAGE_CONFIG.parent, body_file)
        bare = b.bare(name, [setup.max_batch_size], setup.model_path)
    else:
        _write_body(example, body_file)
    load = {"mode": "closed", "concurrency": CALLERS, "bodies": (body_file.read_bytes(),)}
    phase = b.phase("pipeline/image", setup, load)
    if alone is not None and bare is not None and "pipeline" in phase:
        phase["pipeline"]["bounds"] = bounds(
            phase["throughput_per_s"],
            alone,
            bare["batch"][str(setup.max_batch_size)],
            b.report["machine"]["cpus_usable"],
        )


def bounds(
    got_per_s: float, alone: dict[str, Any], bare: dict[str, Any], cores: int
) -> dict[str, float]:
    """The image phase against its stages alone: the lesser of preprocessing alone and bare
    ``session.run`` (each with the machine to itself), and the shared-cores bound, the rate
    at which the cores could both preprocess and run every request (their CPU per request)."""
    rows = alone["rows_per_request"]
    pre = alone["rows_per_s"]
    model = bare["rows_per_s"]
    cpu_ms = alone["cpu_ms_per_request"] / rows + bare.get("cpu_ms_per_row", 0.0)
    shared = 1000.0 * cores / cpu_ms if cpu_ms else 0.0
    lesser = min(pre, model)
    return {
        "preprocess_alone_per_s": pre,
        "bare_per_s": model,
        "lesser_per_s": lesser,
        "over_lesser": got_per_s * rows / lesser if lesser else 0.0,
        "shared_cores_per_s": shared,
        "over_shared_cores": got_per_s * rows / shared if shared else 0.0,
    }


def _example(config_path: Path) -> dict[str, Any]:
    """The example's model, pipeline and the worker setup its config asks for."""
    config = tomllib.loads(config_path.read_text(encoding="utf-8"))
    model_path = (config_path.parent / config["model"]["path"]).resolve()
    if not model_path.is_file():
        raise BenchError(
            f"the image example's model {model_path} is not there yet: run "
            "python scripts/fetch_models.py image"
        )
    batching = config.get("batching", {})
    tables = {k: config[k] for k in ("pipeline", "limits", "warmup") if k in config}
    setup = WorkerSetup(
        config["model"]["name"],
        int(batching.get("max_batch_size", 32)),
        float(batching.get("max_wait_ms", 5.0)),
        model_path=model_path,
        extra=toml_tables(**tables),
        pythonpath=str(config_path.parent),
    )
    return {"model": config["model"]["name"], "pipeline": config["pipeline"], "setup": setup}


def _write_body(example: dict[str, Any], body_file: Path) -> None:
    """Without ceilings: only the request the image phase sends (``tools.bench.hooks``)."""
    pipeline = example["pipeline"]
    argv = flags(
        handler=pipeline["handler"],
        source_dir=IMAGE_CONFIG.parent,
        options=json.dumps(pipeline.get("options", {})),
        body_out=body_file,
    )
    run_json(HOOKS, *argv, "--body-only", timeout_s=120)


def threads_again(b: Phases) -> float:
    """``pipeline/cpu-t1`` again, for a round of the threads target."""
    return float(b.rerun("pipeline/cpu-t1", "pipeline/cpu-t1 (again)")["throughput_per_s"])


def image_again(b: Phases) -> float:
    """The lesser of the image example's two ceilings again, for a round of its target."""
    example = _example(IMAGE_CONFIG)
    setup = example["setup"]
    body_file = b.workdir / "image-request.msgpack"
    alone = b.preprocess_alone(
        example["model"], example["pipeline"], IMAGE_CONFIG.parent, body_file, keep=False
    )
    bare = b.bare(example["model"], [setup.max_batch_size], setup.model_path, keep=False)
    return min(
        float(alone["rows_per_s"]), float(bare["batch"][str(setup.max_batch_size)]["rows_per_s"])
    )


def toml_tables(**tables: dict[str, Any]) -> str:
    """Config tables as TOML text: each name's scalars and lists, then its sub-tables
    (``pipeline={"handler": .., "options": {..}}`` gives ``[pipeline]`` and
    ``[pipeline.options]``). JSON's strings, numbers, booleans and lists are TOML's too."""
    out: list[str] = []

    def table(name: str, values: dict[str, Any]) -> None:
        out.append(f"\n[{name}]")
        nested = {k: v for k, v in values.items() if isinstance(v, dict)}
        for key, value in values.items():
            if key not in nested:
                out.append(f"{key} = {json.dumps(value)}")
        for key, value in nested.items():
            table(f"{name}.{key}", value)

    for name, values in tables.items():
        table(name, values)
    return "\n".join(out) + "\n"
