"""Batch assembly: the requests' inputs copied once into buffers reused from batch to batch.

The runtime wants one contiguous array per input. Allocating it anew for every batch costs an
allocation, and on large inputs page faults, per batch; these buffers are kept per input and
request shape, sized for the largest batch, and a batch is a view of their first rows. A batch of
one request is not copied at all: its arrays are views of the request's body.

Only a few shapes are kept per input (least recently used first out), so a model with free
non-batch dimensions cannot grow the worker's memory with every new shape it is sent.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from worker.model.schema import ValidRequest

__all__ = ["FeedBuffers"]

_SHAPES_KEPT = 4  # buffers kept per input; a fifth shape evicts the least recently used


class FeedBuffers:
    """Reused input buffers of at least ``capacity_rows`` rows each."""

    def __init__(self, capacity_rows: int, shapes_kept: int = _SHAPES_KEPT) -> None:
        self.capacity_rows = capacity_rows
        self.shapes_kept = shapes_kept
        self._buffers: dict[tuple[str, str, tuple[int, ...]], np.ndarray] = {}

    def assemble(
        self, requests: Sequence[ValidRequest], pad_to: int | None = None
    ) -> dict[str, np.ndarray]:
        """The requests' inputs, concatenated in order; rows up to ``pad_to`` repeat the first
        row, which is always valid input (fixed-batch models, CUDA graphs)."""
        rows = sum(r.rows for r in requests)
        total = max(rows, pad_to or 0)
        if len(requests) == 1 and total == rows:
            return dict(requests[0].inputs)
        feeds = {}
        for name, first in requests[0].inputs.items():
            out = self._buffer(name, first.dtype, first.shape[1:], total)[:total]
            np.concatenate([r.inputs[name] for r in requests], out=out[:rows])
            if total > rows:
                out[rows:] = first[:1]
            feeds[name] = out
        return feeds

    def holds(self, array: np.ndarray) -> bool:
        """True when ``array`` may be a view of a buffer (the next batch overwrites it)."""
        return any(np.may_share_memory(array, buf) for buf in self._buffers.values())

    @property
    def nbytes(self) -> int:
        return sum(buf.nbytes for buf in self._buffers.values())

    def _buffer(self, name: str, dtype: np.dtype, tail: tuple[int, ...], rows: int) -> np.ndarray:
        key = (name, dtype.str, tail)
        buf = self._buffers.pop(key, None)  # re-inserted last: dict order is recency
        if buf is None or buf.shape[0] < rows:
            same_input = [k for k in self._buffers if k[0] == name]
            if len(same_input) >= self.shapes_kept:
                del self._buffers[same_input[0]]
            buf = np.empty((max(rows, self.capacity_rows), *tail), dtype)
        self._buffers[key] = buf
        return buf
