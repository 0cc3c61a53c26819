"""The wire format: pure encode/decode of tensors, request bodies and replies (contract 2 and 3).

No I/O lives here, so every other language's implementation can be checked against these
functions and the test vectors in ``docs/protocol.md``. Decoding is strict: any structural fault
raises ``WireFormatError`` (code ``MALFORMED``, or ``TOO_LARGE`` for size limits), whose message
says what is wrong and where. Tensor data is never copied on decode (``numpy.frombuffer``).

A hostile body costs little more than its own size: the size limit comes first, the values it
declares are counted from its headers before the unpacker builds any (``MAX_VALUES``; at 1 KiB
or less its containers are capped at its length instead), shapes are checked against the data
length before an array exists, and error messages quote at most a hundred characters of what
was sent.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import reprlib
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from producer.errors import WireFormatError

__all__ = [
    "DTYPES",
    "MAX_META_BYTES",
    "MAX_RANK",
    "MAX_VALUES",
    "BodySpans",
    "ErrorInfo",
    "ModelRef",
    "Reply",
    "ReplyEncoder",
    "RequestBody",
    "body_spans",
    "decode_reply",
    "decode_request",
    "decode_tensor",
    "encode_reply",
    "encode_request",
    "encode_tensor",
    "pack_meta",
]

#: Contract dtype names to little-endian numpy dtypes.
DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "bool",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
}
_NAME_OF_KIND = {(dt.kind, dt.itemsize): name for name, dt in DTYPES.items()}
_WIRE_NAMES = {dt: name for name, dt in DTYPES.items()}  # numpy dtypes sent as they are

MAX_META_BYTES = 4096
MAX_RANK = 32
# Bounds that keep a hostile body from making the unpacker allocate: no body needs more.
_MAX_CONTAINER_LEN = 4096
_MAX_STR_LEN = 65536
# Values a body may declare in all: a thousand inputs of rank 32 and 4 KiB of meta fit. Each value
# the unpacker builds costs up to ~70 bytes (an empty list), so this caps it near 5 MB.
MAX_VALUES = 1 << 16
_MAX_QUOTE = 100  # characters of a hostile value quoted in an error message

_BODY_KEYS = frozenset({"inputs", "outputs", "deadline_ms", "meta", "reply_ttl_s"})
_TENSOR_KEYS = frozenset({"dtype", "shape", "data"})


@dataclass(frozen=True, slots=True)
class RequestBody:
    """A decoded request body; ``meta_raw`` is the meta value's exact msgpack bytes."""

    inputs: dict[str, np.ndarray]
    outputs: tuple[str, ...] | None = None
    deadline_ms: int | None = None
    meta_raw: bytes | None = None
    reply_ttl_s: int | None = None


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """The ``error`` map of a failed reply."""

    code: str
    message: str
    retryable: bool = False


@dataclass(frozen=True, slots=True)
class ModelRef:
    """The ``model`` map of a reply: which model file answered."""

    name: str
    version: str
    sha256: str


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

    @property
    def meta(self) -> Any:
        """The request's ``meta`` value, or None when none was sent."""
        return None if self.meta_raw is None else msgpack.unpackb(self.meta_raw, raw=False)


# ---------------------------------------------------------------------------------------------
# Tensors


def encode_tensor(array: Any) -> dict[str, Any]:
    """Return the wire map for an array: little-endian, C order, without copying when it can."""
    arr = np.asarray(array)
    name = _NAME_OF_KIND.get((arr.dtype.kind, arr.dtype.itemsize))
    if name is None:
        raise WireFormatError(
            f"dtype {arr.dtype} cannot be sent; use one of {', '.join(DTYPES)}.", "INVALID_INPUT"
        )
    arr = np.require(arr, dtype=DTYPES[name], requirements="C")  # keeps 0-d arrays 0-d
    data = memoryview(arr).cast("B") if arr.size else b""  # type: ignore[arg-type]
    return {"dtype": name, "shape": list(arr.shape), "data": data}


