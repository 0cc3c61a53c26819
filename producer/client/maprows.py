"""map()'s inputs, taken one request's rows at a time, so that map() runs over inputs that are
not in memory, or not even counted.

Each input of ``map()`` is one of:

- an array, or a list (``codec.as_tensor`` makes it one: a list of ``str`` or ``bytes`` is a
  ``string`` or ``bytes`` tensor): its rows are its leading axis, sliced without copying;
- an iterator of rows (a generator, an open file, ``map(...)``): each item is one row (a
  ``str``, ``bytes``, number or array), pulled only when its request is about to be sent;
- ``Blocks``: an iterable of arrays that each hold some rows, for readers that produce rows in
  batches. ``chunks`` splits one stream of ``{name: array}`` blocks into one ``Blocks`` per
  input, advancing together.

``RowFeed`` holds them: ``take(n)`` hands out the next ``n`` rows of every input (fewer at the
end), and fails when the inputs do not end together. Nothing here does I/O of its own: an
iterator that reads a file reads it when ``take`` pulls from it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence, Set
from itertools import islice
from typing import Any, Protocol

import numpy as np

from producer.protocol import codec

__all__ = ["Blocks", "RowFeed", "chunks"]

_NO_ROWS = np.empty(0)


class Blocks:
    """The rows of one input as an iterable of arrays (blocks), each holding any number of
    rows; a block that spans several requests is sliced, and requests that span blocks get
    their rows joined."""

    def __init__(self, blocks: Iterable[Any]) -> None:
        self._blocks = iter(blocks)

    def __iter__(self) -> Iterator[Any]:
        return self._blocks


def chunks(names: Sequence[str], stream: Iterable[Mapping[str, Any]]) -> dict[str, Blocks]:
    """One stream of blocks, each ``{name: array}`` holding every one of ``names`` with equal
    rows, as one ``Blocks`` per input. They share the stream: taking a block of one input
    reads the next block of the stream, and keeps the other inputs' parts of it until taken,
    so inputs taken together (as map() takes them) hold one block each at most."""
    splitter = _Splitter(list(names), iter(stream))
    return {name: Blocks(splitter.blocks(name)) for name in names}


class _Splitter:
    def __init__(self, names: list[str], stream: Iterator[Mapping[str, Any]]) -> None:
        self._names = names
        self._stream = stream
        self._queues: dict[str, deque[np.ndarray]] = {name: deque() for name in names}

    def blocks(self, name: str) -> Iterator[np.ndarray]:
        queue = self._queues[name]
        while True:
            if not queue and not self._read():
                return
            yield queue.popleft()

    def _read(self) -> bool:
        block = next(self._stream, None)
        if block is None:
            return False
        if set(block) != set(self._names):
            want = sorted(self._names)
            raise ValueError(f"a block holds inputs {sorted(block)}; each must hold {want}.")
        arrays = {name: _rows_array(name, block[name]) for name in self._names}
        if len({len(a) for a in arrays.values()}) > 1:
            listed = ", ".join(f"{name!r} has {len(a)}" for name, a in arrays.items())
            raise ValueError(f"a block's inputs must have the same number of rows: {listed}.")
        for name, array in arrays.items():
            self._queues[name].append(array)
        return True


# ---------------------------------------------------------------------------------------------
# One input


class _Input(Protocol):
    rows: int | None  # known in advance (arrays), else None

    def take(self, n: int) -> np.ndarray:
        """Up to ``n`` rows; fewer only at the end."""

    def has_rows(self) -> bool:
        """True when at least one row is left (an iterator is read ahead by one row)."""

    def at_end(self) -> bool:
        """True when it is known that no row is left."""


class _ArrayInput:
    def __init__(self, array: np.ndarray) -> None:
        self._array = array
        self.rows: int | None = len(array)
        self._at = 0

    def take(self, n: int) -> np.ndarray:
        part = self._array[self._at : self._at + n]
        self._at += len(part)
        return part

    def has_rows(self) -> bool:
        return not self.at_end()

    def at_end(self) -> bool:
        return self._at >= len(self._array)


class _RowsInput:
    """An iterator whose items are rows."""

    def __init__(self, rows: Iterator[Any]) -> None:
        self._rows = rows
        self._ahead: list[Any] = []
        self._ended = False
        self.rows: int | None = None

    def take(self, n: int) -> np.ndarray:
        got = self._ahead + list(islice(self._rows, n - len(self._ahead)))
        self._ahead = []
        if len(got) < n:
            self._ended = True
        return codec.as_tensor(got) if got else _NO_ROWS

    def has_rows(self) -> bool:
        if not self._ahead and not self._ended:
            self._ahead = list(islice(self._rows, 1))
            self._ended = not self._ahead
        return bool(self._ahead)

    def at_end(self) -> bool:
        return self._ended and not self._ahead


class _BlocksInput:
    """``Blocks``: rows come in arrays of any length."""

    def __init__(self, name: str, blocks: Blocks) -> None:
        self._name = name
        self._blocks = iter(blocks)
        self._block: np.ndarray = _NO_ROWS
        self._at = 0
        self._ended = False
        self.rows: int | None = None

    def take(self, n: int) -> np.ndarray:
        parts = []
        while n > 0 and self.has_rows():
            part = self._block[self._at : self._at + n]
            self._at += len(part)
            n -= len(part)
            parts.append(part)
        if not parts:
            return _NO_ROWS
        return parts[0] if len(parts) == 1 else _joined(parts)

    def has_rows(self) -> bool:
        while self._at >= len(self._block) and not self._ended:
            block = next(self._blocks, None)
            if block is None:
                self._ended = True
                self._block = _NO_ROWS
            else:
                self._block, self._at = _rows_array(self._name, block), 0
        return self._at < len(self._block)

    def at_end(self) -> bool:
        return self._ended


def _rows_array(name: str, value: Any) -> np.ndarray:
    array = codec.as_tensor(value)
    if array.ndim == 0:
        raise ValueError(f"map() splits inputs by rows; a block of input {name!r} is a scalar.")
    return array


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """Rows of several blocks as one array; a ``string`` or ``bytes`` tensor keeps its wire
    dtype, which ``np.concatenate`` drops."""
    joined = np.concatenate(parts)
    wire = codec.wire_dtype(parts[0])
    if joined.dtype.kind == "O" and wire in ("string", "bytes"):
        typed = np.empty(joined.shape, dtype=codec.STRING if wire == "string" else codec.BYTES)
        typed[...] = joined
        return typed
    return joined


def _streamed(value: Any) -> bool:
    """True for an iterable read item by item: not an array or anything numpy reads as one
    (a sequence, a pandas Series, a tensor), a set or a mapping (not rows), nor a string."""
    if isinstance(value, Blocks | Iterator):
        return True
    if hasattr(value, "__array__") or hasattr(value, "__array_interface__"):
        return False
    return isinstance(value, Iterable) and not isinstance(
        value, Sequence | Set | Mapping | str | bytes | bytearray | memoryview
    )


def _input(name: str, value: Any) -> _Input:
    if isinstance(value, Blocks):
        return _BlocksInput(name, value)
    if _streamed(value):
        return _RowsInput(iter(value))
    array = codec.as_tensor(value) if isinstance(value, list | tuple) else np.asarray(value)
    if array.ndim == 0:
        raise ValueError(f"map() splits inputs by rows; input {name!r} is a scalar.")
    return _ArrayInput(array)


# ---------------------------------------------------------------------------------------------
# Every input


class RowFeed:
    """map()'s inputs, handed out a request's rows at a time (see the module docstring).

    ``rows`` is the row count when an input is an array (every input's must then agree), else
    None until the inputs end. ``exhausted`` becomes True once every row has been taken.
    """

    def __init__(self, arrays: Mapping[str, Any]) -> None:
        if not arrays:
            raise ValueError("map() needs at least one input array.")
        self._inputs = {name: _input(name, value) for name, value in arrays.items()}
        known = {name: i.rows for name, i in self._inputs.items() if i.rows is not None}
        if len(set(known.values())) > 1:
            listed = ", ".join(f"{name!r} has {n}" for name, n in known.items())
            raise ValueError(f"map() needs every input to have the same number of rows: {listed}.")
        self.rows: int | None = next(iter(known.values())) if known else None
        self.taken = 0

    @property
    def exhausted(self) -> bool:
        """True once it is known that no row is left to take."""
        return all(i.at_end() for i in self._inputs.values())

    def has_rows(self) -> bool:
        """True when a row is left to take (an iterator is read ahead by one row to know)."""
        if self.rows is not None:
            return self.taken < self.rows
        return any(i.has_rows() for i in self._inputs.values())

    def take(self, n: int) -> dict[str, np.ndarray] | None:
        """The next ``n`` rows of every input (fewer at the end), or None when none is left.
        ValueError when the inputs do not end together."""
        parts = {name: i.take(n) for name, i in self._inputs.items()}
        counts = {name: len(part) for name, part in parts.items()}
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"{name!r} has {c}" for name, c in counts.items())
            raise ValueError(
                "map() needs every input to have the same number of rows: after row "
                f"{self.taken}, {listed} more (of at most {n} asked for)."
            )
        got = next(iter(counts.values()))
        self.taken += got
        return parts if got else None
