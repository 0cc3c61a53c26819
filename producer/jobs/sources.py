"""What ``redbatch run`` reads: an input opened as blocks of rows, read as they are sent.

``open_source`` tells the input's kind from its name (or ``--format``) and opens it. Each
kind's rows, and the key each row carries to the outputs:

- ``.npy`` / ``.npz``: the arrays' rows, memory-mapped; key ``row``, the row index.
- a directory or a glob: one ``bytes`` row per file, in path order (``producer.jobs.filewalk``);
  key ``path``.
- ``.txt``: one ``string`` row per line, its newline removed; key ``line`` (1-based).
- ``.jsonl`` / ``.ndjson``: one row per JSON object, an input per key; key ``line``, or
  ``--key``.
- ``.parquet``, ``.arrow`` / ``.feather``: one row per table row, an input per column; key
  ``row`` (0-based), or ``--key``.

(The last two are ``producer.jobs.tables``' and ``producer.jobs.arrowtables``'.) Text of any kind
is sent as the input takes it (``--dtype NAME=string|bytes``, else the live workers' dtype:
``producer.jobs.textwire``), so a folder of .txt files feeds a ``string`` input. Every reader but
the arrays' yields blocks (``blocks.Block``) of a few thousand rows (or a few MiB) at a time, so an
input far larger than memory streams through a bounded window. A record the reader cannot turn
into a row (a file it cannot read, a line that is not UTF-8, not JSON, or lacks an input, a
value of the wrong type or shape, a null) is not sent: the block lists it in ``skipped``, for
the errors file, and the run goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from producer.jobs.blocks import (
    BLOCK_BYTES,
    Block,
    Skipped,
    Source,
    SourceOptions,
    read_lines,
    text_array,
)
from producer.jobs.files import load_inputs
from producer.jobs.filewalk import has_glob, iter_files
from producer.jobs.textwire import TEXT_WIRES, recode, text_wire
from producer.protocol.errors import UsageError

__all__ = ["FORMATS", "input_kind", "open_source"]

#: ``--format`` values; ``auto`` tells the format from the input's name.
FORMATS = ("auto", "npy", "npz", "files", "text", "jsonl", "parquet", "arrow")
_SUFFIXES = {
    ".npy": "npy",
    ".npz": "npz",
    ".txt": "text",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
}


def input_kind(text: str, fmt: str = "auto") -> str:
    """The kind of input ``text`` names: one of ``FORMATS`` but auto; UsageError if unknown."""
    path = Path(text)
    if fmt != "auto":
        return fmt
    if path.is_dir() or (not path.exists() and has_glob(text)):
        return "files"
    if not path.exists():
        raise UsageError(f"input file {text!r} does not exist.")
    kind = _SUFFIXES.get(path.suffix.lower())
    if kind is None:
        known = ", ".join(sorted(_SUFFIXES))
        raise UsageError(
            f"cannot tell the format of input {text!r} from its name (known: {known}, a "
            "directory, or a glob); pass --format."
        )
    return kind


def open_source(text: str, options: SourceOptions) -> Source:
    """Open the input ``text`` names (a file, a directory or a glob); UsageError when it
    cannot be read or the options do not fit it."""
    kind = input_kind(text, options.format)
    _check_options(kind, options)
    if kind == "files":
        return _files(text, options)
    path = Path(text)
    if not path.is_file():
        raise UsageError(f"input file {text!r} does not exist.")
    if kind in ("npy", "npz"):
        return _arrays(path, kind, options)
    if kind == "text":
        return _text(path, options)
    if kind == "jsonl":
        from producer.jobs import tables

        return tables.open_jsonl(path, options)
    from producer.jobs import arrowtables

    return arrowtables.open_arrow(path, kind, options)


def _check_options(kind: str, options: SourceOptions) -> None:
    tabular = kind in ("jsonl", "parquet", "arrow")
    for flag, given in (("--columns", options.columns), ("--key", options.key)):
        if given and not tabular:
            raise UsageError(f"{flag} applies to .jsonl, .parquet and .arrow inputs, not {kind}.")
    if options.dtypes and kind in ("npy", "npz"):
        raise UsageError(
            f"--dtype applies to files, .txt, .jsonl, .parquet and .arrow inputs, not {kind}: "
            "cast the arrays themselves."
        )
    numeric = sorted(n for n, d in options.dtypes.items() if d not in TEXT_WIRES)
    if numeric and not tabular:
        raise UsageError(
            f"--dtype {numeric[0]}={options.dtypes[numeric[0]]}: {kind} inputs are text; give "
            f"--dtype {numeric[0]}=string or {numeric[0]}=bytes."
        )
    if options.keep_empty_lines and kind != "text":
        raise UsageError(f"--keep-empty-lines applies to .txt inputs, not {kind}.")


# ---------------------------------------------------------------------------------------------
# Arrays


def _arrays(path: Path, kind: str, options: SourceOptions) -> Source:
    if path.suffix != f".{kind}":  # --format npy on another name: load_inputs goes by suffix
        raise UsageError(f"an {kind} input must end in .{kind}; {str(path)!r} does not.")
    arrays = load_inputs(path, options.input_name)
    rows = {name: (a.shape[0] if a.ndim else -1) for name, a in arrays.items()}
    counts = set(rows.values())
    if len(counts) != 1 or min(counts) < 1:
        detail = ", ".join(f"{n} has {r if r >= 0 else 'no'} rows" for n, r in rows.items())
        raise UsageError(f"every input needs the same number of rows (at least 1): {detail}.")
    n = counts.pop()
    block = Block(dict(arrays))
    return Source(kind, list(arrays), "row", iter([block]), n, n, "row", arrays)


# ---------------------------------------------------------------------------------------------
# Files


def _files(text: str, options: SourceOptions) -> Source:
    # Counted first, for the progress bar and to refuse an empty match: a walk that keeps
    # nothing (the second walk, as the rows are sent, reads the files)
    count = sum(1 for _ in iter_files(text, options.exclude))
    if not count:
        raise UsageError(f"no files match {text!r} (hidden files are left out).")
    name = options.input_name()
    wire = _single_wire(name, "bytes", options, text)
    blocks = _file_blocks(iter_files(text, options.exclude), name, wire)
    return Source("files", [name], "path", blocks, count, count)


def _single_wire(name: str, own: str, options: SourceOptions, where: str) -> str:
    """The kind a single-input kind's rows are sent as (``producer.jobs.textwire``)."""
    unknown = sorted(set(options.dtypes) - {name})
    if unknown:
        raise UsageError(
            f"--dtype {', '.join(unknown)}: not an input sent from {where!r}, whose rows are "
            f"input {name!r}."
        )
    return text_wire(name, own, options.dtypes, options.model_dtypes)