def decode_tensor(obj: Any, where: str) -> np.ndarray:
    """Check a decoded wire map and view its data as an array; ``where`` names it in errors."""
    if not isinstance(obj, dict):
        raise WireFormatError(f"{where}: a tensor must be a map, got {_kind(obj)}.")
    if obj.keys() != _TENSOR_KEYS:
        missing = _TENSOR_KEYS - obj.keys()
        if missing:
            raise WireFormatError(f"{where}: tensor is missing {_names(missing)}.")
        raise WireFormatError(
            f"{where}: tensor has unknown key {_names(obj.keys() - _TENSOR_KEYS)}."
        )
    dtype_name = obj["dtype"]
    dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise WireFormatError(
            f"{where}: unknown dtype {_quote(dtype_name)}; expected one of {', '.join(DTYPES)}."
        )
    shape = _check_shape(obj["shape"], where)
    data = obj["data"]
    if not isinstance(data, bytes):
        raise WireFormatError(f"{where}: data must be msgpack bin, got {_kind(data)}.")
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise WireFormatError(
            f"{where}: data has {len(data)} bytes but shape {shape} of {dtype_name} "
            f"needs {expected}."
        )
    if dtype_name == "bool" and data and np.frombuffer(data, np.uint8).max() > 1:
        raise WireFormatError(f"{where}: bool data must hold only bytes 0 and 1.")
    try:
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    except ValueError as exc:  # a 0-sized shape whose other dims are too large for numpy
        raise WireFormatError(f"{where}: shape {shape} is too large to hold.") from exc


def _check_shape(shape: Any, where: str) -> list[int]:
    if not isinstance(shape, list):
        raise WireFormatError(f"{where}: shape must be an array of integers, got {_kind(shape)}.")
    if len(shape) > MAX_RANK:
        raise WireFormatError(f"{where}: shape has {len(shape)} dimensions; at most {MAX_RANK}.")
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise WireFormatError(
                f"{where}: shape {_quote(shape)} must hold non-negative integers only."
            )
    return shape


# ---------------------------------------------------------------------------------------------
# Requests


def encode_request(
    inputs: Mapping[str, Any],
    *,
    outputs: Sequence[str] | None = None,
    deadline_ms: int | None = None,
    meta: Any = None,
    reply_ttl_s: int | None = None,
) -> bytes:
    """Encode a request body; optional keys are left out when None."""
    if not inputs:
        raise WireFormatError("a request needs at least one input.", "INVALID_INPUT")
    body: dict[str, Any] = {"inputs": {name: encode_tensor(a) for name, a in inputs.items()}}
    if outputs is not None:
        body["outputs"] = list(outputs)
    if deadline_ms is not None:
        body["deadline_ms"] = int(deadline_ms)
    if meta is not None:
        body["meta"] = meta
    if reply_ttl_s is not None:
        body["reply_ttl_s"] = int(reply_ttl_s)
    return msgpack.packb(body, use_bin_type=True)


def decode_request(body: bytes, max_bytes: int) -> RequestBody:
    """Decode and check a request body; the size limit is applied before any decoding."""
    if len(body) > max_bytes:
        raise WireFormatError(
            f"body is {len(body)} bytes, over max_request_bytes={max_bytes}.", "TOO_LARGE"
        )
    try:
        doc, meta_raw = _unpack_body(body, max_bytes, "body")
        if not isinstance(doc, dict):
            raise WireFormatError(f"body must be a map, got {_kind(doc)}.")
        request = _request(doc, meta_raw)
        _check_meta_size(meta_raw)
        return request
    except WireFormatError as exc:
        # A body that is a map still names its meta and reply TTL: the error reply keeps them
        exc.meta_raw, exc.reply_ttl_s = _readable_extras(body, max_bytes)
        raise


