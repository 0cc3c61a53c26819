"""(v2) ``string`` and ``bytes`` tensors: numpy object arrays of ``str`` or ``bytes``, and their
wire form, a msgpack array of str or bin elements in C order (contract section 2).

numpy sees both as ``dtype('O')`` and compares them equal, so the wire name rides in the
dtype's metadata (``STRING``, ``BYTES``), which views, slices and reshapes keep. Lists of
``str`` or ``bytes`` are built into such arrays here, never through ``np.asarray``, whose
fixed-width byte strings drop trailing NUL bytes. ``producer.protocol.codec`` calls these.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

import numpy as np

from producer.protocol.bounded import MAX_RANK, kind_of, quote
from producer.protocol.errors import WireFormatError

__all__ = [
    "BYTES",
    "STRING",
    "TEXT_DTYPES",
    "as_text_tensor",
    "decode_text",
    "text_elements",
    "text_name",
    "utf8_encodable",
]

STRING: np.dtype[Any] = np.dtype(object, metadata={"wire": "string"})
BYTES: np.dtype[Any] = np.dtype(object, metadata={"wire": "bytes"})
TEXT_DTYPES = {"string": STRING, "bytes": BYTES}
_TEXT_TYPES: dict[str, type[str] | type[bytes]] = {"string": str, "bytes": bytes}
_TEXT_LEAVES = (str, bytes, bytearray, memoryview)  # what as_text_tensor sends as one element


def text_name(arr: np.ndarray) -> str:
    """``string`` or ``bytes`` for a U, S or object array: an object array without a wire name
    in its dtype is named by its first element."""
    kind = arr.dtype.kind
    if kind == "U":
        return "string"
    if kind == "S":
        return "bytes"
    meta = arr.dtype.metadata
    if meta is not None and meta.get("wire") in TEXT_DTYPES:
        return str(meta["wire"])
    first = next(iter(arr.flat), "") if arr.size else ""
    return "bytes" if isinstance(first, bytes | bytearray | memoryview) else "string"


def as_text_tensor(value: Any) -> np.ndarray | None:
    """``value`` (a str, bytes, or nested lists of them) as a string or bytes tensor; None
    when it is something else (numbers: numpy reads them)."""
    if isinstance(value, _TEXT_LEAVES):
        return _text_array([_element(value)], [])
    if not isinstance(value, list | tuple):
        return None
    shape: list[int] = []
    leaf: Any = value
    while isinstance(leaf, list | tuple):
        shape.append(len(leaf))
        if not leaf:
            break
        leaf = leaf[0]
    if isinstance(leaf, _TEXT_LEAVES):
        # Not np.array(value, dtype=object): it unpacks bytearray and memoryview elements
        # into their integers, and keeps ragged lists as elements.
        if len(shape) > MAX_RANK:
            raise WireFormatError(
                f"nested lists of str or bytes have {len(shape)} levels; at most {MAX_RANK}.",
                "INVALID_INPUT",
            )
        elements: list[Any] = []
        _flatten(value, shape, 0, elements)
        return _text_array(elements, shape)
    arr = np.asarray(value)
    if arr.dtype.kind in "US":  # numpy turns numbers beside str or bytes into text
        elements = list(np.array(value, dtype=object).ravel())
        text = [e for e in elements if isinstance(e, str | bytes)][:1]
        _text_kind(text + elements)  # refuses the numbers, named by the text's type
    return None


def text_elements(arr: np.ndarray, name: str) -> list[Any]:
    """A string or bytes tensor's elements in C order, as the wire carries them."""
    flat = arr.ravel()
    elements = [_element(v) for v in (flat.tolist() if arr.dtype.kind in "US" else flat)]
    if elements and _text_kind(elements) != name:
        raise WireFormatError(
            f"a {name} tensor holds {type(elements[0]).__name__} elements.", "INVALID_INPUT"
        )
    return elements


