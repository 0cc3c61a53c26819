"""What ``redbatch run`` writes: the outputs, row by row in input order, with each row's key.

A sink takes the rows in input order, ``put(start, stop, keys, outputs)``, with ``outputs`` None
for rows that failed. The first rows that succeed fix the output names, dtypes and row shapes;
later rows that do not fit are refused (``OUTPUT_MISMATCH``, returned) and written as failed.
Failed rows are NaN in float outputs, 0 in other numbers and empty in ``string``/``bytes``
ones (in Parquet: null).

- ``MemorySink``: arrays in memory (``run_job``'s default, for the library and the tests).
- ``NpzSink``: an .npz, each output's rows spooled to a temporary file beside the output and
  zipped at ``commit()``, so memory stays bounded whatever the input's size, for the price of
  the output's size again on disk meanwhile. The .npz is one array per output, plus the keys
  (``path``, ``line`` or the ``--key`` column) when the input has them. Text becomes
  fixed-width arrays (``U``; ``bytes`` outputs ``S``, which drops trailing NUL bytes: write a
  .parquet to keep them).
- ``ParquetSink``: a .parquet written a row group (about 16 MiB) at a time: the key column,
  then one column per output (a row of shape [k] is a fixed-size list of k; text a string or
  binary column).
- ``producer.jobs.jsonlsink.JsonlSink``: a .jsonl, a JSON object per row as the rows come.

``commit()`` renames the file into place; ``discard()`` leaves any earlier file as it was.
"""

from __future__ import annotations

import shutil
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from producer.jobs.columns import Columns, fill, wire_of
from producer.jobs.files import AtomicFile
from producer.jobs.jsonlsink import JsonlSink
from producer.jobs.npyspool import Spool
from producer.protocol.codec import ErrorInfo

__all__ = ["Columns", "MemorySink", "NpzSink", "ParquetSink", "Sink", "open_sink"]

_ROW_GROUP_BYTES = 16 << 20
_ROW_GROUP_ROWS = 65536


class Sink(Protocol):
    """Where a job's rows go, in input order."""

    def put(
        self, start: int, stop: int, keys: np.ndarray | None, outputs: Mapping[str, Any] | None
    ) -> ErrorInfo | None:
        """Write rows ``start:stop`` (failed when ``outputs`` is None); an error when the
        outputs do not fit those of earlier rows (the rows are then written as failed)."""

    def describe(self) -> list[tuple[str, str, list[int]]]:
        """Each output's name, dtype and shape so far (for the summary)."""

    def commit(self) -> None:
        """Finish the file and rename it into place."""

    def discard(self) -> None:
        """Remove what was written; an earlier file stays as it was."""


def open_sink(path: Path, key_name: str | None) -> Sink:
    """The sink for ``path``'s suffix (.npz, .parquet or .jsonl); ``key_name`` names the key
    column (None: no key is written in an .npz; "row" in the others)."""
    if path.suffix == ".parquet":
        return ParquetSink(path, key_name or "row")
    if path.suffix == ".jsonl":
        return JsonlSink(path, key_name or "row")
    return NpzSink(path, key_name)


# ---------------------------------------------------------------------------------------------
# In memory


class MemorySink:
    """The outputs as arrays in memory (``arrays``); keys are not kept."""

    def __init__(self) -> None:
        self._columns = Columns()
        self._parts: dict[str, list[np.ndarray]] = {}
        self._rows = 0
        self._failed_first = 0  # failed rows before the first success, written once it comes

    def put(
        self, start: int, stop: int, keys: np.ndarray | None, outputs: Mapping[str, Any] | None
    ) -> ErrorInfo | None:
        error = None
        if outputs is not None:
            fitted, error = self._columns.fit(start, stop, outputs)
            if fitted is not None:
                if self._failed_first:
                    self._append(self._columns.fill(self._failed_first))
                    self._failed_first = 0
                self._append(fitted)
                return None
        if self._columns.spec is None:
            self._failed_first += stop - start
        else:
            self._append(self._columns.fill(stop - start))
        return error

    def _append(self, arrays: Mapping[str, np.ndarray]) -> None:
        for name, array in arrays.items():
            self._parts.setdefault(name, []).append(array)
        self._rows += len(next(iter(arrays.values()))) if arrays else 0

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """Each output's rows so far, as one array."""
        out = {}
        for name, parts in self._parts.items():
            joined = np.concatenate(parts) if len(parts) > 1 else parts[0]
            if joined.dtype.kind == "O":  # np.concatenate drops the wire dtype
                typed = np.empty(joined.shape, dtype=parts[0].dtype)
                typed[...] = joined
                joined = typed
            out[name] = joined
        return out

    def describe(self) -> list[tuple[str, str, list[int]]]:
        return self._columns.describe(self._rows)

    def commit(self) -> None:
        """Nothing to write."""

    def discard(self) -> None:
        self._parts.clear()


# ---------------------------------------------------------------------------------------------
# .npz


