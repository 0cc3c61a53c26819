"""The wire format: pure encode/decode of tensors, request bodies and replies (contract 2 and 3).

No I/O lives here, so every other language's implementation can be checked against these
functions and the test vectors in ``docs/protocol.md``. Decoding is strict: any structural fault
raises ``WireFormatError`` (code ``MALFORMED``, or ``TOO_LARGE`` for size limits), whose message
says what is wrong and where. Tensor data is never copied on decode (``numpy.frombuffer``).

This module holds request bodies and is the one place callers import the wire format from:
tensors live in ``producer.protocol.tensors`` and replies (with the worker's reply encoder) in
``producer.protocol.replies``. Reading is bounded by ``producer.protocol.bounded``, so a hostile
body costs little more than its own size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from producer.protocol.bounded import (
    MAX_META_BYTES,
    MAX_QUOTE,
    MAX_RANK,
    MAX_VALUES,
    key_error,
    kind_of,
    name_list,
    quote,
    readable_extras,
    unpack_body,
)
from producer.protocol.errors import WireFormatError
from producer.protocol.replies import (
    ErrorInfo,
    ModelRef,
    PipelineRef,
    Reply,
    check_meta_size,
    decode_meta,
    decode_reply,
    encode_reply,
)
from producer.protocol.tensors import (
    DTYPES,
    WIRE_DTYPES,
    as_tensor,
    decode_tensor,
    encode_tensor,
    not_utf8,
    wire_dtype,
)
from producer.protocol.text import BYTES, STRING

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


# Input and output names (and dtype names) longer than this are refused: no model has them, and
# errors quote names. Only the elements of string tensors may be long strings.
MAX_NAME_CHARS = 1024

_BODY_KEYS = frozenset({"inputs", "outputs", "deadline_ms", "meta", "reply_ttl_s"})


@dataclass(frozen=True, slots=True)
class RequestBody:
    """A decoded request body; ``meta_raw`` is the meta value's exact msgpack bytes."""

    inputs: dict[str, np.ndarray]
    outputs: tuple[str, ...] | None = None
    deadline_ms: int | None = None
    meta_raw: bytes | None = None
    reply_ttl_s: int | None = None


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
    try:
        return msgpack.packb(body, use_bin_type=True)
    except UnicodeEncodeError as exc:
        raise not_utf8("request", exc) from exc


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
        doc, meta_raw = unpack_body(body, max_bytes, "body")
        if not isinstance(doc, dict):
            raise WireFormatError(f"body must be a map, got {kind_of(doc)}.")
        request = _request(doc, meta_raw, max_element_bytes)
        check_meta_size(meta_raw)
        return request
    except WireFormatError as exc:
        # A body that is a map still names its meta and reply TTL: the error reply keeps them
        exc.meta_raw, exc.reply_ttl_s = readable_extras(body, max_bytes)
        raise


def _request(
    doc: dict[str, Any], meta_raw: bytes | None, max_element_bytes: int | None = None
) -> RequestBody:
    """Check a body's map (meta already sliced out) and build the request."""
    extra = doc.keys() - _BODY_KEYS
    if extra:
        odd = [key for key in extra if not isinstance(key, str)]
        if odd:
            raise WireFormatError(key_error("body", odd[0]))
        raise WireFormatError(f"body has unknown key {name_list(extra)}.")
    if "inputs" not in doc:
        raise WireFormatError("body is missing 'inputs'.")
    raw_inputs = doc["inputs"]
    if not isinstance(raw_inputs, dict) or not raw_inputs:
        raise WireFormatError("'inputs' must be a non-empty map of input name to tensor.")
    for name in raw_inputs:
        if not isinstance(name, str):
            raise WireFormatError(
                f"input names must be strings; got {kind_of(name)} {quote(name)}."
            )
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
    quoted = repr(name) if len(name) <= MAX_QUOTE else ""
    return f"input {quoted if 0 < len(quoted) <= MAX_QUOTE else quote(name)}"


def _optional_names(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise WireFormatError(
            f"'outputs' must be an array of output names (strings), got {quote(value)}."
        )
    for name in value:
        _check_name_length("an output name in 'outputs'", name)
    return tuple(value)


def _check_name_length(what: str, name: str) -> None:
    if len(name) > MAX_NAME_CHARS:
        raise WireFormatError(
            f"{what} is {len(name)} characters long ({quote(name)}); names are at most "
            f"{MAX_NAME_CHARS}."
        )


def _optional_int(doc: dict[str, Any], key: str, minimum: int) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if type(value) is not int or value < minimum:
        raise WireFormatError(f"'{key}' must be an integer >= {minimum}, got {quote(value)}.")
    return value


def pack_meta(meta: Any) -> bytes | None:
    """Encode a meta value as it travels; None stays None."""
    return None if meta is None else msgpack.packb(meta, use_bin_type=True)
