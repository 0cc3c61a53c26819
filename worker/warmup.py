"""Warmup: run the model on synthetic in-range inputs before the first read from the stream.

The first runs of a session allocate memory, pick kernels and (on GPUs) build engines; paying
that before reporting ready keeps the first real requests at steady-state latency.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from worker.errors import ModelError
from worker.model import Model
from worker.schema import Schema

__all__ = ["warm_up"]

log = logging.getLogger(__name__)

_GRAPH_RUNS = 3  # runs per bound batch size at least, however few warmup.runs asks for


def warm_up(
    model: Model, schema: Schema, runs: int, extra_sizes: Sequence[int] = ()
) -> dict[str, Any]:
    """Run ``runs`` times at batch 1, at max_batch_size and at ``extra_sizes`` (the bound batch
    sizes: their buffers are made, and their CUDA graphs captured, on their first run); returns
    timings for the record."""
    sizes = sorted({1, schema.max_batch_size, *extra_sizes})
    if extra_sizes:  # a few runs per bucket: the capture, then replays at steady-state speed
        runs = max(runs, _GRAPH_RUNS)
    names = list(schema.output_names)
    timings: dict[int, list[float]] = {size: [] for size in sizes}
    started = time.perf_counter()
    for size in sizes:
        feeds = schema.synthetic_feeds(schema.fixed_batch or size)
        for _ in range(runs):
            t0 = time.perf_counter()
            try:
                model.run(feeds, names)
            except Exception as exc:  # the runtime's errors are untyped
                raise ModelError(
                    f"Warmup failed at batch size {size}: {exc}. Check [inputs.NAME] "
                    "min/max/warmup_shape so synthetic inputs are valid for the model."
                ) from exc
            timings[size].append((time.perf_counter() - t0) * 1000.0)
    total_ms = (time.perf_counter() - started) * 1000.0
    summary: dict[str, Any] = {"runs": runs, "batch_sizes": sizes, "total_ms": round(total_ms, 3)}
    for size, values in timings.items():
        if values:
            summary[f"batch_{size}"] = {
                "first_ms": round(values[0], 3),
                "last_ms": round(values[-1], 3),
                "min_ms": round(min(values), 3),
            }
    log.info("warmup done", extra={"fields": summary})
    return summary
