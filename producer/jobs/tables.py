"""Inputs read as columns: JSON lines (an input per key) here, and the rules the Arrow tables of
``producer.jobs.arrowtables`` share with them: which columns are inputs, and each one's dtype.

Values become rows as the wire carries them: text to ``string``, binary to ``bytes`` (or either
as ``--dtype NAME=string|bytes`` or the live workers say: ``producer.jobs.textwire``), numbers
and (fixed-size) lists of numbers to numeric arrays, a row's shape fixed by the first row. A
numeric input's dtype is ``--dtype NAME=DTYPE`` when given, else the dtype the live workers
report for that input, else the values' own: for JSON, ``int64`` for integers, ``float32`` for
other numbers, ``bool`` for true/false. Numbers cast to a float dtype as they are, to an
integer dtype only when the value is an integer that fits (1.0 is 1; 1.5 and 300 as uint8 are
refused). A record that does not fit (a null, a value of another type or shape, a refused cast)
is skipped and listed, not sent; in a Parquet or Arrow column, a refused cast stops the input.

pyarrow is optional (``pip install 'redbatch[parquet]'``): ``pyarrow()`` imports it, or says
how to install it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from producer.jobs.blocks import Block, Skipped, Source, SourceOptions, read_lines
from producer.jobs.blocks import text_array as _text
from producer.jobs.textwire import numeric_only, recode, text_wire
from producer.protocol.errors import UsageError

__all__ = ["cast", "castable", "open_jsonl", "pyarrow", "select_inputs", "target_dtype"]

_OWN = {"b": np.dtype(bool), "i": np.dtype(np.int64), "u": np.dtype(np.int64)}


def pyarrow() -> Any:
    """The pyarrow module; UsageError naming the extra to install when it is missing."""
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as exc:
        raise UsageError(
            "Parquet and Arrow files need pyarrow, which is not installed: "
            "pip install 'redbatch[parquet]'."
        ) from exc
    return pyarrow


def select_inputs(available: list[str], options: SourceOptions, where: str) -> list[str]:
    """The inputs to send: --columns, or every column but the key; checked against those
    ``available``."""
    key = options.key
    if key is not None and key not in available:
        raise UsageError(f"--key {key!r}: {where} has no such column; it has {available}.")
    names = list(options.columns) if options.columns else [c for c in available if c != key]
    missing = [c for c in names if c not in available]
    if missing:
        raise UsageError(f"--columns {', '.join(missing)}: {where} has no such column.")
    if not names:
        raise UsageError(f"{where} has no column to send besides the key {key!r}.")
    unknown = sorted(set(options.dtypes) - set(names))
    if unknown:
        raise UsageError(f"--dtype {', '.join(unknown)}: not an input sent from {where}.")
    return names


def target_dtype(name: str, options: SourceOptions, own: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype input ``name``, which holds numbers, is sent as (see the module docstring)."""
    numeric_only(name, options.dtypes)
    if name in options.dtypes:
        return np.dtype(options.dtypes[name])
    model = options.model_dtypes.get(name)
    if model is not None:
        try:
            want = np.dtype(model)
        except TypeError:  # string, bytes: not numeric
            return own
        if castable(own, want):
            return want
    return own


def castable(own: np.dtype[Any], target: np.dtype[Any]) -> bool:
    """Whether values of ``own`` may be sent as ``target``: bools as anything, numbers as
    floats, and as integers only when each value is one that fits (checked by ``_cast``)."""
    if own.kind == "b" or own == target:
        return True
    return target.kind in "iuf" and own.kind in "iuf"


