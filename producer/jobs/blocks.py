"""What an input reader hands a job: blocks of rows, each row's key and progress, and the
records it skipped (``producer.jobs.sources`` opens inputs; ``producer.jobs.ledger`` keeps the
blocks in flight). Also the two helpers every reader uses: ``text_array`` and ``read_lines``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from producer.protocol import codec

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_ROWS",
    "Block",
    "Skipped",
    "Source",
    "SourceOptions",
    "read_lines",
    "text_array",
]

#: A block is cut at this many rows or bytes, whichever comes first.
BLOCK_ROWS = 4096
BLOCK_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class Skipped:
    """A record not sent: ``before`` rows of its block come before it; ``key`` names it."""

    before: int
    key: Any
    message: str


@dataclass(slots=True)
class Block:
    """Some rows of every input. ``keys`` holds each row's key (None: its row index);
    ``ends`` the progress (bytes of the input read) after each row (None: counted in rows)."""

    inputs: dict[str, np.ndarray]
    keys: np.ndarray | None = None
    ends: np.ndarray | None = None
    skipped: list[Skipped] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return len(next(iter(self.inputs.values()))) if self.inputs else 0


@dataclass(slots=True)
class Source:
    """An opened input: its input names, key column, size, and blocks (read lazily).

    ``arrays`` holds the whole inputs of an .npy/.npz (memory-mapped), which map() slices as it
    always has. ``rows`` is the row count when it is cheap to know; ``total`` the progress
    total in ``unit`` ("row", or "B": bytes of the input) when known.
    """

    kind: str
    names: list[str]
    key_name: str
    blocks: Iterator[Block]
    rows: int | None = None
    total: int | None = None
    unit: str = "row"
    arrays: Mapping[str, np.ndarray] | None = None

    @property
    def keyed(self) -> bool:
        """True when rows have keys other than their row index (worth writing out)."""
        return self.arrays is None


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """How to read an input (``redbatch run``'s options). ``input_name`` is called only when a
    single-input kind needs the name; ``model_dtypes`` are the live workers' input dtypes."""

    input_name: Callable[[], str]
    format: str = "auto"
    columns: tuple[str, ...] | None = None
    key: str | None = None
    dtypes: Mapping[str, str] = field(default_factory=dict)
    model_dtypes: Mapping[str, str] = field(default_factory=dict)
    keep_empty_lines: bool = False
    exclude: tuple[Path, ...] = ()


def text_array(values: list[Any], wire: str = "string") -> np.ndarray:
    """A 1-D ``string`` (or ``bytes``) tensor of ``values``, which must all be str (bytes)."""
    array = np.empty(len(values), dtype=codec.STRING if wire == "string" else codec.BYTES)
    array[:] = values
    return array


def read_lines(
    path: Path, keep_empty: bool = False
) -> Iterator[tuple[list[int], list[int], list[str], list[Skipped]]]:
    """The lines of ``path`` in blocks: (line numbers, byte offsets after each line, the lines
    decoded as UTF-8 without their newline, lines skipped as not UTF-8). A UTF-8 byte order
    mark at the start is dropped; empty lines are left out unless ``keep_empty``."""
    numbers: list[int] = []
    ends: list[int] = []
    lines: list[str] = []
    skipped: list[Skipped] = []
    size = at = 0
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, 1):
            at += len(raw)
            body = raw[:-1] if raw.endswith(b"\n") else raw
            body = body[:-1] if body.endswith(b"\r") else body
            if number == 1:
                body = body.removeprefix(b"\xef\xbb\xbf")
            if not body and not keep_empty:
                continue
            try:
                lines.append(body.decode("utf-8"))
            except UnicodeDecodeError as exc:
                skipped.append(Skipped(len(lines), number, f"line {number} is not UTF-8: {exc}."))
                continue
            numbers.append(number)
            ends.append(at)
            size += len(body)
            if len(lines) >= BLOCK_ROWS or size >= BLOCK_BYTES:
                yield numbers, ends, lines, skipped
                numbers, ends, lines, skipped, size = [], [], [], [], 0
    if lines or skipped:
        yield numbers, ends, lines, skipped
