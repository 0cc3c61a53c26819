"""A job's record of the input it has read and not yet finished with.

``run_job`` hands map() the blocks of a ``blocks.Source`` through ``Ledger.inputs()``, which
notes each block as map() reads it: the rows' keys, how far into the input each row ends (for
the progress bar), and the records the reader skipped. As map() yields its chunks, in input
order, the job asks for their keys and skipped records (``keys``, ``skipped_until``) and the
ledger forgets the blocks left behind, so it holds only the rows map() holds: a window.

A reader that fails part way (the disk, a corrupt row group) ends the input there:
``error`` keeps what it raised, and the job lists the rest of the input as not read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import numpy as np

from producer.jobs.blocks import Block, Skipped, Source
from producer.protocol.errors import RedbatchError

__all__ = ["Ledger"]


class Ledger:
    """The blocks read and not yet finished; see the module docstring."""

    def __init__(self, source: Source) -> None:
        self._source = source
        self._blocks: deque[tuple[int, Block]] = deque()  # (its first row, block), in order
        self._skipped: deque[tuple[int, Skipped]] = deque()  # (the row it comes before, record)
        self.rows_read = 0  # rows handed to map()
        self.records_read = 0  # rows and skipped records
        self.ended = False  # the input was read to its end
        self.error: BaseException | None = None  # what ended the input before its end
        if source.arrays is not None:  # map() slices the arrays itself
            self.rows_read = self.records_read = source.rows or 0
            self.ended = True

    def inputs(self) -> Iterator[dict[str, np.ndarray]]:
        """The source's blocks' inputs, noting each block as it is read."""
        while True:
            try:
                block = next(self._source.blocks, None)
            except (OSError, ValueError, RedbatchError) as exc:  # pyarrow's are ValueErrors
                self.error = exc
                return
            if block is None:
                self.ended = True
                return
            for record in block.skipped:
                self._skipped.append((self.rows_read + record.before, record))
            self.records_read += block.rows + len(block.skipped)
            if block.rows:
                self._blocks.append((self.rows_read, block))
                self.rows_read += block.rows
                yield block.inputs

    def keys(self, start: int, stop: int) -> np.ndarray | None:
        """The keys of rows ``start:stop`` (None: their row indices); forgets earlier blocks."""
        while self._blocks and self._blocks[0][0] + self._blocks[0][1].rows <= start:
            self._blocks.popleft()
        parts = []
        for first, block in self._blocks:
            if first >= stop:
                break
            if block.keys is None:
                return None
            parts.append(block.keys[max(start - first, 0) : stop - first])
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def key(self, row: int) -> object:
        """The key of ``row`` when it has been read (else None)."""
        keys = self.keys(row, row + 1) if row < self.rows_read else None
        return None if keys is None or not len(keys) else keys[0]

    def position(self, stop: int) -> int:
        """Progress once rows up to ``stop`` are done: bytes of the input for readers that
        count them, else rows and records skipped so far."""
        for first, block in self._blocks:
            if first < stop <= first + block.rows and block.ends is not None:
                return int(block.ends[stop - first - 1])
        return -1  # not counted in bytes: the job counts rows

    def skipped_until(self, row: int | None) -> list[tuple[int, Skipped]]:
        """The skipped records that come before ``row`` (None: all read so far), forgotten."""
        out = []
        while self._skipped and (row is None or self._skipped[0][0] <= row):
            out.append(self._skipped.popleft())
        return out

    def rows_known(self) -> int | None:
        """The input's row count, when known: read to its end, or told by the source (which
        counts records: the rows not yet read are counted as if all are readable)."""
        if self.ended:
            return self.rows_read
        if self._source.rows is not None and self.error is None:
            return self.rows_read + max(self._source.rows - self.records_read, 0)
        return None