def _flatten(value: Any, shape: list[int], depth: int, out: list[Any]) -> None:
    """Append the leaves of nested lists ``value`` to ``out`` in C order, checking that every
    list at ``depth`` has ``shape[depth]`` items and that every leaf is at the same depth."""
    if not isinstance(value, list | tuple):
        _ragged(f"an item at depth {depth} is {kind_of(value)} where the first is a list", shape)
    if len(value) != shape[depth]:
        _ragged(
            f"a list at depth {depth} holds {len(value)} items, the first {shape[depth]}", shape
        )
    if depth + 1 < len(shape):
        for item in value:
            _flatten(item, shape, depth + 1, out)
        return
    for item in value:
        if isinstance(item, list | tuple):
            _ragged(f"an item at depth {depth + 1} is a list where the first is not", shape)
        out.append(_element(item))


def _ragged(what: str, shape: list[int]) -> NoReturn:
    raise WireFormatError(
        f"nested lists of str or bytes must be rectangular: {what} (shape {shape}).",
        "INVALID_INPUT",
    )


def _element(value: Any) -> str | bytes:
    return bytes(value) if isinstance(value, bytearray | memoryview) else value


def _text_array(elements: list[Any], shape: list[int]) -> np.ndarray:
    """An object array of ``str`` or ``bytes`` elements (all one type) with its wire dtype."""
    arr = np.empty(len(elements), dtype=TEXT_DTYPES[_text_kind(elements)])
    arr[:] = elements
    return arr.reshape(shape)


def _text_kind(elements: list[Any]) -> str:
    """``string`` or ``bytes``: the one type every element has."""
    name = "bytes" if elements and isinstance(elements[0], bytes) else "string"
    want = _TEXT_TYPES[name]
    for element in elements:
        if not isinstance(element, want):
            raise WireFormatError(
                f"a {name} tensor holds {type(element).__name__} {quote(element)}; every "
                f"element must be {want.__name__} (send str and bytes as separate inputs).",
                "INVALID_INPUT",
            )
    return name


def decode_text(
    name: str, shape: list[int], data: Any, where: str, max_element_bytes: int | None
) -> np.ndarray:
    """A ``string`` or ``bytes`` tensor's elements: an array of exactly prod(shape) str (UTF-8,
    which the unpacker checked) or bin values, each within ``max_element_bytes``."""
    kind = "str" if name == "string" else "bin"
    if not isinstance(data, list):
        raise WireFormatError(
            f"{where}: a {name} tensor's data must be an array of msgpack {kind}, got "
            f"{kind_of(data)}."
        )
    count = math.prod(shape)
    if len(data) != count:
        raise WireFormatError(
            f"{where}: data has {len(data)} elements but shape {quote(shape)} needs {quote(count)}."
        )
    want = _TEXT_TYPES[name]
    limit = max_element_bytes
    for index, element in enumerate(data):
        if type(element) is not want:
            raise WireFormatError(
                f"{where}: element {index} of a {name} tensor must be msgpack {kind}, got "
                f"{kind_of(element)}."
            )
        # len() counts characters of a str: at most 4 UTF-8 bytes each, so only a str longer
        # than a quarter of the limit is encoded to count its bytes
        if limit is not None and len(element) > limit // 4 and (size := _size(element)) > limit:
            raise WireFormatError(
                f"{where}: element {index} is {size} bytes, over limits.max_element_bytes={limit}.",
                "TOO_LARGE",
            )
    arr = np.empty(count, dtype=TEXT_DTYPES[name])
    arr[:] = data
    return arr.reshape(shape)


def _size(element: str | bytes) -> int:
    return len(element.encode()) if isinstance(element, str) else len(element)


def utf8_encodable(arr: np.ndarray) -> bool:
    """Whether every str element encodes as UTF-8, as the wire needs (a lone surrogate does
    not: a model or a hook that builds text from bytes can make one)."""
    try:
        for element in arr.flat:
            if isinstance(element, str):
                element.encode()
    except UnicodeEncodeError:
        return False
    return True
