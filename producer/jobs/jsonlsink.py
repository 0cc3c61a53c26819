"""``redbatch run --output Y.jsonl``: one JSON object per input row, written as the rows come.

Each line is ``{KEY: key, OUTPUT: value, ...}`` in input order: the key column first (``path``,
``line``, ``row`` or the ``--key`` column), then one member per output. A row's value is what
the reply holds for it: a number, a string, or nested lists for rows of shape [k] (or more).
``bytes`` outputs are written as base64 text (JSON has no bytes); a non-finite float (NaN,
infinity) as null, since JSON has no such number. Failed rows have every output null, and are
listed in the errors file. Floats are written as the shortest text that reads back to the same
float64, so a float32 output read back and cast to float32 is the value the worker sent.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from producer.jobs.columns import Columns
from producer.jobs.files import AtomicFile
from producer.protocol.codec import ErrorInfo

__all__ = ["JsonlSink"]


class JsonlSink:
    """A .jsonl of the outputs, a line per row (see the module docstring)."""

    def __init__(self, path: Path, key_name: str) -> None:
        self._key_name = key_name
        self._columns = Columns(key_name)
        self._target = AtomicFile(path, binary=False)
        self._rows = 0

    def put(
        self, start: int, stop: int, keys: np.ndarray | None, outputs: Mapping[str, Any] | None
    ) -> ErrorInfo | None:
        fitted, error = (None, None) if outputs is None else self._columns.fit(start, stop, outputs)
        row_keys = np.arange(start, stop) if keys is None else keys
        names = list(self._columns.spec or {}) if fitted is None else list(fitted)
        values = (
            {n: [None] * (stop - start) for n in names}
            if fitted is None
            else {n: _values(self._columns.wire(n), a) for n, a in fitted.items()}
        )
        lines = []
        for i, key in enumerate(row_keys.tolist()):
            row = {self._key_name: _plain(key)}
            row.update((n, values[n][i]) for n in names)
            lines.append(json.dumps(row, ensure_ascii=False, allow_nan=False))
        if lines:
            self._target.file.write("\n".join(lines) + "\n")
        self._rows += stop - start
        return error

    def describe(self) -> list[tuple[str, str, list[int]]]:
        return self._columns.describe(self._rows)

    def commit(self) -> None:
        self._target.commit()

    def discard(self) -> None:
        self._target.discard()


def _values(wire: str, array: np.ndarray) -> list[Any]:
    """Each row of ``array`` as JSON values."""
    if wire == "bytes":
        encode = np.frompyfunc(lambda b: base64.b64encode(bytes(b)).decode("ascii"), 1, 1)
        return list(encode(array).tolist())
    rows = array.tolist()
    if array.dtype.kind in "fc":
        return [_finite(r) for r in rows]
    return list(rows)


def _finite(value: Any) -> Any:
    """NaN and infinities (which JSON has no number for) as null, at any depth."""
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _plain(key: Any) -> Any:
    return key.decode("utf-8", "replace") if isinstance(key, bytes) else key