def _request(doc: dict[str, Any], meta_raw: bytes | None) -> RequestBody:
    """Check a body's map (meta already sliced out) and build the request."""
    extra = doc.keys() - _BODY_KEYS
    if extra:
        odd = [key for key in extra if not isinstance(key, str)]
        if odd:
            raise WireFormatError(_key_error("body", odd[0]))
        raise WireFormatError(f"body has unknown key {_names(extra)}.")
    if "inputs" not in doc:
        raise WireFormatError("body is missing 'inputs'.")
    raw_inputs = doc["inputs"]
    if not isinstance(raw_inputs, dict) or not raw_inputs:
        raise WireFormatError("'inputs' must be a non-empty map of input name to tensor.")
    for name in raw_inputs:
        if not isinstance(name, str):
            raise WireFormatError(f"input names must be strings; got {_kind(name)} {_quote(name)}.")
    inputs = {name: decode_tensor(t, _input_where(name)) for name, t in raw_inputs.items()}
    return RequestBody(
        inputs=inputs,
        outputs=_optional_names(doc.get("outputs")),
        deadline_ms=_optional_int(doc, "deadline_ms", minimum=0),
        meta_raw=meta_raw,
        reply_ttl_s=_optional_int(doc, "reply_ttl_s", minimum=1),
    )


def _input_where(name: str) -> str:
    """How errors name an input: quoted, and cut short when a hostile name is long."""
    quoted = repr(name) if len(name) <= _MAX_QUOTE else ""
    return f"input {quoted if 0 < len(quoted) <= _MAX_QUOTE else _quote(name)}"


@dataclass(frozen=True, slots=True)
class BodySpans:
    """Where the per-request values lie in a body that ``decode_request`` accepted.

    ``data``: input name to (offset, length) of its ``data`` bin's payload. ``deadline``:
    (offset, width, signed) of the payload of ``deadline_ms`` when it is a 32- or 64-bit integer
    (its type byte fixes its width), else None. A worker keeps the rest of the body to admit later
    bodies that differ only there without decoding them (``worker.layouts``).
    """

    data: dict[str, tuple[int, int]]
    deadline: tuple[int, int, bool] | None


def body_spans(body: bytes) -> BodySpans:
    """The spans of a body that ``decode_request`` accepted (see ``BodySpans``)."""
    unpacker = _unpacker(len(body))
    unpacker.feed(body)
    data: dict[str, tuple[int, int]] = {}
    deadline: tuple[int, int, bool] | None = None
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        payload = _INT_PAYLOADS.get(body[unpacker.tell()])
        if key == "deadline_ms" and payload is not None:
            deadline = (unpacker.tell() + 1, *payload)
        if key != "inputs":
            unpacker.skip()
            continue
        for _ in range(unpacker.read_map_header()):
            name = unpacker.unpack()
            for _ in range(unpacker.read_map_header()):
                key = unpacker.unpack()
                start = unpacker.tell()
                unpacker.skip()
                if key == "data":
                    data[name] = _bin_payload(body, start)
    return BodySpans(data, deadline)


def _bin_payload(body: bytes, start: int) -> tuple[int, int]:
    """(offset, length) of the payload of the msgpack bin whose header is at ``start``."""
    width = _BIN_WIDTHS[body[start]]
    return start + 1 + width, int.from_bytes(body[start + 1 : start + 1 + width], "big")


# msgpack integer types whose payload may hold any value of its width: (width, signed)
_INT_PAYLOADS = {0xCE: (4, False), 0xCF: (8, False), 0xD2: (4, True), 0xD3: (8, True)}
_BIN_WIDTHS = {0xC4: 1, 0xC5: 2, 0xC6: 4}


