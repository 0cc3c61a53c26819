"""The outputs' columns as a sink writes them: names, dtypes and row shapes fixed by the first
rows that succeed (``Columns``), and the rows of a failed request (NaN, 0, or empty text).
Shared by every sink (``producer.jobs.sinks``, ``producer.jobs.jsonlsink``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from producer.protocol import codec
from producer.protocol.codec import ErrorInfo

__all__ = ["Columns", "fill", "wire_of"]


def wire_of(array: np.ndarray) -> str:
    """The wire dtype name of an output array (its NumPy name when the wire has none)."""
    return codec.wire_dtype(array) or str(array.dtype)


def fill(dtype: np.dtype[Any], wire: str, shape: tuple[int, ...]) -> np.ndarray:
    """Rows of a failed request: NaN, 0, or empty text."""
    if wire in ("string", "bytes"):
        array = np.empty(shape, dtype=codec.STRING if wire == "string" else codec.BYTES)
        array.fill("" if wire == "string" else b"")
        return array
    return np.full(shape, np.nan if np.issubdtype(dtype, np.inexact) else 0, dtype=dtype)


class Columns:
    """The outputs' names, dtypes and row shapes, fixed by the first rows that succeed."""

    def __init__(self, key_name: str | None = None) -> None:
        self.key_name = key_name
        self.spec: dict[str, tuple[np.dtype[Any], str, tuple[int, ...]]] | None = None

    def fit(
        self, start: int, stop: int, outputs: Mapping[str, Any]
    ) -> tuple[dict[str, np.ndarray] | None, ErrorInfo | None]:
        """The outputs as they are written, or an error saying why they do not fit."""
        arrays = {name: codec.as_tensor(part) for name, part in outputs.items()}
        if self.spec is None:
            if self.key_name in arrays:
                return None, ErrorInfo(
                    "OUTPUT_MISMATCH",
                    f"output {self.key_name!r} has the name of the key column; fetch the "
                    "other outputs (--outputs), or name the key otherwise (--key).",
                )
            if any(a.ndim == 0 for a in arrays.values()):
                return None, ErrorInfo("OUTPUT_MISMATCH", f"rows {start}:{stop} have no rows.")
            self.spec = {n: (a.dtype, wire_of(a), a.shape[1:]) for n, a in arrays.items()}
        if set(arrays) != set(self.spec):
            return None, ErrorInfo(
                "OUTPUT_MISMATCH",
                f"rows {start}:{stop} came back with outputs {sorted(arrays)}, but earlier rows "
                f"had {sorted(self.spec)}; were workers of different model versions serving?",
            )
        fitted = {}
        for name, part in arrays.items():
            dtype, wire, shape = self.spec[name]
            if part.shape != (stop - start, *shape) or (wire in ("string", "bytes")) != (
                wire_of(part) in ("string", "bytes")
            ):
                return None, ErrorInfo(
                    "OUTPUT_MISMATCH",
                    f"output {name!r} for rows {start}:{stop} has shape {part.shape} of "
                    f"{wire_of(part)}, which does not stack with rows of shape {list(shape)} of "
                    f"{wire}.",
                )
            fitted[name] = part if part.dtype == dtype else part.astype(dtype)
        return fitted, None

    def wire(self, name: str) -> str:
        """Output ``name``'s wire dtype."""
        assert self.spec is not None
        return self.spec[name][1]

    def fill(self, rows: int) -> dict[str, np.ndarray]:
        assert self.spec is not None
        return {n: fill(d, w, (rows, *s)) for n, (d, w, s) in self.spec.items()}

    def describe(self, rows: int) -> list[tuple[str, str, list[int]]]:
        return [(n, w, [rows, *s]) for n, (_, w, s) in (self.spec or {}).items()]
