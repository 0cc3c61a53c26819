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

from worker import faults
from worker.errors import Rejected
from worker.intake import WorkItem
from worker.model import Model
from worker.schema import Schema

__all__ = ["Outcome", "run_batch", "run_isolated"]


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


def run_batch(
    model: Model,
    schema: Schema,
    items: Sequence[WorkItem],
    output_names: list[str],
    on_run: Callable[[int, float], None] | None = None,
) -> list[Outcome]:
    """Screen the values of a sub-batch (equal non-batch shapes), then run it isolated.

    Requests with a bad value are answered INVALID_INPUT and taken out before the run, so they
    never reach the runtime; the batch is assembled once unless one was taken out.
    """
    requests = [item.request for item in items if item.request is not None]
    feeds = _concat(items)
    rejected = schema.screen(feeds, requests)
    if not rejected:
        return run_isolated(model, items, output_names, schema.fixed_batch, on_run, feeds)
    outcomes = [Outcome(items[i], None, error, 0, 0.0) for i, error in rejected.items()]
    rest = [item for i, item in enumerate(items) if i not in rejected]
    if rest:
        outcomes += run_isolated(model, rest, output_names, schema.fixed_batch, on_run)
    return outcomes


def run_isolated(
    model: Model,
    items: Sequence[WorkItem],
    output_names: list[str],
    fixed_batch: int | None = None,
    on_run: Callable[[int, float], None] | None = None,
    feeds: dict[str, np.ndarray] | None = None,
) -> list[Outcome]:
    """Run ``items`` (equal non-batch shapes) as one batch, bisecting on failure.

    ``feeds`` are the items' inputs already concatenated, when the caller has them.
    ``on_run(rows, seconds)`` is called for every successful model run, for metrics.
    """
    started = time.perf_counter()
    rows = sum(item.rows for item in items)
    try:
        outputs = _run(model, feeds or _concat(items), rows, output_names, fixed_batch)
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
    if faults.ACTIVE:
        faults.executed(item.rid or "" for item in items)
    if on_run is not None:
        on_run(rows, elapsed / 1000.0)
    return _split(items, outputs, output_names, rows, elapsed)


def _run(
    model: Model,
    feeds: dict[str, np.ndarray],
    rows: int,
    output_names: list[str],
    fixed_batch: int | None,
) -> list[np.ndarray]:
    if fixed_batch and rows < fixed_batch:
        feeds = {name: _pad(arr, fixed_batch) for name, arr in feeds.items()}
    if faults.ACTIVE:
        faults.crash_if_pill(feeds)
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


def _concat(items: Sequence[WorkItem]) -> dict[str, np.ndarray]:
    """Each input of the items, concatenated in order: the batch's one copy."""
    requests = [item.request for item in items if item.request is not None]
    return {
        name: requests[0].inputs[name]
        if len(requests) == 1
        else np.concatenate([r.inputs[name] for r in requests])
        for name in requests[0].inputs
    }


def _pad(arr: np.ndarray, rows: int) -> np.ndarray:
    """Fill a fixed-batch model's unused rows by repeating the first row (always valid input)."""
    return np.concatenate([arr, np.repeat(arr[:1], rows - arr.shape[0], axis=0)])


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
