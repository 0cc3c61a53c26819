"""The wire format: pure encode/decode of tensors, request bodies and replies (contract 2 and 3).

No I/O lives here, so every other language's implementation can be checked against these
functions and the test vectors in ``docs/protocol.md``. Decoding is strict: any structural fault
raises ``WireFormatError`` (code ``MALFORMED``, or ``TOO_LARGE`` for size limits), whose message
says what is wrong and where. Tensor data is never copied on decode (``numpy.frombuffer``).

Reading is bounded by ``producer.protocol.bounded``, so a hostile body costs little more than its
own size. The worker's fast paths (``worker.answer.replies``, ``worker.intake.spans``) live in the
worker.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from producer.protocol.bounded import (
    _MAX_QUOTE,
    MAX_META_BYTES,
    MAX_RANK,
    MAX_VALUES,
    _key_error,
    _kind,
    _names,
    _quote,
    _readable_extras,
    _unpack_body,
)
from producer.protocol.errors import WireFormatError
from producer.protocol.text import (
    BYTES,
    STRING,
    as_text_tensor,
    decode_text,
    text_elements,
    text_name,
)
from producer.protocol.text import TEXT_DTYPES as _TEXT_DTYPES

__all__ = [
    "BYTES",
    "DTYPES",
    "MAX_META_BYTES",
    "MAX_NAME_CHARS",
    "MAX_RANK",
    "MAX_VALUES",
    "STRING",
    "WIRE_DTYPES",
    "ErrorInfo",
    "ModelRef",
    "PipelineRef",
    "Reply",
    "RequestBody",
    "as_tensor",
    "decode_meta",
    "decode_reply",
    "decode_request",
    "decode_tensor",
    "encode_reply",
    "encode_request",
    "encode_tensor",
    "pack_meta",
    "wire_dtype",
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

#: Every dtype name the wire carries, numeric first.
WIRE_DTYPES: tuple[str, ...] = (*DTYPES, "string", "bytes")


# Input and output names (and dtype names) longer than this are refused: no model has them, and
# errors quote names. Only the elements of string tensors may be long strings.
MAX_NAME_CHARS = 1024

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


# ---------------------------------------------------------------------------------------------
# Tensors


def wire_dtype(arr: np.ndarray) -> str | None:
    """The wire name of ``arr``'s dtype, or None when the wire cannot carry it. An object array
    without a wire name in its dtype is named by its first element (``str`` or ``bytes``)."""
    kind = arr.dtype.kind
    if kind in "USO":
        return text_name(arr)
    return _NAME_OF_KIND.get((kind, arr.dtype.itemsize))


def as_tensor(value: Any) -> np.ndarray:
    """``value`` as the array it is sent as. A ``str`` or ``bytes`` (or a nested list of them)
    becomes a ``string`` or ``bytes`` tensor (``producer.protocol.text``); never through
    ``np.asarray``, whose fixed-width byte strings drop trailing NUL bytes."""
    if isinstance(value, np.ndarray):
        return value
    text = as_text_tensor(value)
    return np.asarray(value) if text is None else text


def encode_tensor(array: Any) -> dict[str, Any]:
    """Return the wire map for an array: little-endian, C order, without copying when it can.
    ``string`` and ``bytes`` tensors carry their elements as a msgpack array of str or bin."""
    arr = as_tensor(array)
    name = wire_dtype(arr)
    if name is None:
        raise WireFormatError(
            f"dtype {arr.dtype} cannot be sent; use one of {', '.join(WIRE_DTYPES)}.",
            "INVALID_INPUT",
        )
    if name in _TEXT_DTYPES:
        return {"dtype": name, "shape": list(arr.shape), "data": text_elements(arr, name)}
    arr = np.require(arr, dtype=DTYPES[name], requirements="C")  # keeps 0-d arrays 0-d
    data = memoryview(arr).cast("B") if arr.size else b""  # type: ignore[arg-type]
    return {"dtype": name, "shape": list(arr.shape), "data": data}


def decode_tensor(obj: Any, where: str, max_element_bytes: int | None = None) -> np.ndarray:
    """Check a decoded wire map and view its data as an array; ``where`` names it in errors.
    ``max_element_bytes`` bounds each element of a ``string`` or ``bytes`` tensor."""
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
    if isinstance(dtype_name, str) and dtype_name in _TEXT_DTYPES:
        shape = _check_shape(obj["shape"], where)
        return decode_text(dtype_name, shape, obj["data"], where, max_element_bytes)
    dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise WireFormatError(
            f"{where}: unknown dtype {_quote(dtype_name)}; expected one of "
            f"{', '.join(WIRE_DTYPES)}."
        )
    shape = _check_shape(obj["shape"], where)
    data = obj["data"]
    if not isinstance(data, bytes):
        raise WireFormatError(f"{where}: data must be msgpack bin, got {_kind(data)}.")
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise WireFormatError(
            f"{where}: data has {len(data)} bytes but shape {_quote(shape)} of {dtype_name} "
            f"needs {_quote(expected)}."
        )
    if dtype_name == "bool" and data and np.frombuffer(data, np.uint8).max() > 1:
        raise WireFormatError(f"{where}: bool data must hold only bytes 0 and 1.")
    try:
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    except ValueError as exc:  # a 0-sized shape whose other dims are too large for numpy
        raise WireFormatError(f"{where}: shape {_quote(shape)} is too large to hold.") from exc


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
    with _utf8_only("request"):
        return msgpack.packb(body, use_bin_type=True)


@contextlib.contextmanager
def _utf8_only(what: str) -> Iterator[None]:
    """A str that UTF-8 cannot encode (a lone surrogate) as INVALID_INPUT, not UnicodeError."""
    try:
        yield
    except UnicodeEncodeError as exc:
        bad = _quote(exc.object[exc.start : exc.end])
        raise WireFormatError(
            f"the {what} holds a str with {bad}, which UTF-8 cannot encode (a lone surrogate); "
            "send text as valid Unicode, or arbitrary bytes in a 'bytes' tensor.",
            "INVALID_INPUT",
        ) from exc


def decode_request(
    body: bytes, max_bytes: int, max_element_bytes: int | None = None
) -> RequestBody:
    """Decode and check a request body; the size limit is applied before any decoding.
    ``max_element_bytes`` bounds each element of its ``string`` and ``bytes`` tensors."""
    if len(body) > max_bytes:
        raise WireFormatError(
            f"body is {len(body)} bytes, over max_request_bytes={max_bytes}.", "TOO_LARGE"
        )
    try:
        doc, meta_raw = _unpack_body(body, max_bytes, "body")
        if not isinstance(doc, dict):
            raise WireFormatError(f"body must be a map, got {_kind(doc)}.")
        request = _request(doc, meta_raw, max_element_bytes)
        _check_meta_size(meta_raw)
        return request
    except WireFormatError as exc:
        # A body that is a map still names its meta and reply TTL: the error reply keeps them
        exc.meta_raw, exc.reply_ttl_s = _readable_extras(body, max_bytes)
        raise


def _request(
    doc: dict[str, Any], meta_raw: bytes | None, max_element_bytes: int | None = None
) -> RequestBody:
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
        _check_name_length("an input name", name)
    inputs = {
        name: decode_tensor(t, _input_where(name), max_element_bytes)
        for name, t in raw_inputs.items()
    }
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


def _optional_names(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise WireFormatError(
            f"'outputs' must be an array of output names (strings), got {_quote(value)}."
        )
    for name in value:
        _check_name_length("an output name in 'outputs'", name)
    return tuple(value)


def _check_name_length(what: str, name: str) -> None:
    if len(name) > MAX_NAME_CHARS:
        raise WireFormatError(
            f"{what} is {len(name)} characters long ({_quote(name)}); names are at most "
            f"{MAX_NAME_CHARS}."
        )


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
    doc: dict[str, Any] = {"rid": reply.rid, "ok": bool(reply.ok)}
    if reply.ok:
        doc["outputs"] = {name: encode_tensor(a) for name, a in (reply.outputs or {}).items()}
    else:
        error = reply.error or ErrorInfo("INTERNAL", "no detail", True)
        doc["error"] = {"code": error.code, "message": error.message, "retryable": error.retryable}
    doc["model"] = reply.model.as_map()
    doc["worker"] = reply.worker
    if reply.ok and reply.batch_rows is not None:
        doc["batch_rows"] = reply.batch_rows
    doc["timings_ms"] = dict(reply.timings_ms)
    if reply.meta_raw is None:
        with _utf8_only("reply"):
            return msgpack.packb(doc, use_bin_type=True)
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    packer.pack_map_header(len(doc) + 1)
    with _utf8_only("reply"):
        for key, value in doc.items():
            packer.pack(key)
            packer.pack(value)
    packer.pack("meta")
    return packer.bytes() + reply.meta_raw


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
            model=_model_ref(model),
            worker=str(doc["worker"]),
            timings_ms={str(k): float(v) for k, v in doc["timings_ms"].items()},
            outputs=outputs,
            error=error,
            batch_rows=doc.get("batch_rows"),
            meta_raw=meta_raw,
        )
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise WireFormatError(f"reply is missing or mistypes a field: {exc!r}.") from exc


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


def _check_meta_size(meta: bytes | None) -> None:
    """After the structure is checked (a body both malformed and with a long meta is
    MALFORMED): meta is echoed in every reply, so it is kept small."""
    if meta is not None and len(meta) > MAX_META_BYTES:
        raise WireFormatError(
            f"'meta' is {len(meta)} bytes encoded; at most {MAX_META_BYTES}.", "TOO_LARGE"
        )
