"""Replies (contract section 3): what a reply holds, and its bytes both ways.

Encoding writes the reply map field by field from pieces packed once, rather than building
nested maps and packing them per reply: a worker writes every reply, so ``ReplyEncoder`` keeps
the pieces its replies share, and ``encode_reply`` is the same encoder used once. The bytes are
msgpack's own packing of the map (``tests/test_replies.py`` holds them to it, and
``docs/protocol.md``'s vectors pin them). ``meta`` is spliced in as it came, never re-encoded.

(v3) A reply says the ``class`` of the lane its request came from, and its ``tenant`` when it
had one (contract section 7): the last keys of the map. A worker's encoder (``labelled``) writes
``class`` ``normal`` into every reply at no cost per reply; the stream of another lane swaps
in its own with ``relabel`` as it writes the reply (``worker.redisio.stream``), so the one-lane
path costs what it did.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from producer.protocol.bounded import MAX_META_BYTES, kind_of, unpack_body
from producer.protocol.errors import WireFormatError
from producer.protocol.tensors import DTYPES, decode_tensor, encode_tensor, not_utf8
from producer.protocol.text import TEXT_DTYPES

__all__ = [
    "ErrorInfo",
    "ModelRef",
    "PipelineRef",
    "Relabel",
    "Reply",
    "ReplyEncoder",
    "check_meta_size",
    "decode_meta",
    "decode_reply",
    "encode_reply",
    "label",
    "relabel",
]


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """The ``error`` map of a failed reply."""

    code: str
    message: str
    retryable: bool = False


@dataclass(frozen=True, slots=True)
class PipelineRef:
    """(v2) The ``model.pipeline`` map of a reply: which handler pre- and post-processed."""

    handler: str  # its import path, "module:attribute"
    sha256: str  # of the handler's source file


@dataclass(frozen=True, slots=True)
class ModelRef:
    """The ``model`` map of a reply: which model file (and pipeline, when one) answered."""

    name: str
    version: str
    sha256: str
    pipeline: PipelineRef | None = None

    def as_map(self) -> dict[str, Any]:
        """The reply's ``model`` map."""
        doc: dict[str, Any] = {"name": self.name, "version": self.version, "sha256": self.sha256}
        if self.pipeline is not None:
            doc["pipeline"] = {"handler": self.pipeline.handler, "sha256": self.pipeline.sha256}
        return doc


@dataclass(frozen=True, slots=True)
class Reply:
    """One reply (contract 3). ``meta_raw`` is echoed byte for byte; ``meta`` decodes it."""

    rid: str
    ok: bool
    model: ModelRef
    worker: str
    timings_ms: dict[str, float]
    outputs: dict[str, np.ndarray] | None = None
    error: ErrorInfo | None = None
    batch_rows: int | None = None
    meta_raw: bytes | None = field(default=None, repr=False)
    # (v3) the lane's class and tenant; a reply without them (cls None) is version 2's
    cls: str | None = None
    tenant: str | None = None

    @property
    def meta(self) -> Any:
        """The request's ``meta`` value, or None when none was sent. ``meta`` may be any msgpack
        value: maps keep integer and bin keys; a map with a key Python cannot hash (an array,
        a map) comes back as a list of ``(key, value)`` pairs."""
        return None if self.meta_raw is None else decode_meta(self.meta_raw)


def decode_meta(raw: bytes) -> Any:
    """A ``meta`` value from its msgpack bytes, whatever its map keys (see ``Reply.meta``)."""
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except TypeError:  # unhashable keys: pairs instead of a dict
        return msgpack.unpackb(raw, raw=False, strict_map_key=False, object_pairs_hook=list)


def check_meta_size(meta: bytes | None) -> None:
    """After the structure is checked (a body both malformed and with a long meta is
    MALFORMED): meta is echoed in every reply, so it is kept small."""
    if meta is not None and len(meta) > MAX_META_BYTES:
        raise WireFormatError(
            f"'meta' is {len(meta)} bytes encoded; at most {MAX_META_BYTES}.", "TOO_LARGE"
        )


# ---------------------------------------------------------------------------------------------
# Encoding

_NO_DETAIL = ErrorInfo("INTERNAL", "no detail", True)


def encode_reply(reply: Reply) -> bytes:
    """Encode a reply; a failed one without ``error`` says INTERNAL, "no detail"."""
    raw = _encoder(reply.model, reply.worker).encode(
        reply.rid,
        outputs=reply.outputs if reply.ok else None,
        error=None if reply.ok else reply.error or _NO_DETAIL,
        batch_rows=reply.batch_rows,
        timings_ms=reply.timings_ms,
        meta_raw=reply.meta_raw,
    )
    if reply.cls is None:
        return raw
    return _with_fields(raw, label(reply.cls, reply.tenant), 1 + (reply.tenant is not None))


