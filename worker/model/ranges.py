"""Value ranges of inputs, and warmup inputs whose values lie within them.

A configured range (``[inputs.X] min/max``) is seen as numpy compares it: rounded to the
input's dtype and clamped to the dtype's range, so that nothing overflows. Warmup feeds are
drawn within it, laid out as the model takes them (rows on each input's batch axis).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from worker.model.tensorspec import TensorSpec

__all__ = ["Rule", "synthetic", "value_range"]


class Rule(Protocol):
    """What warmup values need of an input's rule (``worker.model.schema.InputRule`` is one)."""

    @property
    def spec(self) -> TensorSpec: ...
    @property
    def min(self) -> float | None: ...
    @property
    def max(self) -> float | None: ...
    @property
    def warmup_shape(self) -> tuple[int, ...] | None: ...
    @property
    def batch_axis(self) -> int | None: ...


def value_range(
    lo: float | None, hi: float | None, dtype: np.dtype[Any]
) -> tuple[float, float] | None:
    """The least and greatest finite ``dtype`` values within [lo, hi] (None: no bound), or None
    when there is none. Bounds past the dtype's range are clamped, so nothing overflows."""
    kind = dtype.kind
    if kind in "iu":
        ii: Any = np.iinfo(dtype)
        first = int(ii.min) if lo is None else max(int(ii.min), math.ceil(lo))
        last = int(ii.max) if hi is None else min(int(ii.max), math.floor(hi))
        return (first, last) if first <= last else None
    if kind != "f":
        return (0.0, 0.0)
    top = float(np.finfo(dtype).max)
    if (lo is not None and lo > top) or (hi is not None and hi < -top):
        return None
    least = -top if lo is None else _representable(lo, dtype)
    most = top if hi is None else _representable(hi, dtype)
    return (least, most) if least <= most else None


def _representable(bound: float, dtype: np.dtype[Any]) -> float:
    """``bound`` as the check sees it: rounded to ``dtype``, as numpy compares a float array
    with a Python float. Clamped to the dtype's range first, so it never overflows."""
    top = float(np.finfo(dtype).max)
    return float(dtype.type(min(max(bound, -top), top)))


def synthetic(rule: Rule, rows: int, rng: np.random.Generator) -> np.ndarray:
    spec = rule.spec
    axis = rule.batch_axis
    others = [d for a, d in enumerate(spec.dims) if a != axis]
    free = rule.warmup_shape or tuple(1 for _ in others)
    tail = [d if isinstance(d, int) else f for d, f in zip(others, free, strict=True)]
    shape = tuple(tail if axis is None else [*tail[:axis], rows, *tail[axis:]])
    kind = spec.dtype.kind
    if kind == "O":  # string inputs: short words
        arr = np.empty(shape, dtype=spec.dtype)
        arr.fill("warmup")
        return arr
    bounds = value_range(rule.min, rule.max, spec.dtype) if kind in "fiu" else None
    if bounds is None:  # not a number (an empty range is refused at start, in the check above)
        return np.zeros(shape, dtype=spec.dtype)
    least, most = bounds
    if kind in "iu":
        if rule.min is not None and rule.max is not None:
            return rng.integers(int(least), int(most), size=shape, dtype=spec.dtype, endpoint=True)
        return np.full(shape, min(max(0, int(least)), int(most)), dtype=spec.dtype)
    # Floats: the whole range when both bounds are set and its width is finite, else a unit
    # interval within it as near 0 as it allows, e.g. [5, 6] for min = 5 alone. Each end is a
    # value of the dtype, and rounding is monotonic, so the cast values stay within the bounds.
    if rule.min is not None and rule.max is not None and math.isfinite(most - least):
        a, b = least, most
    else:
        a = min(max(0.0, least), most)
        b = min(a + 1.0, most)
        if b == a:
            a = max(b - 1.0, least)
    return np.clip(rng.uniform(a, b, size=shape), a, b).astype(spec.dtype)