def _optional_names(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise WireFormatError(
            f"'outputs' must be an array of output names (strings), got {_quote(value)}."
        )
    return tuple(value)


def _optional_int(doc: dict[str, Any], key: str, minimum: int) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if type(value) is not int or value < minimum:
        raise WireFormatError(f"'{key}' must be an integer >= {minimum}, got {_quote(value)}.")
    return value


def pack_meta(meta: Any) -> bytes | None:
    """Encode a meta value as it travels; None stays None."""
    return None if meta is None else msgpack.packb(meta, use_bin_type=True)


# ---------------------------------------------------------------------------------------------
# Replies


def encode_reply(reply: Reply) -> bytes:
    """Encode a reply map; meta bytes are spliced in as they came, never re-encoded."""
    return ReplyEncoder(reply.model, reply.worker).encode(
        reply.rid,
        outputs=reply.outputs if reply.ok else None,
        error=None if reply.ok else reply.error or ErrorInfo("INTERNAL", "no detail", True),
        batch_rows=reply.batch_rows,
        timings_ms=reply.timings_ms,
        meta_raw=reply.meta_raw,
    )


class ReplyEncoder:
    """Encodes one worker's replies; the parts replies share are packed once.

    Replies are written field by field from pre-packed pieces: the model and worker maps once
    per worker, each tensor's header once per (name, dtype, shape), and tensor data goes in as
    a buffer. A reply costs a few lookups and one join, not building and packing nested maps.
    """

    _MAX_HEADS = 4096

    def __init__(self, model: ModelRef, worker: str) -> None:
        model_map = {"name": model.name, "version": model.version, "sha256": model.sha256}
        self._shared = _KEY["model"] + _packb(model_map) + _KEY["worker"] + _packb(worker)
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


def decode_reply(raw: bytes) -> Reply:
    """Decode a reply element; raises WireFormatError when it is not a contract reply."""
    doc, meta_raw = _unpack_body(raw, len(raw), "reply")
    _check_meta_size(meta_raw)
    if not isinstance(doc, dict):
        raise WireFormatError(f"reply must be a map, got {_kind(doc)}.")
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
            model=ModelRef(str(model["name"]), str(model["version"]), str(model["sha256"])),
            worker=str(doc["worker"]),
            timings_ms={str(k): float(v) for k, v in doc["timings_ms"].items()},
            outputs=outputs,
            error=error,
            batch_rows=doc.get("batch_rows"),
            meta_raw=meta_raw,
        )
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise WireFormatError(f"reply is missing or mistypes a field: {exc!r}.") from exc


# ---------------------------------------------------------------------------------------------
# msgpack, with limits


@functools.lru_cache(maxsize=64)
def _limits(max_bytes: int, max_container_len: int = _MAX_CONTAINER_LEN) -> dict[str, Any]:
    """Unpacker options that bound what a hostile body can make the decoder allocate."""
    return {
        "raw": False,
        # Keys are checked where they matter (body, inputs, tensors); meta may use any key.
        "strict_map_key": False,
        "object_pairs_hook": _unique_map,
        "ext_hook": _no_ext,
        "max_bin_len": max_bytes,
        "max_str_len": min(max_bytes, _MAX_STR_LEN),
        "max_array_len": max_container_len,
        "max_map_len": max_container_len,
        "max_ext_len": 0,
    }


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """Build a map, refusing repeated keys (which would let two readers see different values)."""
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("a map repeats a key")
    return result


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"ext type {code} is not accepted")


def _unpacker(max_bytes: int) -> msgpack.Unpacker:
    return msgpack.Unpacker(max_buffer_size=max(max_bytes, 1), **_limits(max_bytes))


def _unpack(data: bytes, max_bytes: int, what: str) -> Any:
    limits = _checked_limits(data, max_bytes, what)
    with _msgpack_errors(what):
        return msgpack.unpackb(data, **limits)


def _unpack_body(data: bytes, max_bytes: int, what: str) -> tuple[Any, bytes | None]:
    """Unpack a body or reply and slice out its top-level ``meta``: (value, meta bytes or None).

    ``meta`` is only ever echoed, so it may be any msgpack value (ext types such as timestamps,
    any keys, repeated keys, any string bytes), as the contract has it, which the strict
    unpacker refuses. Most bodies pass it, at its speed; one it refuses is unpacked again pair
    by pair with ``meta`` skipped (``_unpack_map``), which also names the fault precisely.
    """
    try:
        doc = _unpack(data, max_bytes, what)
    except WireFormatError:
        if not _is_map(data):
            raise
        return _unpack_map(data, max_bytes, what)
    return doc, (_meta_span(data, max_bytes) if isinstance(doc, dict) and "meta" in doc else None)