def _file_blocks(paths: Iterator[str], name: str, wire: str = "bytes") -> Iterator[Block]:
    """Files read one at a time, a few to a block (at most ``BLOCK_BYTES`` unless one file is
    larger on its own); as ``string`` rows when ``wire`` says so (a file that is not UTF-8 is
    then skipped)."""
    data: list[Any] = []
    keys: list[str] = []
    skipped: list[Skipped] = []
    size = 0
    for path in paths:
        try:
            with open(path, "rb") as fh:
                content = fh.read()
        except OSError as exc:
            skipped.append(Skipped(len(data), path, f"cannot read {path!r}: {exc.strerror}."))
            continue
        if wire != "bytes":
            [text], bad = recode([content], wire)
            if bad:
                skipped.append(Skipped(len(data), path, f"file {path!r} {bad[0]}."))
                continue
            data.append(text)
        else:
            data.append(content)
        keys.append(path)
        size += len(content)
        if len(data) >= 64 or size >= BLOCK_BYTES:
            yield Block({name: text_array(data, wire)}, text_array(keys), skipped=skipped)
            data, keys, skipped, size = [], [], [], 0
    if data or skipped:
        yield Block({name: text_array(data, wire)}, text_array(keys), skipped=skipped)


# ---------------------------------------------------------------------------------------------
# Text


def _text(path: Path, options: SourceOptions) -> Source:
    name = options.input_name()
    wire = _single_wire(name, "string", options, str(path))
    blocks = _text_blocks(path, name, options.keep_empty_lines, wire)
    return Source("text", [name], "line", blocks, None, path.stat().st_size, "B")


def _text_blocks(path: Path, name: str, keep_empty: bool, wire: str = "string") -> Iterator[Block]:
    """One row per line, its newline ("\\n", or "\\r\\n") removed and nothing else; empty
    lines are left out unless ``keep_empty``. Keys are 1-based line numbers. Rows are
    ``string``, or the lines' UTF-8 as ``bytes`` when ``wire`` says so."""
    for numbers, ends, lines, skipped in read_lines(path, keep_empty):
        keys = np.asarray(numbers, np.int64)
        values = lines if wire == "string" else recode(lines, wire)[0]
        block = {name: text_array(values, wire)}
        yield Block(block, keys, np.asarray(ends, np.int64), skipped)
