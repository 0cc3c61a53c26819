"""A pipeline's preprocessing alone, on N threads: the ceiling a pipeline worker is set against.

The bench runs this module as a process, ``python -m tools.bench.hooks``, as it runs
``tools.benchkit``: it imports the worker's handler loader and the handler (Pillow, a
tokenizer), which the bench's own process never does. It loads
the handler exactly as a worker does (``worker.pipeline.handler.load_handler``: next to
``--source-dir``
first, with ``--options``), takes one request's raw inputs (the handler's ``warmup_inputs()``,
or rows drawn for its declared inputs), writes that request encoded for the wire
(``--body-out``: the load the bench then sends), and calls ``preprocess`` on it from
``--threads`` threads for ``--duration-s``, after ``--warmup-s``. It prints one JSON object:
requests and rows per second, each call's wall time, and CPU per request.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from producer.client import submission
from tools.bench.load import percentiles
from tools.bench.wire import input_rows
from worker.config import PipelineConfig
from worker.pipeline.handler import Handler, load_handler

__all__ = ["main", "measure_preprocess"]

_MAX_CALLS = 1_000_000  # per thread: a bound on the loop, whatever the duration


def raw_request(handler: Handler) -> dict[str, np.ndarray]:
    """One request's raw inputs: the handler's warmup request, or one row drawn for each of
    its declared (numeric) inputs."""
    made = handler.warmup_inputs()
    if made is not None:
        return {name: np.asarray(value) for name, value in made.items()}
    return input_rows(handler.record()["inputs"], 1, seed=0)


def _call(handler: Handler, raw: dict[str, np.ndarray]) -> None:
    if handler.preprocess is not None:
        handler.preprocess(raw)
    else:
        assert handler.preprocess_batch is not None
        handler.preprocess_batch([raw])


def measure_preprocess(
    handler: Handler, raw: dict[str, np.ndarray], threads: int, duration_s: float, warmup_s: float
) -> dict[str, Any]:
    """``preprocess(raw)`` called back to back from ``threads`` threads: how many per second."""
    start = time.monotonic() + 0.05
    window = (start + warmup_s, start + warmup_s + duration_s)
    calls_ms: list[list[float]] = [[] for _ in range(threads)]
    failures: list[BaseException] = []

    def loop(mine: list[float]) -> None:
        time.sleep(max(start - time.monotonic(), 0.0))
        try:
            for _ in range(_MAX_CALLS):
                began = time.monotonic()
                if began >= window[1]:
                    return
                _call(handler, raw)
                if began >= window[0]:
                    mine.append((time.monotonic() - began) * 1000.0)
        except BaseException as exc:  # reported in the JSON's place, as one line
            failures.append(exc)

    pool = [threading.Thread(target=loop, args=(mine,), daemon=True) for mine in calls_ms]
    for thread in pool:
        thread.start()
    time.sleep(max(window[0] - time.monotonic(), 0.0))
    cpu0, t0 = time.process_time(), time.monotonic()
    for thread in pool:
        thread.join()
    cpu_s, wall_s = time.process_time() - cpu0, time.monotonic() - t0
    if failures:
        raise SystemExit(f"preprocess failed: {type(failures[0]).__name__}: {failures[0]}")
    every = [ms for mine in calls_ms for ms in mine]
    rows = next((int(a.shape[0]) for a in raw.values() if a.ndim), 1)
    seconds = max(duration_s, 1e-9)
    return {
        "handler": handler.config.handler,
        "threads": threads,
        "rows_per_request": rows,
        "requests": len(every),
        "requests_per_s": len(every) / seconds,
        "rows_per_s": rows * len(every) / seconds,
        "call_ms": percentiles(every),
        "cpu_ms_per_request": 1000.0 * cpu_s / len(every) if every else 0.0,
        "cpu_cores": cpu_s / max(wall_s, 1e-9),
        "duration_s": duration_s,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.hooks",
        description="Call a pipeline handler's preprocess on N threads; print one JSON object.",
    )
    add = parser.add_argument
    add("--handler", required=True, help="module:attribute, as [pipeline] handler")
    add("--source-dir", type=Path, required=True, help="where the module is looked up first")
    add("--options", default="{}", help="[pipeline.options] as a JSON object")
    add("--threads", type=int, default=1)
    add("--duration-s", type=float, default=3.0)
    add("--warmup-s", type=float, default=0.5)
    add("--body-out", type=Path, help="write one request, encoded for the wire, here")
    add("--body-only", action="store_true", help="write --body-out, measure nothing")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = PipelineConfig(args.handler, max(args.threads, 1), options=json.loads(args.options))
    handler = load_handler(config, args.source_dir.resolve())
    raw = raw_request(handler)
    if args.body_out:
        args.body_out.write_bytes(submission.build_submission(raw, now_s=0.0).body)
    if args.body_only:
        print(json.dumps({"handler": config.handler, "body_out": str(args.body_out)}))
        return 0
    result = measure_preprocess(handler, raw, config.threads, args.duration_s, args.warmup_s)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
