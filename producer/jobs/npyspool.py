"""An array written row by row to a temporary file, and emitted as an .npy once complete.

``producer.jobs.sinks.NpzSink`` writes each output through one, so that an .npz of any size is
written in bounded memory: numbers are spooled as raw C-order bytes; text as each element's
length and bytes, its longest length counted, and turned into a fixed-width array (``U``, or
``S`` for bytes) a block at a time when the .npy is written.
"""

from __future__ import annotations

import math
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

__all__ = ["Spool"]

_SPOOL_ROWS = 65536  # elements of text turned into a fixed-width array at a time, at most
_SPOOL_BYTES = 4 << 20  # and at most this many bytes of it


class Spool:
    """One array's rows in a temporary file: raw C-order bytes for numbers; for text, each
    element as a 4-byte length and its UTF-8 (or raw) bytes, its longest length counted."""

    def __init__(self, path: Path, dtype: np.dtype[Any], wire: str, shape: tuple[int, ...]):
        self.path, self.dtype, self.wire, self.shape = path, dtype, wire, shape
        self.file: BinaryIO = path.open("wb")
        self.rows = 0
        self.longest = 1

    def write(self, array: np.ndarray) -> None:
        self.rows += len(array)
        if self.wire not in ("string", "bytes"):
            self.file.write(np.ascontiguousarray(array, self.dtype).tobytes())
            return
        chunks = []
        for element in array.ravel():
            raw = element.encode() if isinstance(element, str) else bytes(element)
            self.longest = max(self.longest, len(element))
            chunks += [struct.pack("<I", len(raw)), raw]
        self.file.write(b"".join(chunks))

    def copy_to(self, member: Any) -> None:
        """Write the .npy: header, then the rows (text as fixed-width, a block at a time)."""
        self.file.close()
        text = self.wire in ("string", "bytes")
        if text:
            dtype = np.dtype(f"<U{self.longest}" if self.wire == "string" else f"S{self.longest}")
        else:
            dtype = self.dtype
        header = {
            "descr": np.lib.format.dtype_to_descr(dtype),
            "fortran_order": False,
            "shape": (self.rows, *self.shape),
        }
        try:
            np.lib.format.write_array_header_1_0(member, header)
        except ValueError:  # a header too long for version 1.0
            np.lib.format.write_array_header_2_0(member, header)
        with self.path.open("rb") as fh:
            if not text:
                shutil.copyfileobj(fh, member, 1 << 20)
                return
            # a fixed-width block of at most _SPOOL_BYTES (elements are as wide as the longest)
            per_block = max(1, min(_SPOOL_ROWS, _SPOOL_BYTES // dtype.itemsize))
            for elements in _text_elements(fh, self.rows * math.prod(self.shape), per_block):
                values = [e.decode() for e in elements] if self.wire == "string" else elements
                member.write(np.array(values, dtype=dtype).view(np.uint8).data)


def _text_elements(fh: BinaryIO, count: int, per_block: int) -> Iterator[list[bytes]]:
    """A text spool's ``count`` elements back, ``per_block`` at a time."""
    batch: list[bytes] = []
    for _ in range(count):
        (size,) = struct.unpack("<I", fh.read(4))
        batch.append(fh.read(size))
        if len(batch) >= per_block:
            yield batch
            batch = []
    if batch:
        yield batch
