"""Bounded msgpack reading: what keeps a hostile body or reply cheap to refuse.

``producer.protocol.codec`` checks what a body means; this module makes sure reading it costs little
more than its size. The size limit comes first, the values a body declares are counted from its
headers before the unpacker builds any (``MAX_VALUES``; at ``_SMALL`` bytes or less its
containers are capped at its length instead), and error messages quote at most ``MAX_QUOTE``
characters of what was sent. ``meta`` is only echoed, so it is sliced out rather than decoded.
"""

from __future__ import annotations

import contextlib
import functools
import io
import reprlib
from collections.abc import Iterator
from typing import Any

import msgpack

from producer.protocol.errors import WireFormatError

__all__ = [
    "MAX_META_BYTES",
    "MAX_QUOTE",
    "MAX_RANK",
    "MAX_VALUES",
    "bounded_unpacker",
    "key_error",
    "kind_of",
    "name_list",
    "quote",
    "readable_extras",
    "unpack_body",
]

# The contract's limits that reading enforces (``producer.protocol.codec`` re-exports them).
MAX_META_BYTES = 4096
MAX_RANK = 32  # dimensions a tensor may have
# Values a body may declare in all: a thousand inputs of rank 32 and 4 KiB of meta fit. Each value
# the unpacker builds costs up to ~70 bytes (an empty list), so this caps it near 5 MB.
MAX_VALUES = 1 << 16
# Bounds that keep a hostile body from making the unpacker allocate: no body needs more. A
# ``string`` or ``bytes`` tensor (v2) is an array of up to MAX_VALUES elements, each of any
# length within the body: its bytes are its own cost, as a bin's are.
_MAX_CONTAINER_LEN = MAX_VALUES
MAX_QUOTE = 100  # characters of a hostile value quoted in an error message


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
        "max_str_len": max_bytes,
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


def bounded_unpacker(max_bytes: int) -> msgpack.Unpacker:
    return msgpack.Unpacker(max_buffer_size=max(max_bytes, 1), **_limits(max_bytes))


def _unpack(data: bytes, max_bytes: int, what: str) -> Any:
    limits = _checked_limits(data, max_bytes, what)
    with _msgpack_errors(what):
        return msgpack.unpackb(data, **limits)


def unpack_body(data: bytes, max_bytes: int, what: str) -> tuple[Any, bytes | None]:
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


_EXTRAS_READ = 4096


def readable_extras(body: bytes, max_bytes: int) -> tuple[bytes | None, int | None]:
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
                span = body[start : unpacker.tell()]
                # Read on its own it had the whole nesting limit; a reply holds it one level down
                meta = span if _complete_or_none(b"\x91" + span) else None
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
    """``unpack_body``'s second pass: the top-level map pair by pair, ``meta`` skipped over
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
                raise WireFormatError(key_error(what, key))
            if key in doc or (key == "meta" and meta is not None):
                raise ValueError(f"a map repeats the key {quote(key)}")
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
        if _nests_too_deeply(data, limits):
            raise msgpack.StackError  # worded as the first pass words it
    return doc, meta


def _nests_too_deeply(data: bytes, limits: dict[str, Any]) -> bool:
    """Whether ``data`` read whole passes msgpack's nesting limit (1,024 arrays and maps, the
    outermost counted), as the first pass would find. Read value by value, each value of the
    map gets the whole limit, one level more than it has inside the map; skipping builds
    nothing, and any other fault is left to the reading that called this."""
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(data), 1), **limits)
    unpacker.feed(data)
    try:
        unpacker.skip()
    except msgpack.StackError:
        return True
    except (ValueError, msgpack.UnpackException):
        pass
    return False


def key_error(what: str, key: Any) -> str:
    if isinstance(key, bytes):
        return (
            f"{what} keys must be msgpack str, got bin {quote(key)}; turn on your msgpack "
            "library's str/bin distinction (e.g. use_bin_type=True)."
        )
    return f"{what} keys must be msgpack str, got {kind_of(key)} {quote(key)}."


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
    except UnicodeDecodeError as exc:
        raise WireFormatError(
            f"{what} holds a msgpack str that is not valid UTF-8 (byte {exc.start} of it); "
            "send arbitrary bytes as bin, in a 'bytes' tensor."
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


def kind_of(value: Any) -> str:
    return _KINDS.get(type(value), type(value).__name__)


def name_list(keys: Any) -> str:
    names = sorted(keys, key=lambda k: str(k)[:MAX_QUOTE])
    listed = ", ".join(quote(k) for k in names[:5])
    return listed if len(names) <= 5 else f"{listed} and {len(names) - 5} more"


class _ShortRepr(reprlib.Repr):
    """``repr`` cut short, bytes too: a hostile value must not make a reply outgrow its request."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxdict = 2, 8, 4
        self.maxstring = self.maxother = self.maxlong = MAX_QUOTE

    def repr_bytes(self, value: bytes, level: int) -> str:
        text = repr(value[: self.maxstring])
        return text if len(value) <= self.maxstring else text + "..."


quote = _ShortRepr().repr


# At most this many bytes, msgpack we unpack is not walked first (_check_declared): with no
# container longer than the data, the unpacker can hold at most a container of that length per
# nesting level, and a body this small nests at most a third of it deep (three-byte headers):
# 2.8 MB for a hostile 1 KiB. Most replies and many bodies are this small, and walking them
# costs a quarter of decoding them.
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
            f"{what} holds more than {MAX_VALUES} msgpack values (each element of a string or "
            "bytes tensor is one); send fewer in one request."
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