class NpzSink:
    """An .npz streamed through one spool file per array (see the module docstring)."""

    def __init__(self, path: Path, key_name: str | None) -> None:
        self._path = path
        self._dir = Path(
            tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".parts", dir=path.parent)
        )
        self._key_name = key_name
        self._columns = Columns(key_name)
        self._spools: dict[str, Spool] = {}
        self._key: Spool | None = None
        self._failed_first = 0

    def put(
        self, start: int, stop: int, keys: np.ndarray | None, outputs: Mapping[str, Any] | None
    ) -> ErrorInfo | None:
        if self._key_name is not None:
            self._write_keys(np.arange(start, stop) if keys is None else keys)
        error = None
        if outputs is not None:
            fitted, error = self._columns.fit(start, stop, outputs)
            if fitted is not None:
                if not self._spools:
                    self._open_spools()
                self._write(fitted)
                return None
        if self._spools:
            self._write(self._columns.fill(stop - start))
        else:
            self._failed_first += stop - start
        return error

    def _open_spools(self) -> None:
        assert self._columns.spec is not None
        for i, (name, (dtype, wire, shape)) in enumerate(self._columns.spec.items()):
            self._spools[name] = Spool(self._dir / f"{i}.part", dtype, wire, shape)
        if self._failed_first:
            self._write(self._columns.fill(self._failed_first))
            self._failed_first = 0

    def _write(self, arrays: Mapping[str, np.ndarray]) -> None:
        for name, array in arrays.items():
            self._spools[name].write(array)

    def _write_keys(self, keys: np.ndarray) -> None:
        if self._key is None:
            self._key = Spool(self._dir / "key.part", keys.dtype, wire_of(keys), ())
        self._key.write(keys)

    def describe(self) -> list[tuple[str, str, list[int]]]:
        rows = next(iter(self._spools.values())).rows if self._spools else 0
        return self._columns.describe(rows)

    def commit(self) -> None:
        """Zip the spools into the .npz (uncompressed, like ``np.savez``), then rename it."""
        target = AtomicFile(self._path)
        try:
            with zipfile.ZipFile(target.file, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
                named = dict(self._spools)
                if self._key is not None and self._key_name is not None:
                    named.setdefault(self._key_name, self._key)
                for name, spool in named.items():
                    with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                        spool.copy_to(member)
        except BaseException:
            target.discard()
            self.discard()
            raise
        target.commit()
        self.discard()

    def discard(self) -> None:
        for spool in [*self._spools.values(), *([self._key] if self._key else [])]:
            spool.file.close()
        shutil.rmtree(self._dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# .parquet


class ParquetSink:
    """A .parquet written a row group at a time (see the module docstring)."""

    def __init__(self, path: Path, key_name: str) -> None:
        from producer.jobs.tables import pyarrow

        self._pa = pyarrow()
        self._key_name = key_name
        self._columns = Columns(key_name)
        self._target = AtomicFile(path)
        self._writer: Any = None
        self._buffer: list[tuple[np.ndarray, dict[str, np.ndarray] | None]] = []
        self._buffered_rows = self._buffered_bytes = self._rows = 0

    def put(
        self, start: int, stop: int, keys: np.ndarray | None, outputs: Mapping[str, Any] | None
    ) -> ErrorInfo | None:
        fitted, error = (None, None) if outputs is None else self._columns.fit(start, stop, outputs)
        self._buffer.append((np.arange(start, stop) if keys is None else keys, fitted))
        self._buffered_rows += stop - start
        self._buffered_bytes += sum(_size(a) for a in (fitted or {}).values())
        self._rows += stop - start
        full = self._buffered_rows >= _ROW_GROUP_ROWS or self._buffered_bytes >= _ROW_GROUP_BYTES
        if full and self._columns.spec is not None:
            self._flush()
        return error

    def _flush(self) -> None:
        """Write the rows held as one row group."""
        pa = self._pa
        keys = [k for k, _ in self._buffer]
        key_type = pa.string() if keys[0].dtype.kind == "O" else None
        columns = {self._key_name: pa.array(np.concatenate(keys), type=key_type)}
        for name in self._columns.spec or {}:
            parts = [o[name] if o is not None else None for _, o in self._buffer]
            columns[name] = self._arrow_column(name, parts, [len(k) for k in keys])
        table = pa.table(columns)
        if self._writer is None:
            self._writer = pa.parquet.ParquetWriter(self._target.file, table.schema)
        self._writer.write_table(table)
        self._buffer.clear()
        self._buffered_rows = self._buffered_bytes = 0

    def _arrow_column(self, name: str, parts: list[np.ndarray | None], rows: list[int]) -> Any:
        """One output's rows as an Arrow array; failed rows are null."""
        pa = self._pa
        assert self._columns.spec is not None
        dtype, wire, shape = self._columns.spec[name]
        filled = [
            p if p is not None else fill(dtype, wire, (n, *shape))
            for p, n in zip(parts, rows, strict=True)
        ]
        values = np.concatenate(filled)
        failed = np.concatenate([np.full(n, p is None) for p, n in zip(parts, rows, strict=True)])
        leaf_type = {"string": pa.string(), "bytes": pa.binary()}.get(wire)
        flat = values.reshape(-1)
        if not shape:
            return pa.array(flat, type=leaf_type, mask=failed if failed.any() else None)
        array = pa.array(flat, type=leaf_type)
        for size in reversed(shape[1:]):
            array = pa.FixedSizeListArray.from_arrays(array, size)
        # Nulls through a validity bitmap (a bool array's data is one), which any pyarrow takes
        validity = pa.array(~failed).buffers()[1] if failed.any() else None
        list_type = pa.list_(array.type, shape[0])
        return pa.Array.from_buffers(list_type, len(failed), [validity], children=[array])

    def describe(self) -> list[tuple[str, str, list[int]]]:
        return self._columns.describe(self._rows)

    def commit(self) -> None:
        try:
            if self._buffer or self._writer is None:
                self._flush_last()
            self._writer.close()
        except BaseException:
            self.discard()
            raise
        self._target.commit()

    def _flush_last(self) -> None:
        if self._buffer:
            self._flush()
            return
        pa = self._pa  # no row at all: a file with the key column alone
        self._writer = pa.parquet.ParquetWriter(
            self._target.file, pa.schema([(self._key_name, pa.int64())])
        )

    def discard(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._target.discard()


def _size(array: np.ndarray) -> int:
    if array.dtype.kind != "O":
        return int(array.nbytes)
    return sum(len(e) for e in array.ravel()) + 8 * array.size
