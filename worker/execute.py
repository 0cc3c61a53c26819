"""Running a sub-batch on the model, isolating failures to the requests that cause them.

When a run fails, the batch is split in halves and each half is run again, down to single
requests: only the requests that fail on their own get INFERENCE_FAILED, with the runtime's
message, and every other request gets its result. A batch of 32 with one bad request costs about
2 * log2(32) extra runs, and nothing when all is well.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from worker.errors import Rejected
from worker.intake import WorkItem
from worker.model import Model

__all__ = ["Outcome", "run_isolated"]


@dataclass(slots=True)
class Outcome:
    """The result of one request: its output rows, or the error it alone caused."""

    item: WorkItem
    outputs: dict[str, np.ndarray] | None
    error: Rejected | None
    batch_rows: int
    inference_ms: float


class _RunFailed(Exception):
    """Raised when a run raised, or returned outputs whose rows do not match the batch."""


def run_isolated(
    model: Model,
    items: Sequence[WorkItem],
    output_names: list[str],
    fixed_batch: int | None = None,
    on_run: Callable[[int, float], None] | None = None,
) -> list[Outcome]:
    """Run ``items`` (equal non-batch shapes) as one batch, bisecting on failure.

    ``on_run(rows, seconds)`` is called for every successful model run, for metrics.
    """
    started = time.perf_counter()
    rows = sum(item.rows for item in items)
    try:
        outputs = _run(model, items, rows, output_names, fixed_batch)
    except _RunFailed as exc:
        if len(items) == 1:
            elapsed = (time.perf_counter() - started) * 1000.0
            error = Rejected("INFERENCE_FAILED", str(exc))
            return [Outcome(items[0], None, error, rows, elapsed)]
        mid = len(items) // 2
        return [
            *run_isolated(model, items[:mid], output_names, fixed_batch, on_run),
            *run_isolated(model, items[mid:], output_names, fixed_batch, on_run),
        ]
    elapsed = (time.perf_counter() - started) * 1000.0
    if on_run is not None:
        on_run(rows, elapsed / 1000.0)
    return _split(items, outputs, output_names, rows, elapsed)


def _run(
    model: Model,
    items: Sequence[WorkItem],
    rows: int,
    output_names: list[str],
    fixed_batch: int | None,
) -> list[np.ndarray]:
    feeds = _assemble(items, fixed_batch)
    try:
        outputs = model.run(feeds, output_names)
    except Exception as exc:  # the runtime raises untyped errors; their text is the message
        raise _RunFailed(f"the model failed on this request: {exc}") from exc
    expected = fixed_batch or rows
    for name, out in zip(output_names, outputs, strict=True):
        got = out.shape[0] if out.ndim else None
        if got != expected:
            raise _RunFailed(
                f"model output {name!r} has {got} rows for a batch of {expected}; outputs must "
                "keep the batch axis first."
            )
    return [out[:rows] for out in outputs]


def _assemble(items: Sequence[WorkItem], fixed_batch: int | None) -> dict[str, np.ndarray]:
    """Concatenate the items' inputs (one copy), padding to a fixed batch by repeating row 0."""
    first = items[0].request
    assert first is not None
    feeds = {}
    for name in first.inputs:
        parts = [item.request.inputs[name] for item in items if item.request is not None]
        rows = sum(p.shape[0] for p in parts)
        if fixed_batch and rows < fixed_batch:
            parts.append(np.repeat(parts[0][:1], fixed_batch - rows, axis=0))
        feeds[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return feeds


def _split(
    items: Sequence[WorkItem],
    outputs: list[np.ndarray],
    output_names: list[str],
    rows: int,
    elapsed_ms: float,
) -> list[Outcome]:
    results = []
    start = 0
    for item in items:
        stop = start + item.rows
        wanted = item.request.outputs if item.request is not None else ()
        mine = {
            name: out[start:stop]
            for name, out in zip(output_names, outputs, strict=True)
            if name in wanted
        }
        results.append(Outcome(item, mine, None, rows, elapsed_ms))
        start = stop
    return results