def label(cls: str, tenant: str | None = None) -> bytes:
    """(v3) The ``class`` and ``tenant`` keys that end a reply, packed."""
    packed = _packb("class") + _pack_str(cls)
    return packed if tenant is None else packed + _packb("tenant") + _pack_str(tenant)


def relabel(reply: bytes, cls: str, tenant: str | None) -> bytes:
    """A ``labelled`` encoder's ``reply`` with class ``cls`` and ``tenant`` instead of class
    normal (one copy of the reply: only replies of lanes other than the default pay it)."""
    return Relabel(cls, tenant)(reply)


class Relabel:
    """``relabel`` for one lane, its label packed once (a lane's stream keeps one)."""

    __slots__ = ("_added", "_label")

    def __init__(self, cls: str, tenant: str | None) -> None:
        self._label = label(cls, tenant)
        self._added = int(tenant is not None)

    def __call__(self, reply: bytes) -> bytes:
        if not reply.endswith(_DEFAULT_LABEL):
            raise WireFormatError("relabel takes replies of a labelled ReplyEncoder only.")
        return _with_fields(memoryview(reply)[: -len(_DEFAULT_LABEL)], self._label, self._added)


def _with_fields(reply: bytes | memoryview, packed: bytes, added: int) -> bytes:
    """``reply`` with ``added`` keys more (``packed``) at its end. A reply map has at most 10
    keys, so its header is the one byte of a fixmap."""
    head = reply[0]
    if head & 0xF0 != 0x80 or (head & 0x0F) + added > 15:
        raise WireFormatError("a reply's map must have fewer than 16 keys.")
    return b"".join([bytes((head + added,)), reply[1:], packed])


@functools.lru_cache(maxsize=8)
def _encoder(model: ModelRef, worker: str) -> ReplyEncoder:
    """The encoder for replies from ``worker``, kept for the next: the same few answer most."""
    return ReplyEncoder(model, worker)


class ReplyEncoder:
    """Encodes the replies of one model and worker; the parts replies share are packed once.

    The model and worker maps are packed once per encoder, each tensor's header once per
    (name, dtype, shape), and tensor data goes in as a buffer. A reply costs a few lookups and
    one join. A str that UTF-8 cannot encode raises ``WireFormatError`` (INVALID_INPUT).
    """

    _MAX_HEADS = 4096

    def __init__(self, model: ModelRef, worker: str, *, labelled: bool = False) -> None:
        try:
            self._shared = _KEY["model"] + _packb(model.as_map()) + _KEY["worker"] + _packb(worker)
        except UnicodeEncodeError as exc:
            raise not_utf8("reply", exc) from exc
        self._heads: dict[tuple[str, np.dtype[Any], tuple[int, ...]], bytes] = {}
        # (v3) ``labelled``: every reply ends with class normal (``relabel`` swaps it)
        self._label = _DEFAULT_LABEL if labelled else b""
        extra = int(labelled)
        self._ok_head = (
            _map_header(7 + extra) + _KEY["rid"],
            _map_header(8 + extra) + _KEY["rid"],
        )
        self._extra = extra

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
        count = 6 + with_rows + (meta_raw is not None) + self._extra
        try:
            parts: list[bytes | memoryview] = [
                _map_header(count),
                _KEY["rid"],
                _pack_str(rid),
                _KEY["ok"],
            ]
            if error is None:
                tensors = outputs or {}
                parts += [b"\xc3", _KEY["outputs"], _map_header(len(tensors))]
                for name, array in tensors.items():
                    parts += self._tensor(name, array)
            else:
                detail = {
                    "code": error.code,
                    "message": error.message,
                    "retryable": error.retryable,
                }
                parts += [b"\xc2", _KEY["error"], _packb(detail)]
            parts.append(self._shared)
            if with_rows and batch_rows is not None:
                parts += [_KEY["batch_rows"], _pack_rows(batch_rows)]
            parts += [_KEY["timings_ms"], _pack_timings(timings_ms)]
        except UnicodeEncodeError as exc:
            raise not_utf8("reply", exc) from exc
        if meta_raw is not None:
            parts += [_KEY["meta"], meta_raw]
        parts.append(self._label)
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
        head, label = self._ok_head, self._label
        replies = []
        try:
            for rid, outputs, queued_ms, meta_raw in requests:
                parts: list[bytes | memoryview] = [
                    head[meta_raw is not None],
                    _pack_str(rid),
                    _OK_OUTPUTS,
                    _map_header(len(outputs)),
                ]
                for name, array in outputs.items():
                    parts += self._tensor(name, array)
                parts += [middle, _FLOAT64.pack(queued_ms), inference]
                if meta_raw is not None:
                    parts += [_KEY["meta"], meta_raw]
                parts.append(label)
                replies.append(b"".join(parts))
        except UnicodeEncodeError as exc:
            raise not_utf8("reply", exc) from exc
        return replies

    def tensor_bytes(self, name: str, array: Any) -> int:
        """The bytes output ``name`` takes in a reply, header included: what bounds a reply
        (worker/answer/replybound.py) is known before the reply is joined."""
        return sum(len(part) for part in self._tensor(name, array))

    def _tensor(self, name: str, array: Any) -> list[bytes | memoryview]:
        """The output's name, tensor map and bin header, packed once per (name, dtype, shape),
        then its data as a buffer (no copy when contiguous)."""
        arr = array
        if not (
            type(arr) is np.ndarray
            and arr.flags.c_contiguous
            and arr.ndim
            and arr.dtype in _WIRE_NAMES  # little-endian or native: as sent
        ):
            wire = encode_tensor(array)
            if wire["dtype"] in TEXT_DTYPES:  # (v2) string and bytes: elements, not a buffer
                return [_packb(name), _packb(wire)]
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


