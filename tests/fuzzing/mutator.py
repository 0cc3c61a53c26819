"""Seeded mutations of valid bodies, byte-level and msgpack-aware, and the fuzzed stream entries.

The same seed gives the same inputs, so a failure is replayed by its seed and index.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .bodies import DAY_MS, ValidBodies
from .hostile import (
    HOSTILE_RAW,
    HOSTILE_SHAPES,
    INTERESTING_BYTES,
    INVALID_UTF8,
    pack,
    raw_map,
    raw_str,
)
from .target import FuzzTarget


class Mutator(ValidBodies):
    """Seeded generator of valid bodies and of mutations of them, byte-level and msgpack-aware."""

    def __init__(self, target: FuzzTarget, seed: int) -> None:
        super().__init__(target, seed)
        self._byte_ops: list[Callable[[bytes], bytes]] = [
            self._bit_flip,
            self._byte_set,
            self._insert,
            self._delete,
            self._truncate,
            self._splice,
            self._duplicate,
            self._append,
        ]
        self._doc_ops: list[Callable[[dict[str, Any]], bytes]] = [
            self._shape,
            self._rows,
            self._dtype,
            self._data,
            self._non_finite,
            self._tensor_keys,
            self._inputs,
            self._body_keys,
            self._deep_meta,
            self._hostile_value,
            self._meta_size,
            self._outputs,
            self._deadline,
            self._reply_ttl,
            self._oversize,
            self._duplicate_key,
            self._text,
        ]

    # -- mutations ------------------------------------------------------------------------------

    def mutate(self) -> tuple[str, bytes]:
        """One fuzzed body and the names of the mutations stacked on it (1 to 3)."""
        rng = self.rng
        if rng.random() < 0.5:
            doc_op = rng.choice(self._doc_ops)
            names, body = [doc_op.__name__], doc_op(self.valid_doc())
        else:
            byte_op = rng.choice(self._byte_ops)
            names, body = [byte_op.__name__], byte_op(self.valid_body())
        for _ in range(rng.choice((0, 0, 0, 1, 2))):
            byte_op = rng.choice(self._byte_ops)
            names.append(byte_op.__name__)
            body = byte_op(body)
        names = [name.lstrip("_") for name in names]
        return "+".join(names), body

    def _pos(self, body: bytes, end: bool = False) -> int:
        return self.rng.randint(0, len(body) if end else max(len(body) - 1, 0))

    def _some_bytes(self, n: int) -> bytes:
        rng = self.rng
        return bytes(
            rng.choice(INTERESTING_BYTES) if rng.random() < 0.5 else rng.randrange(256)
            for _ in range(n)
        )

    def _bit_flip(self, body: bytes) -> bytes:
        out = bytearray(body)
        for _ in range(self.rng.randint(1, 8)):
            if out:
                out[self._pos(body)] ^= 1 << self.rng.randrange(8)
        return bytes(out)

    def _byte_set(self, body: bytes) -> bytes:
        out = bytearray(body)
        for _ in range(self.rng.randint(1, 4)):
            if out:
                out[self._pos(body)] = self._some_bytes(1)[0]
        return bytes(out)

    def _insert(self, body: bytes) -> bytes:
        at = self._pos(body, end=True)
        return body[:at] + self._some_bytes(self.rng.randint(1, 16)) + body[at:]

    def _delete(self, body: bytes) -> bytes:
        at = self._pos(body)
        return body[:at] + body[at + self.rng.randint(1, 16) :]

    def _truncate(self, body: bytes) -> bytes:
        return body[: self._pos(body)]

    def _splice(self, body: bytes) -> bytes:
        other = self.valid_body()
        return body[: self._pos(body, end=True)] + other[self._pos(other, end=True) :]

    def _duplicate(self, body: bytes) -> bytes:
        at = self._pos(body)
        chunk = body[at : at + self.rng.randint(1, 32)]
        return body[:at] + chunk * self.rng.randint(2, 8) + body[at:]

    def _append(self, body: bytes) -> bytes:
        return body + self._some_bytes(self.rng.randint(1, 8))

    def _tensor(self, doc: dict[Any, Any]) -> dict[Any, Any]:
        return doc["inputs"][self.rng.choice(list(doc["inputs"]))]

    def _shape(self, doc: dict[str, Any]) -> bytes:
        self._tensor(doc)["shape"] = self.rng.choice(HOSTILE_SHAPES)
        return pack(doc)

    def _rows(self, doc: dict[str, Any]) -> bytes:
        """Well-formed data of the wrong size: too many rows, no rows, a wrong inner dim."""
        rng = self.rng
        name = rng.choice(list(doc["inputs"]))
        dtype, dims = self.spec.inputs[name]
        rows = rng.choice([0, self.target.max_batch_size + 1, 1, 2])
        inner = [d + rng.choice((0, 0, 1, -1)) for d in dims]
        if rng.random() < 0.2:
            inner.append(1)
        shape = [rows, *inner]
        doc["inputs"][name] = {
            "dtype": dtype,
            "shape": shape,
            "data": bytes(math.prod(shape) * np.dtype(dtype).itemsize),
        }
        return pack(doc)

    def _dtype(self, doc: dict[str, Any]) -> bytes:
        rng = self.rng
        tensor = self._tensor(doc)
        choices: list[Any] = ["float64", "int32", "uint8", "bool", "float16", "complex64", ""]
        choices += ["FLOAT32", 5, None, b"float32", ["float32"], "f" * 70_000]
        tensor["dtype"] = rng.choice(choices)
        if (
            rng.random() < 0.5
            and isinstance(tensor["dtype"], str)
            and tensor["dtype"]
            in (
                "float64",
                "int32",
                "uint8",
                "bool",
                "float16",
            )
        ):  # resize data to match, so the dtype itself is what is wrong
            tensor["data"] = bytes(math.prod(tensor["shape"]) * np.dtype(tensor["dtype"]).itemsize)
        return pack(doc)

    def _data(self, doc: dict[str, Any]) -> bytes:
        rng = self.rng
        tensor = self._tensor(doc)
        data = tensor["data"]
        tensor["data"] = rng.choice(
            [data[:-1], data + b"\0", b"", data.decode("latin-1"), None, list(data[:8]), data * 2]
        )
        return pack(doc)

    def _non_finite(self, doc: dict[str, Any]) -> bytes:
        tensor = self._tensor(doc)
        if tensor["dtype"][0] == "f" and tensor["data"]:
            values = np.frombuffer(tensor["data"], tensor["dtype"]).copy()
            values[self.rng.randrange(values.size)] = self.rng.choice([np.nan, np.inf, -np.inf])
            tensor["data"] = values.tobytes()
        return pack(doc)

    def _tensor_keys(self, doc: dict[str, Any]) -> bytes:
        rng = self.rng
        tensor = self._tensor(doc)
        if rng.random() < 0.5:
            del tensor[rng.choice(list(tensor))]
        else:
            tensor[rng.choice(["order", 1, b"shape", None, 2.5, True, ""])] = 0
        return pack(doc)

    def _inputs(self, doc: dict[str, Any]) -> bytes:
        rng = self.rng
        inputs = doc["inputs"]
        choice = rng.randrange(6)
        if choice == 0:
            inputs.pop(rng.choice(list(inputs)))
        elif choice == 1:
            inputs[rng.choice(["extra", "x" * 300, "", "features "])] = next(iter(inputs.values()))
        elif choice == 2:
            name = rng.choice(list(inputs))
            inputs[rng.choice([1, b"x" * 9000, None, 2.5, name.encode()])] = inputs.pop(name)
        elif choice == 3:
            doc["inputs"] = rng.choice([{}, [], None, "inputs", list(inputs.values())])
        elif choice == 4:
            doc["inputs"] = {f"in{i}": {} for i in range(rng.choice([20, 4096, 4097]))}
        else:  # unequal rows across inputs, or one input sent twice under two names
            inputs["copy"] = dict(next(iter(inputs.values())))
        return pack(doc)

    def _body_keys(self, doc: dict[Any, Any]) -> bytes:
        rng = self.rng
        choice = rng.randrange(4)
        if choice == 0:
            doc[rng.choice(["input", "Inputs", 1, b"meta", None, 2.5, False, "x" * 5000])] = 1
            return pack(doc)
        if choice == 1:
            doc.pop("inputs")
            return pack(doc)
        if choice == 2:
            return pack(rng.choice([[doc["inputs"]], "inputs", 7, None, b"\x81", 1.5]))
        return pack({f"k{i}": i for i in range(rng.choice([6, 100, 4097]))})

    def _deep_meta(self, doc: dict[str, Any]) -> bytes:
        rng = self.rng
        depth = rng.choice([10, 100, 500, 1000, 1023, 1024, 1100, 2000, 4000])
        level = rng.choice([b"\x91", b"\x81\xa1k", b"\x81\x01", b"\xdc\x00\x01"])
        raw = level * depth + b"\xc0"
        pairs = [(pack(k), pack(v)) for k, v in doc.items() if k != "meta"]
        where = rng.random()
        if where < 0.7:
            pairs.append((pack("meta"), raw))
        elif where < 0.85:
            pairs.append((pack("outputs"), raw))
        else:
            tensor = self._tensor(doc)
            tensor["shape"] = "placeholder"
            pairs = [(pack(k), pack(v)) for k, v in doc.items() if k != "meta"]
            packed = raw_map(pairs)
            return packed.replace(pack("placeholder"), raw, 1)
        return raw_map(pairs)

    def _hostile_value(self, doc: dict[str, Any]) -> bytes:
        """A declared-but-absent length, an ext type or a container bomb, somewhere in the body."""
        rng = self.rng
        raw = rng.choice(HOSTILE_RAW)
        if rng.random() < 0.3:
            data = rng.randbytes(rng.randint(0, 20))  # ext8 with any type byte, -1 included
            raw = b"\xc7" + bytes([len(data), rng.randrange(256)]) + data
        slot = rng.choice(["meta", "shape", "data", "dtype", "outputs", "deadline_ms", "key"])
        if slot in ("shape", "data", "dtype"):
            self._tensor(doc)[slot] = "\x00placeholder"
        elif slot == "key":
            doc["\x00placeholder"] = 1
        else:
            doc[slot] = "\x00placeholder"
        return pack(doc).replace(pack("\x00placeholder"), raw, 1)

    def _meta_size(self, doc: dict[str, Any]) -> bytes:
        """Meta just under, at and over 4 KiB encoded (4096 is allowed, 4097 is TOO_LARGE)."""
        size = self.rng.choice([4095, 4096, 4097, 4200, 8000])
        doc["meta"] = b"m" * (size - 3)  # bin16 header: 3 bytes
        return pack(doc)

    def _outputs(self, doc: dict[str, Any]) -> bytes:
        names = list(self.spec.outputs)
        doc["outputs"] = self.rng.choice(
            [[], ["nope"], names * 2, "probs", [1], None, [names[0], b"x"], ["a"] * 4097, [""]]
        )
        return pack(doc)

    def _deadline(self, doc: dict[str, Any]) -> bytes:
        now = int(time.time() * 1000)
        doc["deadline_ms"] = self.rng.choice(
            [0, 1, now - DAY_MS, -1, 2**64 - 1, 1.5e12, "soon", True, None, now + DAY_MS]
        )
        return pack(doc)

    def _reply_ttl(self, doc: dict[str, Any]) -> bytes:
        doc["reply_ttl_s"] = self.rng.choice([0, -1, 1, 2**63, 2**64 - 1, 60.0, "60", False])
        return pack(doc)

    def _oversize(self, doc: dict[str, Any]) -> bytes:
        """A body just over max_request_bytes, with the bulk in a key or in meta."""
        size = self.target.max_request_bytes + self.rng.randint(1, 64)
        key = self.rng.choice(["meta", "pad", "outputs"])
        doc[key] = b""
        base = len(pack(doc))
        doc[key] = b"p" * max(size - base - 4, 0)
        return pack(doc)

    def _duplicate_key(self, doc: dict[str, Any]) -> bytes:
        key = self.rng.choice(list(doc))
        pairs = [(pack(k), pack(v)) for k, v in doc.items()]
        pairs.append((pack(key), pack(self.rng.choice([doc[key], 1, "a" * 5000]))))
        return raw_map(pairs)

    def _text(self, doc: dict[str, Any]) -> bytes:
        """(v2) A string or bytes tensor in place of an input (or as a new one): well formed,
        or breaking a rule of its own: its element count, an element's type, UTF-8, nesting
        in place of an element, many tiny elements, one huge element, data not an array."""
        rng = self.rng
        dtype = rng.choice(["string", "bytes"])
        rows = rng.choice([1, 2, self.target.max_batch_size + 1])
        shape = rng.choice([[rows], [rows, 2], [], [0], [rows, 0]])
        elements: Any = [self._text_element(dtype) for _ in range(math.prod(shape))]
        raw: bytes | None = None  # msgpack spliced in place of the placeholder element
        choice = rng.randrange(9)
        if choice == 0:  # one more or one fewer than the shape holds
            elements = elements[:-1] if elements and rng.random() < 0.5 else [*elements, ""]
        elif choice == 1:  # an element of the other type, or of no text type
            wrong: list[Any] = [b"b", "s", 1, None, 2.5, True, ["s"], {"k": "v"}]
            elements = [*elements[:-1], rng.choice(wrong)]
        elif choice == 2:  # a str that is not UTF-8, in either kind of tensor
            raw = raw_str(b"ok" * rng.randint(0, 40) + rng.choice(INVALID_UTF8))
        elif choice == 3:  # nesting where an element should be
            depth = rng.choice([1, 10, 1000, 1100])
            raw = rng.choice([b"\x91", b"\x81\xa1k"]) * depth + b"\xc0"
        elif choice == 4:  # many tiny elements: the body's value count, not its bytes, is big
            count = rng.choice([1000, 4096, 8000])
            shape = [rng.choice([1, 2]), count]
            elements = ["" if dtype == "string" else b""] * (shape[0] * count)
        elif choice == 5:  # one element about as large as the body may be
            size = self.target.max_request_bytes + rng.randint(-200, 64)
            shape, elements = [1], ["e" * size if dtype == "string" else b"e" * size]
        elif choice == 6:  # data that is not an array of elements
            elements = rng.choice([b"bin", "str", {"0": "a"}, None, 7, [[]]])
        elif choice == 7:  # a declared-but-absent length or an ext where an element should be
            raw = rng.choice(HOSTILE_RAW)
        if raw is not None:
            elements = [*(elements if isinstance(elements, list) else [])[:-1], "\x00placeholder"]
        doc["inputs"][rng.choice([*doc["inputs"], "text"])] = {
            "dtype": dtype,
            "shape": shape,
            "data": elements,
        }
        body = pack(doc)
        return body if raw is None else body.replace(pack("\x00placeholder"), raw, 1)

    def text_mutation(self) -> bytes:
        """A body whose one input, ``text``, is what ``_text`` makes of it (for a text model)."""
        doc = self.valid_doc()
        doc["inputs"] = {}
        doc.pop("outputs", None)  # the demo model's names
        return self._text(doc)

    def _text_element(self, dtype: str) -> str | bytes:
        rng = self.rng
        if dtype == "bytes":
            return rng.randbytes(rng.randint(0, 8))
        return "".join(rng.choice("a\u00e9\u65e5\U0001f600\x00 ") for _ in range(rng.randint(0, 8)))

    # -- whole entries --------------------------------------------------------------------------

    def bad_rid(self) -> bytes:
        """A rid that breaks the contract's pattern: no reply key may be written for it."""
        return self.rng.choice(
            [b"", b"a b", b"x" * 129, b"r\x00", "r\u00e9".encode(), b"\xff\xfe", b"r/1", b"*"]
        )


def fuzz_entry(mutator: Mutator, index: int) -> tuple[bytes, bytes | None, str]:
    """The index-th entry: mostly a fuzzed body under a good rid, sometimes a bad rid or no body."""
    roll = mutator.rng.random()
    rid = f"fz-{index}".encode()
    if roll < 0.01:
        return mutator.bad_rid(), mutator.valid_body(), "bad_rid"
    if roll < 0.015:
        return rid, None, "no_body"
    mutation, body = mutator.mutate()
    return rid, body, mutation


def iter_bodies(target: FuzzTarget, seed: int, n: int) -> Iterator[tuple[str, bytes]]:
    """The first ``n`` fuzzed bodies of ``seed`` with their mutation names, for tests."""
    mutator = Mutator(target, seed)
    for _ in range(n):
        yield mutator.mutate()
