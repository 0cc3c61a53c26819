"""Building replies: the same bytes as ``producer.protocol.codec.encode_reply``, faster.

A worker writes every reply, so it writes them from pieces packed once rather than building
and packing nested maps per reply; ``tests/test_replies.py`` holds it to ``encode_reply``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from producer.protocol.codec import DTYPES, ErrorInfo, ModelRef, encode_tensor

_WIRE_NAMES = {dt: name for name, dt in DTYPES.items()}  # numpy dtypes sent as they are


class ReplyEncoder:
    """Encodes one worker's replies; the parts replies share are packed once.

    Replies are written field by field from pre-packed pieces: the model and worker maps once
    per worker, each tensor's header once per (name, dtype, shape), and tensor data goes in as
    a buffer. A reply costs a few lookups and one join, not building and packing nested maps.
    """

    _MAX_HEADS = 4096

    def __init__(self, model: ModelRef, worker: str) -> None:
        self._shared = _KEY["model"] + _packb(model.as_map()) + _KEY["worker"] + _packb(worker)
        self._heads: dict[tuple[str, str, tuple[int, ...]], bytes] = {}

    def encode(
        self,
        rid: str,
        *,
        outputs: Mapping[str, np.ndarray] | None = None,
        error: ErrorInfo | None = None,
        batch_rows: int | None = None,
        timings_ms: Mapping[str, float],
        meta_raw: bytes | None = None,
    ) -> bytes:
        """One reply: ``outputs`` when ok, else ``error``; ``meta_raw`` spliced in verbatim."""
        ok = error is None
        with_rows = ok and batch_rows is not None
        count = 6 + with_rows + (meta_raw is not None)
        parts: list[bytes | memoryview] = [
            _map_header(count),
            _KEY["rid"],
            _pack_str(rid),
            _KEY["ok"],
        ]
        if ok:
            tensors = outputs or {}
            parts += [b"\xc3", _KEY["outputs"], _map_header(len(tensors))]
            for name, array in tensors.items():
                parts += self._tensor(name, array)
        else:
            assert error is not None
            detail = {"code": error.code, "message": error.message, "retryable": error.retryable}
            parts += [b"\xc2", _KEY["error"], _packb(detail)]
        parts.append(self._shared)
        if with_rows and batch_rows is not None:
            parts += [_KEY["batch_rows"], _pack_rows(batch_rows)]
        parts += [_KEY["timings_ms"], _pack_timings(timings_ms)]
        if meta_raw is not None:
            parts += [_KEY["meta"], meta_raw]
        return b"".join(parts)

    def encode_run(
        self,
        requests: Sequence[tuple[str, Mapping[str, np.ndarray], float, bytes | None]],
        *,
        batch_rows: int,
        inference_ms: float,
    ) -> list[bytes]:
        """The ok replies of one model run, each ``(rid, outputs, queued_ms, meta_raw)``: the
        bytes as ``encode`` writes them with timings ``queued`` and ``inference``, with what the
        run's replies share packed once rather than per reply."""
        middle = b"".join(
            [
                self._shared,
                _KEY["batch_rows"],
                _pack_rows(batch_rows),
                _KEY["timings_ms"],
                b"\x82",
                _PACKED_NAMES["queued"],
                b"\xcb",
            ]
        )
        inference = _PACKED_NAMES["inference"] + b"\xcb" + _FLOAT64.pack(inference_ms)
        replies = []
        for rid, outputs, queued_ms, meta_raw in requests:
            parts: list[bytes | memoryview] = [
                _OK_HEAD[meta_raw is not None],
                _pack_str(rid),
                _OK_OUTPUTS,
                _map_header(len(outputs)),
            ]
            for name, array in outputs.items():
                parts += self._tensor(name, array)
            parts += [middle, _FLOAT64.pack(queued_ms), inference]
            if meta_raw is not None:
                parts += [_KEY["meta"], meta_raw]
            replies.append(b"".join(parts))
        return replies

    def _tensor(self, name: str, array: Any) -> list[bytes | memoryview]:
        """The output's name, tensor map and bin header, packed once per (name, dtype, shape),
        then its data as a buffer (no copy when contiguous)."""
        arr = array
        if getattr(arr, "dtype", None) is not None and arr.dtype.kind in "OUS":
            return [_packb(name), _packb(encode_tensor(arr))]  # (v2) string and bytes
        if not (
            type(arr) is np.ndarray
            and arr.flags.c_contiguous
            and arr.ndim
            and arr.dtype in _WIRE_NAMES  # little-endian or native: as sent
        ):
            wire = encode_tensor(array)
            arr = np.frombuffer(wire["data"], DTYPES[wire["dtype"]]).reshape(wire["shape"])
        key = (name, arr.dtype, arr.shape)
        head = self._heads.get(key)
        if head is None:
            head = b"".join(
                [
                    _packb(name),
                    b"\x83",
                    _KEY["dtype"],
                    _PACKED_DTYPE[_WIRE_NAMES[arr.dtype]],
                    _KEY["shape"],
                    _packb(list(arr.shape)),
                    _KEY["data"],
                    _bin_header(arr.nbytes),
                ]
            )
            if len(self._heads) >= self._MAX_HEADS:
                self._heads.clear()
            self._heads[key] = head
        return [head, memoryview(arr).cast("B") if arr.size else b""]  # type: ignore[arg-type]


def _packb(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


_KEY_NAMES = ("rid", "ok", "outputs", "error", "model", "worker", "batch_rows", "timings_ms")
_KEY = {k: _packb(k) for k in (*_KEY_NAMES, "meta", "dtype", "shape", "data")}
_PACKED_DTYPE = {name: _packb(name) for name in DTYPES}
_FLOAT64 = struct.Struct(">d")


def _pack_timings(timings_ms: Mapping[str, float]) -> bytes:
    """The timings map, byte for byte as msgpack packs it, with floats packed directly."""
    parts = [_map_header(len(timings_ms))]
    for key, value in timings_ms.items():
        parts.append(_PACKED_NAMES.get(key) or _packb(key))
        parts.append(b"\xcb" + _FLOAT64.pack(value) if type(value) is float else _packb(value))
    return b"".join(parts)


_PACKED_NAMES = {k: _packb(k) for k in ("queued", "inference")}  # the timings every reply has


def _pack_str(text: str) -> bytes:
    """``text`` as msgpack packs it; a short ASCII one (a rid) without calling msgpack."""
    if len(text) < 32 and text.isascii():
        return bytes((0xA0 | len(text),)) + text.encode()
    return _packb(text)


def _pack_rows(rows: int) -> bytes:
    """A row count as msgpack packs it; under 128 it is the byte itself."""
    return bytes((rows,)) if 0 <= rows < 128 else _packb(rows)


def _map_header(n: int) -> bytes:
    return bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")


def _bin_header(n: int) -> bytes:
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


# The start of an ok reply with batch_rows, without and with meta, up to the rid's value; then
# what follows the rid up to the outputs map's header.
_OK_HEAD = (_map_header(7) + _KEY["rid"], _map_header(8) + _KEY["rid"])
_OK_OUTPUTS = _KEY["ok"] + b"\xc3" + _KEY["outputs"]
