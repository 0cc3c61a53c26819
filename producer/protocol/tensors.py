"""Tensors on the wire (contract section 2): the ``dtype``/``shape``/``data`` map both ways.

Requests and replies both carry tensors, so their codecs (``producer.protocol.codec`` and
``producer.protocol.replies``) share these functions. Data is sent little-endian in C order,
without a copy when the array already is; decoding views the received bytes
(``numpy.frombuffer``) and never copies them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from producer.protocol.bounded import MAX_RANK, kind_of, name_list, quote
from producer.protocol.errors import WireFormatError
from producer.protocol.text import (
    TEXT_DTYPES,
    as_text_tensor,
    decode_text,
    text_elements,
    text_name,
)

__all__ = [
    "DTYPES",
    "WIRE_DTYPES",
    "as_tensor",
    "decode_tensor",
    "encode_tensor",
    "not_utf8",
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

_TENSOR_KEYS = frozenset({"dtype", "shape", "data"})


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
    if name in TEXT_DTYPES:
        return {"dtype": name, "shape": list(arr.shape), "data": text_elements(arr, name)}
    arr = np.require(arr, dtype=DTYPES[name], requirements="C")  # keeps 0-d arrays 0-d
    data = memoryview(arr).cast("B") if arr.size else b""  # type: ignore[arg-type]
    return {"dtype": name, "shape": list(arr.shape), "data": data}


def decode_tensor(obj: Any, where: str, max_element_bytes: int | None = None) -> np.ndarray:
    """Check a decoded wire map and view its data as an array; ``where`` names it in errors.
    ``max_element_bytes`` bounds each element of a ``string`` or ``bytes`` tensor."""
    if not isinstance(obj, dict):
        raise WireFormatError(f"{where}: a tensor must be a map, got {kind_of(obj)}.")
    if obj.keys() != _TENSOR_KEYS:
        missing = _TENSOR_KEYS - obj.keys()
        if missing:
            raise WireFormatError(f"{where}: tensor is missing {name_list(missing)}.")
        raise WireFormatError(
            f"{where}: tensor has unknown key {name_list(obj.keys() - _TENSOR_KEYS)}."
        )
    dtype_name = obj["dtype"]
    if isinstance(dtype_name, str) and dtype_name in TEXT_DTYPES:
        shape = _check_shape(obj["shape"], where)
        return decode_text(dtype_name, shape, obj["data"], where, max_element_bytes)
    dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise WireFormatError(
            f"{where}: unknown dtype {quote(dtype_name)}; expected one of {', '.join(WIRE_DTYPES)}."
        )
    shape = _check_shape(obj["shape"], where)
    data = obj["data"]
    if not isinstance(data, bytes):
        raise WireFormatError(f"{where}: data must be msgpack bin, got {kind_of(data)}.")
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise WireFormatError(
            f"{where}: data has {len(data)} bytes but shape {quote(shape)} of {dtype_name} "
            f"needs {quote(expected)}."
        )
    if dtype_name == "bool" and data and np.frombuffer(data, np.uint8).max() > 1:
        raise WireFormatError(f"{where}: bool data must hold only bytes 0 and 1.")
    try:
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    except ValueError as exc:  # a 0-sized shape whose other dims are too large for numpy
        raise WireFormatError(f"{where}: shape {quote(shape)} is too large to hold.") from exc


def _check_shape(shape: Any, where: str) -> list[int]:
    if not isinstance(shape, list):
        raise WireFormatError(f"{where}: shape must be an array of integers, got {kind_of(shape)}.")
    if len(shape) > MAX_RANK:
        raise WireFormatError(f"{where}: shape has {len(shape)} dimensions; at most {MAX_RANK}.")
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise WireFormatError(
                f"{where}: shape {quote(shape)} must hold non-negative integers only."
            )
    return shape


def not_utf8(what: str, exc: UnicodeEncodeError) -> WireFormatError:
    """The error for a str in ``what`` (a request, a reply) that UTF-8 cannot encode: a lone
    surrogate is the caller's bad input (INVALID_INPUT), not a crash in msgpack."""
    bad = quote(exc.object[exc.start : exc.end])
    return WireFormatError(
        f"the {what} holds a str with {bad}, which UTF-8 cannot encode (a lone surrogate); "
        "send text as valid Unicode, or arbitrary bytes in a 'bytes' tensor.",
        "INVALID_INPUT",
    )