def _is_map(data: bytes) -> bool:
    return bool(data) and (0x80 <= data[0] <= 0x8F or data[0] in (0xDE, 0xDF))


def _meta_span(data: bytes, max_bytes: int) -> bytes:
    """The top-level meta value's own bytes, sliced out of a map the unpacker accepted."""
    unpacker = msgpack.Unpacker(max_buffer_size=len(data), **_limits(max_bytes))
    unpacker.feed(data)
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        start = unpacker.tell()
        unpacker.skip()
        if key == "meta":
            return data[start : unpacker.tell()]
    raise AssertionError("meta key vanished between two parses")  # pragma: no cover


def _check_meta_size(meta: bytes | None) -> None:
    """After the structure is checked (a body both malformed and with a long meta is
    MALFORMED): meta is echoed in every reply, so it is kept small."""
    if meta is not None and len(meta) > MAX_META_BYTES:
        raise WireFormatError(
            f"'meta' is {len(meta)} bytes encoded; at most {MAX_META_BYTES}.", "TOO_LARGE"
        )


_EXTRAS_READ = 4096


def _readable_extras(body: bytes, max_bytes: int) -> tuple[bytes | None, int | None]:
    """The meta bytes (at most MAX_META_BYTES) and valid reply_ttl_s of a body that failed,
    read past whatever broke elsewhere, for its error reply; None where unreadable.

    It runs on every refused body, hostile ones included, so it builds only short str keys
    and an int TTL (anything else is skipped, which builds nothing), looks at the first
    ``_EXTRAS_PAIRS`` pairs only, and reads nothing of a body whose headers declare more values
    than any body needs.
    """
    if not _is_map(body):
        return None, None
    if len(body) > _SMALL:
        try:
            _check_declared(body, "body")
        except WireFormatError:
            return None, None
    unpacker = msgpack.Unpacker(
        io.BytesIO(body),  # read in small steps: a long body is not copied whole at once
        read_size=_EXTRAS_READ,
        max_buffer_size=max(len(body), _EXTRAS_READ),
        **_limits(max_bytes),
    )
    meta: bytes | None = None
    ttl: int | None = None
    # IndexError: a body that ends where a key or value should begin
    with contextlib.suppress(ValueError, TypeError, IndexError, msgpack.UnpackException):
        for _ in range(min(unpacker.read_map_header(), _EXTRAS_PAIRS)):
            key: Any = None
            if body[unpacker.tell()] in _SHORT_STR:
                key = unpacker.unpack()
            else:
                unpacker.skip()  # a key no body has: built, it could be anything
            start = unpacker.tell()
            if key == "reply_ttl_s" and body[start] in _INT_HEADS:
                value = unpacker.unpack()
                ttl = value if type(value) is int and value >= 1 else None
                continue
            unpacker.skip()
            if key == "meta" and meta is None and unpacker.tell() - start <= MAX_META_BYTES:
                meta = _complete_or_none(body[start : unpacker.tell()])
    return meta, ttl


_EXTRAS_PAIRS = 16  # a body has five keys; a few unknown ones may come first
_SHORT_STR = frozenset(range(0xA0, 0xC0)) | {0xD9}  # fixstr and str 8: every body key fits
_INT_HEADS = frozenset(range(0x00, 0x80)) | frozenset(range(0xCC, 0xD4))


