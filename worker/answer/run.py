"""Running a sub-batch on the model, isolating failures to the requests that cause them.

A sub-batch (requests of equal non-batch shapes) is assembled once into reused buffers, its
values screened (``Schema.screen``), and run. When a run fails, the batch is split in
halves and each half is run again, down to single requests: only the requests that fail on
their own get INFERENCE_FAILED, with the runtime's message, and every other request gets its
result. A batch of 32 with one bad request costs about 2 * log2(32) extra runs, and nothing
when all is well.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from worker.answer.assemble import FeedBuffers
from worker.errors import ModelUnavailable, Rejected
from worker.events import NO_EVENTS, Events
from worker.items import Admitted, Outcome
from worker.model.axes import Axes
from worker.model.schema import Schema, ValidRequest
from worker.model.session import Model

__all__ = ["run_batch"]


class _RunFailed(Exception):
    """Raised when a run raised, or returned outputs whose rows do not match the batch."""


def run_batch(
    model: Model,
    schema: Schema,
    items: Sequence[Admitted],
    output_names: list[str],
    runs: list[tuple[int, float]] | None = None,
    buffers: FeedBuffers | None = None,
    pad_rows: Callable[[int], int] | None = None,
    events: Events = NO_EVENTS,
) -> list[Outcome]:
    """Screen the values of a sub-batch (equal non-batch shapes), then run it isolated.

    Requests with a bad value are answered INVALID_INPUT and taken out before the run, so they
    never reach the runtime; the batch is assembled once unless one was taken out.
    ``pad_rows(rows)`` is the rows a run of ``rows`` is padded to (bound runs' buckets); a
    fixed-batch model is always padded to its batch size. Each run that succeeded adds its
    (rows, seconds) to ``runs``.
    """
    fixed = schema.fixed_batch
    run = _Runner(
        model,
        output_names,
        (lambda rows: fixed) if fixed else (pad_rows or (lambda rows: rows)),
        runs,
        buffers or FeedBuffers(0),
        events,
        schema.axes,
    )
    feeds = run.assemble(items)
    rejected = schema.screen(feeds, [item.request for item in items])
    if not rejected:
        return run.isolated(items, feeds)
    outcomes = [Outcome(items[i], None, error, 0, 0.0) for i, error in rejected.items()]
    rest = [item for i, item in enumerate(items) if i not in rejected]
    if rest:
        outcomes += run.isolated(rest)
    return outcomes


@dataclass(slots=True)
class _Runner:
    """One sub-batch's runs: the whole, then halves of a failing part, down to single requests."""

    model: Model
    output_names: list[str]
    pad_rows: Callable[[int], int]
    runs: list[tuple[int, float]] | None
    buffers: FeedBuffers
    events: Events
    axes: Axes

    def assemble(self, items: Sequence[Admitted]) -> dict[str, np.ndarray]:
        """The items' inputs in one buffer, padded to the rows the run takes."""
        requests = _requests(items)
        return self.buffers.assemble(requests, self.pad_rows(sum(r.rows for r in requests)))

    def isolated(
        self, items: Sequence[Admitted], feeds: dict[str, np.ndarray] | None = None
    ) -> list[Outcome]:
        """``feeds``: the items' inputs already assembled, when the caller has them."""
        started = time.perf_counter()
        rows = sum(item.rows for item in items)
        try:
            outputs, whole = self._run(
                feeds if feeds is not None else self.assemble(items), rows, items[0]
            )
        except ModelUnavailable as exc:  # not held, and could not be loaded: every item alike
            error = Rejected("INTERNAL", str(exc), retryable=True)
            return [Outcome(item, None, error, item.rows, 0.0) for item in items]
        except _RunFailed as exc:
            if len(items) == 1:
                elapsed = (time.perf_counter() - started) * 1000.0
                error = Rejected("INFERENCE_FAILED", str(exc))
                return [Outcome(items[0], None, error, rows, elapsed)]
            mid = len(items) // 2
            return [*self.isolated(items[:mid]), *self.isolated(items[mid:])]
        elapsed = (time.perf_counter() - started) * 1000.0
        self.events.executed([item for item in items if item.counted])  # a request once
        if self.runs is not None:
            self.runs.append((rows, elapsed / 1000.0))
        if self.axes.trivial:
            return _split(items, outputs, self.output_names, rows, elapsed)
        return _split_axes(items, outputs, whole, self.output_names, rows, elapsed, self.axes)

    def _run(
        self, feeds: dict[str, np.ndarray], rows: int, first: Admitted
    ) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
        """The run's outputs with rows first, and the unbatched ones (``worker.model.axes``)."""
        if not self.axes.trivial:
            feeds = self.axes.to_model(feeds, first.request.fixed or {})
        self.events.run_starts(feeds)
        try:
            outputs = self.model.run(feeds, self.output_names)
        except ModelUnavailable:
            raise
        except Exception as exc:  # the runtime raises untyped errors; their text is the message
            raise _RunFailed(f"the model failed on this request: {exc}") from exc
        whole: dict[str, np.ndarray] = {}
        names = self.output_names
        if not self.axes.trivial:
            outputs, whole = self.axes.outputs_to_rows(names, outputs)
            names = [n for n in names if n not in whole]
        expected = self.pad_rows(rows)
        for name, out in zip(names, outputs, strict=True):
            got = out.shape[0] if out.ndim else None
            if got != expected:
                has = "no axis (a scalar)" if got is None else f"{got} row{'s' if got != 1 else ''}"
                raise _RunFailed(
                    f"model output {name!r} has {has} for a batch of {expected} "
                    f"row{'s' if expected != 1 else ''}; outputs must keep the batch axis first."
                )
        # An output may alias its input (an Identity graph): copy it out of the reused buffer
        # before a bisection's next run overwrites it, and before the replies are encoded.
        return [
            out[:rows].copy() if self.buffers.holds(out) else out[:rows] for out in outputs
        ], whole


def _requests(items: Sequence[Admitted]) -> list[ValidRequest]:
    return [item.request for item in items]


def _split(
    items: Sequence[Admitted],
    outputs: list[np.ndarray],
    output_names: list[str],
    rows: int,
    elapsed_ms: float,
) -> list[Outcome]:
    results = []
    start = 0
    for item in items:
        stop = start + item.rows
        wanted = item.request.outputs
        mine = {
            name: out[start:stop]
            for name, out in zip(output_names, outputs, strict=True)
            if name in wanted
        }
        results.append(Outcome(item, mine, None, rows, elapsed_ms))
        start = stop
    return results


def _split_axes(
    items: Sequence[Admitted],
    outputs: list[np.ndarray],
    whole: dict[str, np.ndarray],
    output_names: list[str],
    rows: int,
    elapsed_ms: float,
    axes: Axes,
) -> list[Outcome]:
    """``_split`` for outputs off axis 0 or without rows: each request's rows back on the
    output's own axis, and the unbatched outputs whole to every request."""
    batched = [n for n in output_names if n not in whole]
    results = _split(items, outputs, batched, rows, elapsed_ms)
    for result in results:
        wanted = result.item.request.outputs
        mine = {
            name: axes.output_for_reply(name, out) for name, out in (result.outputs or {}).items()
        }
        mine.update((name, out) for name, out in whole.items() if name in wanted)
        result.outputs = mine
    return results
