"""Raw msgpack building blocks for mutations: packing, odd maps, hostile values and bytes."""

from __future__ import annotations

from typing import Any

import msgpack

INTERESTING_BYTES = bytes([0x00, 0x01, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1])
INTERESTING_BYTES += bytes(range(0xC2, 0xE0)) + bytes([0xE0, 0xFF])


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def raw_map(pairs: list[tuple[bytes, bytes]]) -> bytes:
    """A msgpack map from already packed keys and values (repeats and odd keys allowed)."""
    n = len(pairs)
    head = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
    return head + b"".join(k + v for k, v in pairs)


# Values that break a declared shape: overflowing, negative, huge, mistyped, too many dims.
HOSTILE_SHAPES: list[Any] = [
    [2**62, 2**62],
    [2**64 - 1] * 4,
    [2**63],
    [0, 2**63],
    [2**31, 2**31, 2**31],
    [2**20, 2**20],
    [1, 2**40],
    [-1, 16],
    [1, -(2**63)],
    [1] * 33,
    [1] * 32,
    [],
    [0],
    ["1", 16],
    [1.0, 16],
    [True, 16],
    [None],
    [[1], 16],
    {"0": 1},
    "1x16",
]
# Raw msgpack values that declare far more than they hold, or are refused kinds.
HOSTILE_RAW: list[bytes] = [
    b"\xdd\xff\xff\xff\xff",  # array32 of 2**32-1, nothing follows
    b"\xdf\xff\xff\xff\xff\xc0",  # map32 of 2**32-1
    b"\xdb\x7f\xff\xff\xffabc",  # str32 of 2**31-1, 3 bytes present
    b"\xc6\xff\xff\xff\xff\x00",  # bin32 of 2**32-1
    b"\xc9\xff\xff\xff\xff\x01ab",  # ext32 of 2**32-1
    b"\xdd\x00\x00\x10\x00" * 64,  # nested arrays of 4096, declared but absent
    b"\xdf\x00\x00\x10\x00" * 64,  # nested maps of 4096
    b"\xdc\x10\x00" + b"\x90" * 4096,  # 4096 empty lists: cheap on the wire, not in memory
    b"\xd4\x01\x00",  # fixext 1
    b"\xd8\x05" + b"\x00" * 16,  # fixext 16
    b"\xc7\x00\x05",  # empty ext
    b"\xd6\xff\x00\x00\x00\x01",  # timestamp 32
    b"\xc1",  # never used
]

# (v2) Bytes that are not UTF-8, as the payload of a msgpack str: a string tensor's element.
INVALID_UTF8: list[bytes] = [
    b"\xff",  # never in UTF-8
    b"\x80",  # a continuation byte with nothing to continue
    b"ab\xc3",  # a 2-byte sequence cut short
    b"\xc0\xaf",  # overlong '/'
    b"\xed\xa0\x80",  # a UTF-16 surrogate, U+D800
    b"\xf4\x90\x80\x80",  # past U+10FFFF
    b"\xf8\x88\x80\x80\x80",  # a 5-byte form, retired
]


def raw_str(payload: bytes) -> bytes:
    """A msgpack str of ``payload``, UTF-8 or not (msgpack's packer only writes valid ones)."""
    n = len(payload)
    if n < 32:
        return bytes([0xA0 | n]) + payload
    for head, width in ((b"\xd9", 1), (b"\xda", 2)):
        if n < 1 << (8 * width):
            return head + n.to_bytes(width, "big") + payload
    return b"\xdb" + n.to_bytes(4, "big") + payload
