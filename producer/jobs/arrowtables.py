"""Parquet and Arrow IPC inputs, an input per column, read a record batch at a time.

A Parquet file is read with ``iter_batches`` in batches of about ``BLOCK_BYTES`` (its row count
from the metadata, for the progress bar), its pages streamed 1 MiB at a time: memory holds a batch
and the pages being decoded, not a row group. An Arrow IPC file is read batch by batch (an IPC
stream front to back), each record batch sliced into blocks without copying, so memory holds one of
the file's record batches. Strings and binary become ``string`` and ``bytes`` rows (or either, as
``--dtype`` or the live workers say: ``producer.jobs.textwire``); numbers, and (fixed-size, or
equal-length) lists of numbers, numeric rows, their shape fixed by the type or the first row;
dtypes as ``producer.jobs.tables`` says. A row holding a null, or a list of another length, is
skipped and listed; a column of another type (a timestamp, a struct) is refused at the start,
naming ``--columns``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from producer.jobs.blocks import BLOCK_BYTES, Block, Skipped, Source, SourceOptions
from producer.jobs.blocks import text_array as _text
from producer.jobs.tables import cast, castable, pyarrow, select_inputs, target_dtype
from producer.jobs.textwire import recode, text_wire
from producer.protocol.errors import UsageError

__all__ = ["open_arrow"]

_MAX_BLOCK_ROWS = 16384


def open_arrow(path: Path, kind: str, options: SourceOptions) -> Source:
    """A .parquet, or an Arrow IPC file or stream (.arrow, .feather)."""
    pa = pyarrow()
    try:
        table = _ArrowFile(pa, path, kind)
    except (OSError, pa.ArrowException) as exc:
        raise UsageError(f"cannot read {str(path)!r} as {kind}: {exc}") from exc
    names = select_inputs(table.schema.names, options, repr(str(path)))
    columns = {
        name: _ArrowColumn(pa, name, table.schema.field(name).type, options) for name in names
    }
    wanted = names + ([options.key] if options.key and options.key not in names else [])
    blocks = _arrow_blocks(pa, table, wanted, columns, options.key)
    return Source(kind, names, options.key or "row", blocks, table.rows, table.rows, "row")


class _ArrowFile:
    """A Parquet file or an Arrow IPC file (or stream): its schema, row count (when the
    metadata says), and record batches of about ``BLOCK_BYTES``."""

    def __init__(self, pa: Any, path: Path, kind: str) -> None:
        self._pa, self._path, self._kind = pa, path, kind
        if kind == "parquet":
            # pre_buffer (pyarrow's default) reads every row group ahead, the whole file; an
            # unbuffered read takes each column chunk whole: pages are read 1 MiB at a time
            self._parquet = pa.parquet.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
            self.schema = self._parquet.schema_arrow
            self.rows: int | None = self._parquet.metadata.num_rows
            return
        self._source = pa.OSFile(str(path), "r")  # not mapped: read pages would stay resident
        try:
            self._file = pa.ipc.open_file(self._source)
        except pa.ArrowInvalid:  # not the file format: the stream format, read front to back
            self._source.seek(0)
            self._file = None
            self.schema = pa.ipc.open_stream(self._source).schema
            self.rows = None
            return
        self.schema = self._file.schema
        count = getattr(self._file, "count_rows", None)
        self.rows = int(count()) if count is not None else None

    def batches(self, columns: list[str]) -> Iterator[Any]:
        if self._kind == "parquet":
            meta = self._parquet.metadata
            size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
            rows = max(1, min(_MAX_BLOCK_ROWS, BLOCK_BYTES * max(meta.num_rows, 1) // max(size, 1)))
            # one thread: reading is not what limits a run, and threads' buffers grow the peak
            read = self._parquet.iter_batches
            yield from read(batch_size=rows, columns=columns, use_threads=False)
            return
        if self._file is not None:
            whole = (self._file.get_batch(i) for i in range(self._file.num_record_batches))
        else:
            self._source.seek(0)
            whole = iter(self._pa.ipc.open_stream(self._source))
        for batch in whole:  # a batch may be large: sliced (without copying) into blocks
            picked = batch.select(columns)
            step = max(1, BLOCK_BYTES * max(picked.num_rows, 1) // max(picked.nbytes, 1))
            for start in range(0, picked.num_rows, min(step, _MAX_BLOCK_ROWS)):
                yield picked.slice(start, min(step, _MAX_BLOCK_ROWS))


def _arrow_blocks(
    pa: Any, table: _ArrowFile, wanted: list[str], columns: dict[str, _ArrowColumn], key: str | None
) -> Iterator[Block]:
    offset = 0
    for batch in table.batches(wanted):
        n = batch.num_rows
        keys = np.arange(offset, offset + n) if key is None else _key_values(batch.column(key))
        offset += n
        bad = np.zeros(n, bool)
        reasons: dict[int, str] = {}
        for name, column in columns.items():
            column.mark_bad(batch.column(name), bad, reasons)
        good = batch.filter(pa.array(~bad)) if bad.any() else batch
        inputs = {name: column.values(good.column(name)) for name, column in columns.items()}
        kept_at = np.cumsum(~bad) - ~bad  # rows kept before each row
        skipped = [
            Skipped(int(kept_at[i]), _plain(keys[i]), f"row {offset - n + i}: {reasons[int(i)]}")
            for i in np.flatnonzero(bad)
        ]
        yield Block(inputs, keys[~bad], None, skipped)


def _key_values(column: Any) -> np.ndarray:
    values = column.to_numpy(zero_copy_only=False)
    if values.dtype.kind != "O":
        return values
    if all(isinstance(v, str) for v in values):
        return _text(list(values))
    return _text(["" if v is None else str(v) for v in values])


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


class _ArrowColumn:
    """One column sent as an input: its type checked once, its rows' shape fixed by the type
    (fixed-size lists) or by the first row (lists), and cast per ``_target``."""

    def __init__(self, pa: Any, name: str, arrow_type: Any, options: SourceOptions) -> None:
        self._pa, self._name = pa, name
        types = pa.types
        leaf, depth = arrow_type, 0
        if types.is_dictionary(leaf):
            leaf = leaf.value_type
        while types.is_list(leaf) or types.is_large_list(leaf) or types.is_fixed_size_list(leaf):
            leaf, depth = leaf.value_type, depth + 1
        self._depth = depth
        self._shape: tuple[int, ...] | None = None
        if types.is_string(leaf) or types.is_large_string(leaf):
            self._text: str | None = "string"
        elif (
            types.is_binary(leaf) or types.is_large_binary(leaf) or types.is_fixed_size_binary(leaf)
        ):
            self._text = "bytes"
        elif types.is_integer(leaf) or types.is_floating(leaf) or types.is_boolean(leaf):
            self._text = None
        else:
            raise UsageError(
                f"column {name!r} is {arrow_type}; redbatch run sends strings, binary, numbers "
                "and (fixed-size) lists of numbers. Pick the columns to send with --columns."
            )
        if self._text is not None and depth:
            raise UsageError(
                f"column {name!r} is {arrow_type}: a row of text or binary is one value, not a "
                "list; pick the columns to send with --columns."
            )
        # the kind text is sent as: --dtype, else the live workers' (producer.jobs.textwire)
        self._wire = self._text
        if self._text is not None:
            self._wire = text_wire(name, self._text, options.dtypes, options.model_dtypes)
        self._dtype: np.dtype[Any] | None = None
        if self._text is None:
            own = np.dtype(leaf.to_pandas_dtype())
            self._dtype = target_dtype(name, options, own)
            if not castable(own, self._dtype):
                raise UsageError(f"--dtype {name}={self._dtype}: column {name!r} is {leaf}.")

    def mark_bad(self, column: Any, bad: np.ndarray, reasons: dict[int, str]) -> None:
        """Mark rows that are null, or whose lists are not of the first row's shape."""
        if self._pa.types.is_dictionary(column.type):
            column = column.dictionary_decode()
        if self._shape is None and self._depth:
            self._shape = self._first_shape(column)
        rows = _bad_rows(self._pa, column, self._shape or ())
        for i in np.flatnonzero(rows & ~bad):
            reasons[int(i)] = (
                f"column {self._name!r} is null or not of shape {list(self._shape or ())}."
            )
        bad |= rows
        if self._text == "bytes" and self._wire == "string":  # binary sent as strings
            raw = column.to_numpy(zero_copy_only=False)
            at = np.flatnonzero(~bad)
            _, undecodable = recode(list(raw[at]), "string")
            for pos, why in undecodable.items():
                reasons[int(at[pos])] = f"column {self._name!r} {why}."
                bad[at[pos]] = True

    def _first_shape(self, column: Any) -> tuple[int, ...]:
        for i in range(len(column)):
            if column[i].is_valid:
                try:
                    return np.asarray(column[i].as_py()).shape[: self._depth]
                except ValueError:
                    break
        raise UsageError(f"column {self._name!r}: its first rows are null or ragged lists.")

    def values(self, column: Any) -> np.ndarray:
        """The column's rows (none of them bad) as a tensor."""
        if self._pa.types.is_dictionary(column.type):
            column = column.dictionary_decode()
        n, shape = len(column), self._shape or ()
        for _ in range(self._depth):
            column = column.flatten()
        if self._text is not None:
            assert self._wire is not None
            texts = list(column.to_numpy(zero_copy_only=False))
            if self._wire != self._text:
                texts = recode(texts, self._wire)[0]
            return _text(texts, self._wire)
        flat = column.to_numpy(zero_copy_only=False)
        assert self._dtype is not None
        values = cast(flat, self._dtype)
        if values is None:
            raise UsageError(
                f"column {self._name!r} holds values that {self._dtype} cannot hold exactly; "
                "pick another --dtype."
            )
        return values.reshape(n, *shape)


def _bad_rows(pa: Any, column: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Rows that are null, or hold a null, or lists of a length other than ``shape`` says."""
    bad = column.is_null().to_numpy(zero_copy_only=False)
    if not shape:
        return bad
    lengths = pa.compute.list_value_length(column).fill_null(-1).to_numpy(zero_copy_only=False)
    bad = bad | (lengths != shape[0])
    inner_bad = _bad_rows(pa, column.flatten(), shape[1:])
    if inner_bad.any():
        owner = np.repeat(np.arange(len(column)), np.maximum(lengths, 0))
        bad[owner[inner_bad]] = True
    return bad