def cast(values: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray | None:
    """``values`` as ``dtype``, or None when that would change a value (an integer target
    takes only integers it can hold)."""
    if values.dtype == dtype:
        return values
    if values.dtype.kind not in "biuf" or not castable(values.dtype, dtype):
        return None
    with np.errstate(invalid="ignore", over="ignore"):
        cast = values.astype(dtype)
    if dtype.kind in "iu" and not np.array_equal(cast, values):
        return None
    return cast


# ---------------------------------------------------------------------------------------------
# JSON lines


def open_jsonl(path: Path, options: SourceOptions) -> Source:
    """A .jsonl input: one row per object, an input per key (see the module docstring)."""
    first = _first_object(path)
    names = select_inputs(list(first), options, repr(str(path)))
    columns = _JsonColumns(names, options)
    blocks = columns.blocks(path)
    return Source("jsonl", names, options.key or "line", blocks, None, path.stat().st_size, "B")


def _first_object(path: Path) -> dict[str, Any]:
    for numbers, _, lines, _ in read_lines(path):
        if lines:
            try:
                first = json.loads(lines[0])
            except ValueError as exc:
                raise UsageError(f"{str(path)!r} line {numbers[0]} is not JSON: {exc}.") from exc
            if not isinstance(first, dict):
                raise UsageError(f"{str(path)!r} line {numbers[0]} is not a JSON object.")
            return first
    raise UsageError(f"{str(path)!r} holds no JSON object.")


@dataclass(frozen=True, slots=True)
class _Spec:
    """What every row of one input must be: text, or numbers of one shape (and the dtype)."""

    dtype: np.dtype[Any] | None  # None: text
    shape: tuple[int, ...] = ()
    wire: str = "string"  # text sent as string, or as its UTF-8 bytes


class _JsonColumns:
    """JSON objects to blocks, each input's kind and shape fixed by its first value."""

    def __init__(self, names: list[str], options: SourceOptions) -> None:
        self._names = names
        self._options = options
        self._key = options.key
        self._specs: dict[str, _Spec] = {}
        self._int_keys: bool | None = None

    def blocks(self, path: Path) -> Iterator[Block]:
        for numbers, ends, lines, unread in read_lines(path):
            skips = [(s.key, s.key if self._key is None else None, s.message) for s in unread]
            yield self._block(numbers, ends, lines, skips)

    def _block(
        self,
        numbers: list[int],
        ends: list[int],
        lines: list[str],
        skips: list[tuple[int, Any, str]],
    ) -> Block:
        rows: list[tuple[int, int, Any, dict[str, Any]]] = []
        for number, end, line in zip(numbers, ends, lines, strict=True):
            key, obj, message = self._parse(number, line)
            if obj is None:
                skips.append((number, key, message))
            else:
                rows.append((number, end, key, obj))
        bad: dict[int, str] = {}
        inputs = {name: self._column(name, [r[3][name] for r in rows], bad) for name in self._names}
        keys = self._keys([r[2] for r in rows], bad)
        for i in sorted(bad):
            skips.append((rows[i][0], rows[i][2], f"line {rows[i][0]}: {bad[i]}"))
        keep = np.ones(len(rows), bool)
        keep[list(bad)] = False
        kept = np.asarray([r[0] for r in rows], np.int64)[keep]
        skipped = [
            Skipped(int(np.searchsorted(kept, line)), key, message)
            for line, key, message in sorted(skips, key=lambda s: s[0])
        ]
        return Block(
            {name: array[keep] for name, array in inputs.items()},
            keys[keep],
            np.asarray([r[1] for r in rows], np.int64)[keep],
            skipped,
        )

    def _parse(self, number: int, line: str) -> tuple[Any, dict[str, Any] | None, str]:
        """(key, object, ""), or (key, None, why) for a line that is not a row."""
        default_key = number if self._key is None else None
        try:
            obj = json.loads(line)
        except ValueError as exc:
            return default_key, None, f"line {number} is not JSON: {exc}."
        if not isinstance(obj, dict):
            return default_key, None, f"line {number} is not a JSON object."
        missing = [n for n in (*self._names, *([self._key] if self._key else [])) if n not in obj]
        key = number if self._key is None else obj.get(self._key)
        if missing:
            return key, None, f"line {number} has no {', '.join(map(repr, missing))}."
        return key, obj, ""

    def _column(self, name: str, values: list[Any], bad: dict[int, str]) -> np.ndarray:
        """The values of input ``name`` as a tensor; rows that do not fit go to ``bad``."""
        spec = self._specs.get(name)
        if spec is None and values:
            spec = self._specs[name] = self._spec_of(name, values[0])
        if spec is None or spec.dtype is None:
            for i, value in enumerate(values):
                if not isinstance(value, str):
                    bad.setdefault(i, f"input {name!r} is {_json(value)}, not a string.")
            texts = [v if isinstance(v, str) else "" for v in values]
            wire = "string" if spec is None else spec.wire
            return _text(texts if wire == "string" else recode(texts, wire)[0], wire)
        fast = _numbers(values, spec)
        if fast is not None:
            return fast
        out = np.zeros((len(values), *spec.shape), spec.dtype)
        for i, value in enumerate(values):
            row = _numbers([value], spec)
            if row is None:
                want = f"{spec.dtype} of shape {list(spec.shape)}"
                bad.setdefault(i, f"input {name!r} is {_json(value)}, not {want}.")
            else:
                out[i] = row[0]
        return out

    def _spec_of(self, name: str, value: Any) -> _Spec:
        if isinstance(value, str):
            options = self._options
            return _Spec(None, wire=text_wire(name, "string", options.dtypes, options.model_dtypes))
        try:
            array = np.asarray(value)
        except ValueError:
            array = np.asarray(None)
        if array.dtype.kind not in "biuf":
            raise UsageError(
                f"input {name!r} starts with {_json(value)}; JSON inputs must hold strings, "
                "numbers, or lists of numbers of one shape."
            )
        own = _OWN.get(array.dtype.kind, np.dtype(np.float32))
        return _Spec(target_dtype(name, self._options, own), array.shape)

    def _keys(self, values: list[Any], bad: dict[int, str]) -> np.ndarray:
        """--key values: integers when the first one is, else text (JSON for non-strings)."""
        if self._key is None:
            return np.asarray(values, np.int64)
        if self._int_keys is None and values:
            self._int_keys = type(values[0]) is int
        if self._int_keys:
            for i, value in enumerate(values):
                if type(value) is not int or not -(2**63) <= value < 2**63:
                    bad.setdefault(i, f"key {self._key!r} is {_json(value)}, not an integer.")
            return np.asarray([v if i not in bad else 0 for i, v in enumerate(values)], np.int64)
        return _text([v if isinstance(v, str) else _json(v) for v in values])


def _numbers(values: list[Any], spec: _Spec) -> np.ndarray | None:
    """``values`` as one array of ``spec``, or None when any does not fit."""
    assert spec.dtype is not None
    try:
        array = np.asarray(values)
    except (ValueError, OverflowError):
        return None
    if array.shape != (len(values), *spec.shape):
        return None
    return cast(array, spec.dtype)


def _json(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
