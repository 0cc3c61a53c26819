"""Parts: a request's rows split across batches, and joined again before it is answered.

A high-class request of one row leaves 31 of a 32-row batch empty, and a batch job's requests of
32 rows cannot fill them: whole, each interactive request would cost the backlog a batch run of
its own (a memory-bound model reads all its weights whatever the rows; measured in
docs/benchmarks.md, "lanes-backlog"). So the batcher splits a request of a lower class than
what the batch already holds when it does not fit: its first rows (the head) fill the batch, and
the rest (the tail) goes back first in its lane for the next batch, where the next request
of its class is split behind it in turn, so the batches stay full. A request is split only
behind rows of a higher class, or behind a part of its own class, and only when they share a
run (equal shapes): traffic of one class alone batches exactly as before, and a higher class
is never split behind a lower one. Once one part failed (cancelled, late, invalid, the
runtime's error), the rest is answered with that error without running.

Only a request whose rows are all on axis 0 of every input and output may be split (not with a
pipeline, whose hooks take a request whole, nor with batch axes other than 0), and never a
redelivered one (it runs alone). Its entry stays leased until its last part ran; the reply is
the parts' outputs joined in row order, or the first error a part met (a cancel, a deadline,
the runtime's), written once. A worker that dies between the parts leaves the entry pending, and
the worker that claims it runs it whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from producer.protocol.lanes import CLASSES, DEFAULT_CLASS
from worker.errors import Rejected
from worker.items import Admitted, Item, Outcome, Part, Whole
from worker.model.schema import Schema

__all__ = ["class_of", "failed", "join", "split", "splittable"]


def splittable(pipeline: object | None, schema: Schema) -> bool:
    """Whether a worker's requests may be split: no pipeline, every row on axis 0."""
    return pipeline is None and schema.axes.trivial


def class_of(item: Item) -> str:
    """The priority class of the lane ``item`` was read from (its default lane: normal)."""
    lane = item.entry.lane
    return DEFAULT_CLASS if lane is None else lane.cls


def class_rank(item: Item) -> int:
    """0 for class high, 1 normal, 2 low."""
    return CLASSES.index(class_of(item))


def split(batch: Sequence[Item], item: Item, room: int) -> tuple[Admitted, Admitted] | None:
    """``item``'s first ``room`` rows and the rest, when it may be split to fill ``batch``
    (see the module); None when it may not."""
    if not isinstance(item, Admitted) or item.alone or not 0 < room < item.rows:
        return None
    if not any(_makes_room(other, item) for other in batch):
        return None
    whole, base = (item.part.whole, item.part.start) if item.part else (Whole(item, {}), 0)
    return _rows(item, 0, room, Part(whole, base)), _rows(
        item, room, item.rows, Part(whole, base + room)
    )


def _makes_room(other: Item, item: Admitted) -> bool:
    """Whether ``other`` in a batch lets ``item`` be split behind it: ``other`` is of a higher
    class, or a part of the same class (the chain); and they share a run (equal shapes), or
    the split would buy nothing."""
    if not isinstance(other, Admitted) or other.request.signature != item.request.signature:
        return False
    mine, theirs = class_rank(item), class_rank(other)
    return theirs < mine or (other.part is not None and theirs == mine)


def failed(item: Admitted) -> Rejected | None:
    """The error an earlier part of ``item``'s request met, if any: the rest need not run."""
    if item.part is None:
        return None
    return next((o.error for o in item.part.whole.outcomes.values() if o.error), None)


def _rows(item: Admitted, first: int, end: int, part: Part) -> Admitted:
    request = item.request
    inputs = {name: array[first:end] for name, array in request.inputs.items()}
    sliced = dataclasses.replace(request, inputs=inputs, rows=end - first, first_row=part.start)
    return dataclasses.replace(item, request=sliced, part=part)


def join(outcomes: Iterable[Outcome]) -> list[Outcome]:
    """``outcomes`` with the parts taken out, and each request whose last part is among them
    joined into one outcome of the whole request."""
    joined = []
    for outcome in outcomes:
        part = outcome.item.part
        if part is None:
            joined.append(outcome)
            continue
        whole = part.whole
        if part.start not in whole.outcomes:  # a part answered twice (a failed batch) counts once
            whole.rows_done += outcome.item.rows
        whole.outcomes[part.start] = outcome
        if whole.rows_done >= whole.item.rows:
            joined.append(_joined(whole))
    return joined


def _joined(whole: Whole) -> Outcome:
    parts = [whole.outcomes[start] for start in sorted(whole.outcomes)]
    taken = sum(p.inference_ms for p in parts)
    # the largest run, and at least the request's rows (the reply-size check relies on it)
    rows = max(whole.item.rows, *(p.batch_rows for p in parts))
    whole.outcomes.clear()  # no cycle (whole -> outcome -> part -> whole) outlives the reply
    error = next((p.error for p in parts if p.error is not None), None)
    if error is not None or any(p.outputs is None for p in parts):
        return Outcome(whole.item, None, error, rows, taken)
    first = parts[0].outputs or {}
    outputs = {name: np.concatenate([p.outputs[name] for p in parts]) for name in first}  # type: ignore[index]
    return Outcome(whole.item, outputs, None, rows, taken)
