"""The files of a job: the input .npy/.npz read, the outputs .npz and the errors file written.

``load_inputs`` memory-maps what it can (an .npy, and an .npz's uncompressed members), so a
file larger than memory can be sent; ``write_outputs`` and ``write_errors`` write through a
temporary file renamed over the target (``AtomicFile``), so that a crash or Ctrl-C never leaves
half a file. ``FailedRequest`` is one line of the errors file; ``ErrorsFile`` writes them as
they come, so that a long run's failures are not held in memory. (The other inputs are
``producer.jobs.sources``', the other outputs ``producer.jobs.sinks``'.)
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from producer.protocol.codec import DTYPES
from producer.protocol.errors import UsageError

__all__ = [
    "AtomicFile",
    "ErrorsFile",
    "FailedRequest",
    "load_inputs",
    "write_errors",
    "write_outputs",
]


@dataclass(frozen=True, slots=True)
class FailedRequest:
    """Rows ``start:stop`` that failed: a request answered ok = false or late (WAIT_TIMEOUT,
    with its rid), or, with no rid, rows never answered: those after a late reply stopped the
    run (WAIT_TIMEOUT), never sent because Redis was full (REDIS_FULL), or left when Redis
    failed or Ctrl-C came (NOT_ANSWERED). ``stop`` is None for rows to the end of an input
    that was never read to its end (its length unknown). An input record that could not be
    read (UNREADABLE) is an entry with ``start == stop``: the row it would have been.

    ``keys``, for inputs whose rows have keys (a file's path, a line number, ``--key``), holds
    the keys of the first and the last row (None where those rows were never read)."""

    start: int
    stop: int | None
    rid: str | None
    code: str
    message: str
    keys: tuple[Any, Any] | None = None

    def as_json(self) -> str:
        """The errors file's line: start, stop, rid, code, message, and key and last_key."""
        row = {"start": self.start, "stop": self.stop, "rid": self.rid, "code": self.code}
        row["message"] = self.message
        if self.keys is not None:
            row["key"], row["last_key"] = self.keys
        return json.dumps(row, default=_json_value)


_SENDABLE = {(dt.kind, dt.itemsize) for dt in DTYPES.values()}


def load_inputs(path: Path, input_name: Callable[[], str]) -> dict[str, np.ndarray]:
    """Read .npy (one input, named by ``input_name()``) or .npz; memory-mapped where it can be."""
    if not path.is_file():
        raise UsageError(f"input file {str(path)!r} does not exist.")
    if path.suffix in (".npy", ".npz") and path.stat().st_size == 0:
        raise UsageError(f"cannot read {str(path)!r}: the file is empty.")
    try:
        if path.suffix == ".npy":
            arrays = {input_name(): np.load(path, mmap_mode="r", allow_pickle=False)}
        elif path.suffix == ".npz":
            arrays = _load_npz(path)
        else:
            raise UsageError(f"input file {str(path)!r} must end in .npy or .npz.")
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # EOF: cut short
        if "allow_pickle" in str(exc):  # numpy's word for bytes that are not an array's
            detail = f"it is not a {path.suffix} of numeric arrays (or holds Python objects)"
            raise UsageError(f"cannot read {str(path)!r}: {detail}.") from exc
        raise UsageError(f"cannot read {str(path)!r}: {exc}") from exc
    for name, array in arrays.items():
        if (array.dtype.kind, array.dtype.itemsize) not in _SENDABLE:
            raise UsageError(
                f"input {name!r} has dtype {array.dtype}, which cannot be sent; use one of "
                f"{', '.join(DTYPES)}."
            )
    return arrays


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    """Members stored uncompressed (np.savez) are memory-mapped; compressed ones are read."""
    arrays: dict[str, np.ndarray] = {}
    with zipfile.ZipFile(path) as zf, path.open("rb") as raw:
        for info in zf.infolist():
            if not info.filename.endswith(".npy"):
                continue
            name = info.filename.removesuffix(".npy")
            mapped = _mapped_member(zf, info, raw)
            arrays[name] = _read_member(zf, info) if mapped is None else mapped
    if not arrays:
        raise UsageError(f"{str(path)!r} holds no arrays.")
    return arrays


def _mapped_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, raw: Any) -> np.ndarray | None:
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    with zf.open(info) as member:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(member)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(member)
        else:
            return None
        header_len = member.tell()
    if dtype.hasobject:
        raise ValueError(f"array {info.filename!r} holds Python objects, which cannot be sent")
    raw.seek(info.header_offset)
    local = raw.read(30)
    data_at = info.header_offset + 30 + int.from_bytes(local[26:28], "little")
    data_at += int.from_bytes(local[28:30], "little") + header_len
    order: Literal["C", "F"] = "F" if fortran else "C"
    if not int(np.prod(shape)):
        return np.zeros(shape, dtype=dtype, order=order)
    return np.memmap(raw.name, dtype=dtype, mode="r", shape=shape, order=order, offset=data_at)


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> np.ndarray:
    with zf.open(info) as member:
        return np.lib.format.read_array(member, allow_pickle=False)