_WIRE_NAMES = {dt: name for name, dt in DTYPES.items()}  # numpy dtypes sent as they are
_KEY_NAMES = ("rid", "ok", "outputs", "error", "model", "worker", "batch_rows", "timings_ms")
_KEY = {k: _packb(k) for k in (*_KEY_NAMES, "meta", "dtype", "shape", "data")}
_PACKED_DTYPE = {name: _packb(name) for name in DTYPES}
_PACKED_NAMES = {k: _packb(k) for k in ("queued", "inference")}  # the timings every reply has
_FLOAT64 = struct.Struct(">d")


def _pack_timings(timings_ms: Mapping[str, float]) -> bytes:
    """The timings map, byte for byte as msgpack packs it, with floats packed directly."""
    parts = [_map_header(len(timings_ms))]
    for key, value in timings_ms.items():
        parts.append(_PACKED_NAMES.get(key) or _packb(key))
        parts.append(b"\xcb" + _FLOAT64.pack(value) if type(value) is float else _packb(value))
    return b"".join(parts)


def _pack_str(text: str) -> bytes:
    """``text`` as msgpack packs it; a short ASCII one (a rid) without calling msgpack."""
    if type(text) is str and len(text) < 32 and text.isascii():
        return bytes((0xA0 | len(text),)) + text.encode()
    return _packb(text)


def _pack_rows(rows: int) -> bytes:
    """A row count as msgpack packs it; under 128 it is the byte itself."""
    return bytes((rows,)) if type(rows) is int and 0 <= rows < 128 else _packb(rows)


def _map_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x80 | n,))
    return b"\xde" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdf" + n.to_bytes(4, "big")


def _bin_header(n: int) -> bytes:
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


# What follows an ok reply's rid up to the outputs map's header.
_OK_OUTPUTS = _KEY["ok"] + b"\xc3" + _KEY["outputs"]

#: What ends every reply of a ``labelled`` encoder: class normal, no tenant.
_DEFAULT_LABEL = label("normal")


# ---------------------------------------------------------------------------------------------
# Decoding


def decode_reply(raw: bytes) -> Reply:
    """Decode a reply element; raises WireFormatError when it is not a contract reply."""
    doc, meta_raw = unpack_body(raw, len(raw), "reply")
    check_meta_size(meta_raw)
    if not isinstance(doc, dict):
        raise WireFormatError(f"reply must be a map, got {kind_of(doc)}.")
    try:
        model = doc["model"]
        outputs = None
        error = None
        if doc["ok"]:
            outputs = {
                name: decode_tensor(t, f"output {name!r}") for name, t in doc["outputs"].items()
            }
        else:
            e = doc["error"]
            error = ErrorInfo(str(e["code"]), str(e["message"]), bool(e["retryable"]))
        return Reply(
            rid=str(doc["rid"]),
            ok=bool(doc["ok"]),
            model=_model_ref(model),
            worker=str(doc["worker"]),
            timings_ms={str(k): float(v) for k, v in doc["timings_ms"].items()},
            outputs=outputs,
            error=error,
            batch_rows=doc.get("batch_rows"),
            meta_raw=meta_raw,
            cls=_optional_str(doc.get("class")),
            tenant=_optional_str(doc.get("tenant")),
        )
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise WireFormatError(f"reply is missing or mistypes a field: {exc!r}.") from exc


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _model_ref(model: dict[str, Any]) -> ModelRef:
    pipeline = model.get("pipeline")
    return ModelRef(
        str(model["name"]),
        str(model["version"]),
        str(model["sha256"]),
        None
        if pipeline is None
        else PipelineRef(str(pipeline["handler"]), str(pipeline["sha256"])),
    )
