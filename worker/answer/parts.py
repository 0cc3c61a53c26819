"""Parts: a request's rows split across batches, and joined again before it is answered.

A high-class request of one row leaves 31 of a 32-row batch empty, and a batch job's requests of
32 rows cannot fill them: whole, each interactive request would cost the backlog a batch run of
its own (a memory-bound model reads all its weights whatever the rows; measured in
docs/benchmarks.md, "lanes-backlog"). So the batcher splits a request of a lower class than
what the batch already holds when it does not fit: its first rows (the head) fill the batch, and
the rest (the tail) goes back first in its lane for the next batch, where the next request
is split behind it in turn, so the batches stay full. Requests of one class are never split
otherwise, so traffic without classes batches exactly as before.

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
from worker.items import Admitted, Item, Outcome, Part, Whole
from worker.model.schema import Schema

__all__ = ["class_of", "join", "split", "splittable"]


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
    rank = class_rank(item)
    if not any(_part_of(other) or class_rank(other) < rank for other in batch):
        return None
    whole, base = (item.part.whole, item.part.start) if item.part else (Whole(item, {}), 0)
    return _rows(item, 0, room, Part(whole, base)), _rows(
        item, room, item.rows, Part(whole, base + room)
    )


def _part_of(item: Item) -> bool:
    return isinstance(item, Admitted) and item.part is not None


def _rows(item: Admitted, first: int, end: int, part: Part) -> Admitted:
    request = item.request
    inputs = {name: array[first:end] for name, array in request.inputs.items()}
    return dataclasses.replace(
        item, request=dataclasses.replace(request, inputs=inputs, rows=end - first), part=part
    )


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
        whole.outcomes[part.start] = outcome
        whole.rows_done += outcome.item.rows
        if whole.rows_done >= whole.item.rows:
            joined.append(_joined(whole))
    return joined


def _joined(whole: Whole) -> Outcome:
    parts = [whole.outcomes[start] for start in sorted(whole.outcomes)]
    taken = sum(p.inference_ms for p in parts)
    rows = max(p.batch_rows for p in parts)  # the head's batch, which it filled: >= its rows
    error = next((p.error for p in parts if p.error is not None), None)
    if error is not None or any(p.outputs is None for p in parts):
        return Outcome(whole.item, None, error, rows, taken)
    first = parts[0].outputs or {}
    outputs = {name: np.concatenate([p.outputs[name] for p in parts]) for name in first}  # type: ignore[index]
    return Outcome(whole.item, outputs, None, rows, taken)