class AtomicFile:
    """A file written under a temporary name in ``path``'s directory, renamed over ``path`` by
    ``commit()``; ``discard()`` removes it. The file keeps the permissions of the one it
    replaces, or gets those a plain ``open`` would give a new one (0666 less the umask), never
    the temporary file's 0600."""

    def __init__(self, path: Path, *, binary: bool = True) -> None:
        self.path = path
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        self.tmp = Path(tmp)
        try:
            _set_mode(fd, path)
            self.file: Any = os.fdopen(
                fd, "wb" if binary else "w", encoding=None if binary else "utf-8"
            )
        except BaseException:
            os.close(fd)
            self.tmp.unlink(missing_ok=True)
            raise

    def commit(self) -> None:
        """Flush to disk and rename over the target."""
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Remove the temporary file; the target stays as it was."""
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def _json_value(value: Any) -> Any:
    """A key json cannot write as it is: a numpy scalar as its value, anything else as text."""
    return value.item() if isinstance(value, np.generic) else str(value)


def _write_atomic(path: Path, write: Callable[[Any], None], *, binary: bool) -> None:
    """Write through an ``AtomicFile``."""
    target = AtomicFile(path, binary=binary)
    try:
        write(target.file)
    except BaseException:
        target.discard()
        raise
    target.commit()


def _set_mode(fd: int, path: Path) -> None:
    try:
        mode = path.stat().st_mode & 0o7777
    except OSError:
        mode = 0o666 & ~_umask()
    with contextlib.suppress(OSError, AttributeError):  # a file system without chmod, say
        os.fchmod(fd, mode)


def _umask() -> int:
    """The process's umask: from /proc on Linux; elsewhere reading it means setting it, so it
    is set straight back (a moment in which another thread's new files would get 0o022)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_outputs(path: Path, outputs: Mapping[str, np.ndarray]) -> None:
    """Write the stacked outputs as one .npz (an uncompressed zip of .npy files), atomically.

    Each member is written by name rather than through ``np.savez(**outputs)``, whose own
    keyword arguments (``file``, ``allow_pickle``) would clash with outputs of those names.
    """

    def write(fh: Any) -> None:
        with zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, array in outputs.items():
                with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)

    _write_atomic(path, write, binary=True)


def write_errors(path: Path, failures: Sequence[FailedRequest]) -> None:
    """One JSON line per failed request, or per range of rows never answered: start, stop,
    rid (the request's; None for rows never answered), code, message (empty when none), and
    key and last_key for keyed inputs."""

    def write(fh: Any) -> None:
        for f in failures:
            fh.write(f.as_json() + "\n")

    _write_atomic(path, write, binary=False)


class ErrorsFile:
    """The errors file written as failures come (``write``), renamed into place by
    ``commit()`` (empty when nothing failed, so that an older run's errors never sit beside
    new outputs); ``discard()`` leaves the previous file as it was."""

    def __init__(self, path: Path) -> None:
        self._target = AtomicFile(path, binary=False)

    def write(self, failure: FailedRequest) -> None:
        self._target.file.write(failure.as_json() + "\n")

    def commit(self) -> None:
        self._target.commit()

    def discard(self) -> None:
        self._target.discard()
