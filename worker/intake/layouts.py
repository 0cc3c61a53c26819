"""Admitting a body laid out byte for byte like one admitted before, without decoding it.

Steady traffic repeats itself: a producer sends a model the same inputs, of the same dtypes and
shapes, with the same options, so its bodies differ only in their tensor data. Once a body has
been decoded and validated, its layout is kept: every byte but the data payloads. A later body
of the same length whose other bytes are equal has the same keys, dtypes, shapes and options as
the first, so it passes the same checks, and its arrays are views of its own data. Decoding and
validating was a large share of the worker's time per small request (docs/design.md); matching a
layout is a few byte comparisons. Anything that does not match takes the full path, which stays
the reference.

A deadline changes from request to request too: when it is packed as a 32- or 64-bit integer
(as clients pack epoch milliseconds), its value bytes are read like the data, and a signed one
that is negative goes to the full path, which refuses it. Bodies with meta (whose bytes change
in length), bool inputs (their data bytes are checked one by one) or empty ones are not kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from producer.protocol.codec import RequestBody
from worker.intake.spans import body_spans
from worker.model.schema import Signature, ValidRequest

__all__ = ["Known", "Layouts"]

_PER_LENGTH = 4  # layouts kept per body length (producers that order keys differently)
_MAX_FIXED_BYTES = 4096  # a layout keeps its bytes but the data: only small ones are kept


class Known(NamedTuple):
    """A body admitted by its layout: what decoding and validating it would have given."""

    request: ValidRequest
    reply_ttl_s: int | None
    deadline_ms: int | None


@dataclass(frozen=True, slots=True)
class _Array:
    """Where one input's data lies in a matching body, and the array it makes."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True, slots=True)
class _Layout:
    """A valid body less its data: the bytes around the data, and what the checks concluded."""

    fixed: tuple[tuple[int, bytes], ...]  # (offset, bytes) a matching body holds there
    arrays: tuple[_Array, ...]  # in the schema's input order
    rows: int
    signature: Signature
    outputs: tuple[str, ...]
    reply_ttl_s: int | None
    deadline: tuple[int, int, bool] | None  # (offset, width, signed) of deadline_ms's value

    def matches(self, body: bytes) -> bool:
        # A loop, not all() over a generator: faster, once per request (hot path).
        for offset, part in self.fixed:  # noqa: SIM110
            if not body.startswith(part, offset):
                return False
        return True

    def deadline_ms(self, body: bytes) -> int | None:
        """The body's deadline_ms (None: it has none); -1 when it is negative, which the full
        path refuses."""
        if self.deadline is None:
            return None
        offset, width, signed = self.deadline
        value = int.from_bytes(body[offset : offset + width], "big", signed=signed)
        return value if value >= 0 else -1

    def admit(self, body: bytes) -> ValidRequest:
        # A view of the body's bytes in the input's shape: np.ndarray over the buffer makes it
        # in one call, where frombuffer then reshape takes two.
        inputs = {a.name: np.ndarray(a.shape, a.dtype, body, a.offset) for a in self.arrays}
        return ValidRequest(inputs, self.rows, self.signature, self.outputs)


class Layouts:
    """The layouts of bodies admitted so far, by body length; one reading thread uses it."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._by_length: dict[int, list[_Layout]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def match(self, body: bytes) -> Known | None:
        """What the full path would conclude of ``body``, when it has a known layout."""
        for layout in self._by_length.get(len(body), ()):
            if layout.matches(body):
                deadline_ms = layout.deadline_ms(body)
                if deadline_ms == -1:
                    return None
                return Known(layout.admit(body), layout.reply_ttl_s, deadline_ms)
        return None

    def learn(self, body: bytes, decoded: RequestBody, valid: ValidRequest) -> None:
        """Keep the layout of ``body``, which ``decoded`` and ``valid`` came from."""
        if decoded.meta_raw is not None:
            return
        if valid.fixed or any(a.dtype.kind in "bO" or a.size == 0 for a in valid.inputs.values()):
            return  # bools' bytes are checked; strings are not bin; unbatched values sign runs
        if len(self._by_length.get(len(body), ())) >= _PER_LENGTH:
            return
        layout = _layout(body, decoded, valid)
        if decoded.deadline_ms is not None and layout.deadline is None:
            return  # packed in fewer bytes than its type's width: it is one of the fixed bytes
        if sum(len(part) for _, part in layout.fixed) > _MAX_FIXED_BYTES:
            return
        if self._count >= self.capacity:  # a stream of ever-new shapes: start over
            self._by_length.clear()
            self._count = 0
        self._by_length.setdefault(len(body), []).append(layout)
        self._count += 1


def _layout(body: bytes, decoded: RequestBody, valid: ValidRequest) -> _Layout:
    spans = body_spans(body)
    arrays = tuple(
        _Array(name, a.dtype, a.shape, spans.data[name][0]) for name, a in valid.inputs.items()
    )
    holes = sorted([*spans.data.values(), *([spans.deadline[:2]] if spans.deadline else [])])
    fixed = []
    start = 0
    for offset, length in holes:
        fixed.append((start, body[start:offset]))
        start = offset + length
    fixed.append((start, body[start:]))
    return _Layout(
        tuple(f for f in fixed if f[1]),
        arrays,
        valid.rows,
        valid.signature,
        valid.outputs,
        decoded.reply_ttl_s,
        spans.deadline,
    )