def _complete_or_none(meta: bytes) -> bytes | None:
    """``meta`` if it is one complete msgpack value: msgpack's skip accepts some headers that
    declare more bytes than follow (an ext 32 of 4 GiB), which no other decoder would read
    back from the reply. Unpacked leniently (any keys, repeats, ext, non-UTF-8): it is small."""
    try:
        msgpack.unpackb(
            meta,
            raw=True,
            strict_map_key=False,
            object_pairs_hook=list,
            ext_hook=lambda code, data: None,
            max_bin_len=len(meta),
            max_str_len=len(meta),
            max_ext_len=len(meta),
            max_array_len=len(meta),
            max_map_len=len(meta),
        )
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    return meta


def _unpack_map(data: bytes, max_bytes: int, what: str) -> tuple[Any, bytes | None]:
    """``_unpack_body``'s second pass: the top-level map pair by pair, ``meta`` skipped over
    (nothing built) and sliced out; every other value as strict as ever."""
    limits = _checked_limits(data, max_bytes, what)
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(data), 1), **limits)
    unpacker.feed(data)
    doc: dict[Any, Any] = {}
    meta: bytes | None = None
    with _msgpack_errors(what):
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if not isinstance(key, str):
                raise WireFormatError(_key_error(what, key))
            if key in doc or (key == "meta" and meta is not None):
                raise ValueError(f"a map repeats the key {_quote(key)}")
            if key == "meta":
                start = unpacker.tell()
                unpacker.skip()
                meta = data[start : unpacker.tell()]
                if len(meta) <= MAX_META_BYTES and _complete_or_none(meta) is None:
                    raise ValueError("'meta' declares more bytes than the body holds")
            else:
                doc[key] = unpacker.unpack()
        if unpacker.tell() != len(data):
            raise ValueError(f"{len(data) - unpacker.tell()} trailing bytes after the {what}'s map")
    return doc, meta


def _key_error(what: str, key: Any) -> str:
    if isinstance(key, bytes):
        return (
            f"{what} keys must be msgpack str, got bin {_quote(key)}; turn on your msgpack "
            "library's str/bin distinction (e.g. use_bin_type=True)."
        )
    return f"{what} keys must be msgpack str, got {_kind(key)} {_quote(key)}."


def _checked_limits(data: bytes, max_bytes: int, what: str) -> dict[str, Any]:
    if len(data) > _SMALL:
        _check_declared(data, what)
        return _limits(max_bytes)
    return _limits(max_bytes, max(len(data), 1))


@contextlib.contextmanager
def _msgpack_errors(what: str) -> Iterator[None]:
    """msgpack's errors as MALFORMED, worded for a person rather than as the library's names."""
    try:
        yield
    except msgpack.StackError as exc:
        raise WireFormatError(f"{what} is nested too deeply to be msgpack we accept.") from exc
    except msgpack.OutOfData as exc:
        raise WireFormatError(f"{what} is not valid msgpack: it ends inside a value.") from exc
    except msgpack.FormatError as exc:
        raise WireFormatError(
            f"{what} is not valid msgpack: it holds a byte that begins no msgpack value."
        ) from exc
    except (ValueError, TypeError) as exc:
        # msgpack's other errors derive from ValueError; their text says what broke.
        detail = str(exc).rstrip(".") or type(exc).__name__
        if isinstance(exc, TypeError) and "unhashable" in detail:
            detail = "a map key is an array or a map"
        elif "max_ext_len" in detail:
            detail = "an ext type (such as a timestamp) is accepted only inside 'meta'"
        raise WireFormatError(f"{what} is not valid msgpack: {detail}.") from exc


_KINDS: dict[type, str] = {bytes: "bin", str: "string", dict: "map", list: "array"}


def _kind(value: Any) -> str:
    return _KINDS.get(type(value), type(value).__name__)


def _names(keys: Any) -> str:
    names = sorted(keys, key=lambda k: str(k)[:_MAX_QUOTE])
    listed = ", ".join(_quote(k) for k in names[:5])
    return listed if len(names) <= 5 else f"{listed} and {len(names) - 5} more"


class _ShortRepr(reprlib.Repr):
    """``repr`` cut short, bytes too: a hostile value must not make a reply outgrow its request."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxdict = 2, 8, 4
        self.maxstring = self.maxother = self.maxlong = _MAX_QUOTE

    def repr_bytes(self, value: bytes, level: int) -> str:
        text = repr(value[: self.maxstring])
        return text if len(value) <= self.maxstring else text + "..."


_quote = _ShortRepr().repr


# At most this many bytes, msgpack we unpack is not walked first (_check_declared): with no
# container longer than the data, the unpacker can hold at most a container of that length per
# nesting level, and a body this small nests at most a third of it deep (three-byte headers):
# 2.8 MB for a hostile 1 KiB. Most replies and many bodies are this small, and the walk was a
# quarter of decoding them.
_SMALL = 1024


def _check_declared(data: bytes, what: str) -> None:
    """Refuse msgpack that declares more values than its bytes hold or than any body needs.

    The unpacker allocates a container's slots when it reads its header, and an empty list is one
    byte on the wire but ~70 in memory, so ``[[]] * 4096`` nested or repeated makes a small body
    cost gigabytes and seconds. Walking headers (payloads are skipped, not read) first bounds both
    by ``MAX_VALUES``, at a few microseconds per ordinary body. Anything else wrong is left to the
    unpacker, which names it.
    """
    limit = min(MAX_VALUES, len(data))
    declared = _declared_values(data, limit)
    if declared > len(data):
        raise WireFormatError(
            f"{what} is not valid msgpack: it declares more values than its {len(data)} bytes hold."
        )
    if declared > limit:
        raise WireFormatError(
            f"{what} holds more than {MAX_VALUES} msgpack values; none needs that."
        )


def _declared_values(data: bytes, limit: int) -> int:
    """Count the values the first msgpack object in ``data`` declares, stopping past ``limit``."""
    pos, pending, count, end, heads = 0, 1, 0, len(data), _HEADS
    while pending and pos < end:
        head = heads[data[pos]]
        if head is None:  # 0xc1, never used: the unpacker reports it
            break
        size, width, per_byte, per_child, children = head
        if width:
            n = int.from_bytes(data[pos + 1 : pos + 1 + width], "big")
            size += n * per_byte
            children += n * per_child
        pos += size
        count += children
        if count > limit:
            break
        pending += children - 1
    return count


def _head_table() -> tuple[tuple[int, int, int, int, int] | None, ...]:
    """Per first byte: (size, length width, bytes per length unit, values per unit, values)."""
    heads: list[tuple[int, int, int, int, int] | None] = [(1, 0, 0, 0, 0)] * 256  # fixint, nil..
    for b in range(0x80, 0x90):
        heads[b] = (1, 0, 0, 0, 2 * (b & 0x0F))  # fixmap
    for b in range(0x90, 0xA0):
        heads[b] = (1, 0, 0, 0, b & 0x0F)  # fixarray
    for b in range(0xA0, 0xC0):
        heads[b] = (1 + (b & 0x1F), 0, 0, 0, 0)  # fixstr
    heads[0xC1] = None
    for b, width in ((0xC4, 1), (0xC5, 2), (0xC6, 4), (0xD9, 1), (0xDA, 2), (0xDB, 4)):
        heads[b] = (1 + width, width, 1, 0, 0)  # bin, str
    for b, width in ((0xC7, 1), (0xC8, 2), (0xC9, 4)):
        heads[b] = (2 + width, width, 1, 0, 0)  # ext: length, type, data
    fixed = {0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5}
    fixed |= {0xD3: 9, 0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18}  # int, float, fixext
    for b, size in fixed.items():
        heads[b] = (size, 0, 0, 0, 0)
    for b, width, per_child in ((0xDC, 2, 1), (0xDD, 4, 1), (0xDE, 2, 2), (0xDF, 4, 2)):
        heads[b] = (1 + width, width, 0, per_child, 0)  # array, map
    return tuple(heads)


_HEADS = _head_table()
