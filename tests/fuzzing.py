"""Fuzzing the wire format and the worker's intake with seeded mutations of valid request bodies.

The oracle is not a second decoder but the contract's promise: every input gets exactly one
answer, whose code is OK (the mutation happened to stay valid) or a client-error code, never
INTERNAL and never nothing; no input crashes, hangs or bloats the worker. On top of that each
input's code is predicted by running ``admit`` (and the batch's value screen) locally, so the
worker must also answer with the right code, not just an allowed one.

Two drivers share one seeded ``Mutator``: ``fuzz_admit`` calls ``worker.intake.admit`` in-process
(fast, with allocation tracking), and ``fuzz_worker`` pushes bodies through a real worker via
Redis and returns a plain summary dict for reports. The same seed gives the same inputs, so a
failure is replayed by its seed and index.
"""

from __future__ import annotations

import math
import os
import random
import secrets
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import redis

from producer.codec import Reply, decode_reply, encode_request
from producer.errors import WireFormatError
from producer.keys import CONSUMER_GROUP, dead_key, reply_key, request_stream, workers_key
from worker.config import BatchingConfig, LimitsConfig, ModelConfig, RedisConfig, WorkerConfig
from worker.intake import WorkItem, admit
from worker.model import TensorSpec
from worker.schema import Schema
from worker.stream import RawEntry

__all__ = [
    "ADMIT_CODES",
    "SPECS",
    "WORKER_CODES",
    "FuzzTarget",
    "ModelSpec",
    "Mutator",
    "fuzz_admit",
    "fuzz_worker",
    "schema_for",
    "wait_for_worker",
]

#: What admit may decide for a fuzzed entry ("DEAD": dead-lettered, its rid names no reply key).
ADMIT_CODES = frozenset({"OK", "MALFORMED", "INVALID_INPUT", "TOO_LARGE", "DEAD"})
#: Codes a worker may answer a fuzzed request with; INTERNAL or silence is always a failure.
WORKER_CODES = frozenset({"OK", "MALFORMED", "INVALID_INPUT", "TOO_LARGE", "DEADLINE_EXCEEDED"})

_DAY_MS = 86_400_000
# Replies kept for less than this may expire before a large run reads them back: not checked.
_MIN_TTL_S = 1800
_INTERESTING_BYTES = bytes([0x00, 0x01, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1])
_INTERESTING_BYTES += bytes(range(0xC2, 0xE0)) + bytes([0xE0, 0xFF])


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model's inputs (dtype name, dims after the batch axis) and output names."""

    inputs: Mapping[str, tuple[str, tuple[int, ...]]]
    outputs: Mapping[str, tuple[str, tuple[int, ...]]]


#: The synthetic models of ``worker.synthetic`` that the fuzzers know how to feed.
SPECS = {
    "demo": ModelSpec(
        {"features": ("float32", (16,))}, {"probs": ("float32", (4,)), "label": ("int64", ())}
    ),
    "tiny": ModelSpec({"x": ("float32", (128,))}, {"y": ("float32", (64,))}),
    "multi_io": ModelSpec(
        {"a": ("float32", (3,)), "b": ("int64", (2,))},
        {"twice": ("float32", (3,)), "total": ("int64", ())},
    ),
}


@dataclass(frozen=True, slots=True)
class FuzzTarget:
    """The worker under test as the fuzzer sees it: its model and the limits from its config."""

    model: str = "demo"
    prefix: str = "redbatch"
    max_request_bytes: int = 16384
    max_batch_size: int = 32

    @property
    def spec(self) -> ModelSpec:
        return SPECS[self.model]


def schema_for(target: FuzzTarget) -> Schema:
    """The worker's Schema for ``target``, built from its spec (no model file, no runtime)."""
    spec = target.spec

    def tensors(table: Mapping[str, tuple[str, tuple[int, ...]]]) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(n, np.dtype(d), ("N", *dims)) for n, (d, dims) in table.items())

    config = WorkerConfig(
        RedisConfig(),
        ModelConfig(target.model, Path(f"{target.model}.onnx")),
        batching=BatchingConfig(max_batch_size=target.max_batch_size),
        limits=LimitsConfig(max_request_bytes=target.max_request_bytes),
    )
    return Schema(tensors(spec.inputs), tensors(spec.outputs), config)


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _raw_map(pairs: list[tuple[bytes, bytes]]) -> bytes:
    """A msgpack map from already packed keys and values (repeats and odd keys allowed)."""
    n = len(pairs)
    head = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
    return head + b"".join(k + v for k, v in pairs)


# Values that break a declared shape: overflowing, negative, huge, mistyped, too many dims.
_HOSTILE_SHAPES: list[Any] = [
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
_HOSTILE_RAW: list[bytes] = [
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


class Mutator:
    """Seeded generator of valid bodies and of mutations of them, byte-level and msgpack-aware."""

    def __init__(self, target: FuzzTarget, seed: int) -> None:
        self.target = target
        self.spec = target.spec
        self.rng = random.Random(seed)
        self._np = np.random.default_rng(seed)
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
        ]

    # -- valid bodies ---------------------------------------------------------------------------

    def valid_inputs(self, rows: int | None = None) -> dict[str, np.ndarray]:
        """Finite values in [-1, 1] (small integers for integer inputs), 1 to 4 rows."""
        n = rows if rows is not None else self.rng.randint(1, min(4, self.target.max_batch_size))
        inputs = {}
        for name, (dtype, dims) in self.spec.inputs.items():
            values = self._np.uniform(-1.0, 1.0, size=(n, *dims)) * (1 if dtype[0] == "f" else 9)
            inputs[name] = values.astype(dtype)
        return inputs

    def valid_doc(self) -> dict[str, Any]:
        """A valid body as a Python map, with each optional key present half the time or so."""
        rng = self.rng
        body: dict[str, Any] = {
            "inputs": {
                n: {"dtype": str(a.dtype), "shape": list(a.shape), "data": a.tobytes()}
                for n, a in self.valid_inputs().items()
            }
        }
        if rng.random() < 0.3:
            names = list(self.spec.outputs)
            body["outputs"] = rng.sample(names, rng.randint(1, len(names)))
        if rng.random() < 0.3:
            body["deadline_ms"] = int(time.time() * 1000) + _DAY_MS
        if rng.random() < 0.3:
            body["meta"] = self._meta_value(rng.randint(0, 3))
        if rng.random() < 0.2:
            body["reply_ttl_s"] = rng.randint(_MIN_TTL_S, 3600)
        return body

    def valid_body(self) -> bytes:
        """A body the worker must answer OK (encode_request writes it, as a producer would)."""
        doc = self.valid_doc()
        inputs = {
            n: np.frombuffer(t["data"], t["dtype"]).reshape(t["shape"])
            for n, t in doc.pop("inputs").items()
        }
        return encode_request(inputs, **doc)

    def _meta_value(self, depth: int) -> Any:
        rng = self.rng
        choice = rng.randrange(7 if depth else 5)
        if choice == 0:
            return rng.randint(-(2**63), 2**64 - 1)
        if choice == 1:
            return "".join(rng.choice("abcé☃\x00") for _ in range(rng.randint(0, 12)))
        if choice == 2:
            return rng.randbytes(rng.randint(0, 12))
        if choice == 3:
            return rng.choice([None, True, False, 1.5, float("nan"), -0.0])
        if choice == 4:
            return rng.random()
        if choice == 5:
            return [self._meta_value(depth - 1) for _ in range(rng.randint(0, 4))]
        keys: list[Any] = ["k", "", 1, -7, b"b", 2.5, None, True]
        return {rng.choice(keys): self._meta_value(depth - 1) for _ in range(rng.randint(0, 4))}

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
            rng.choice(_INTERESTING_BYTES) if rng.random() < 0.5 else rng.randrange(256)
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
        self._tensor(doc)["shape"] = self.rng.choice(_HOSTILE_SHAPES)
        return _pack(doc)

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
        return _pack(doc)

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
        return _pack(doc)

    def _data(self, doc: dict[str, Any]) -> bytes:
        rng = self.rng
        tensor = self._tensor(doc)
        data = tensor["data"]
        tensor["data"] = rng.choice(
            [data[:-1], data + b"\0", b"", data.decode("latin-1"), None, list(data[:8]), data * 2]
        )
        return _pack(doc)

    def _non_finite(self, doc: dict[str, Any]) -> bytes:
        tensor = self._tensor(doc)
        if tensor["dtype"][0] == "f" and tensor["data"]:
            values = np.frombuffer(tensor["data"], tensor["dtype"]).copy()
            values[self.rng.randrange(values.size)] = self.rng.choice([np.nan, np.inf, -np.inf])
            tensor["data"] = values.tobytes()
        return _pack(doc)

    def _tensor_keys(self, doc: dict[str, Any]) -> bytes:
        rng = self.rng
        tensor = self._tensor(doc)
        if rng.random() < 0.5:
            del tensor[rng.choice(list(tensor))]
        else:
            tensor[rng.choice(["order", 1, b"shape", None, 2.5, True, ""])] = 0
        return _pack(doc)

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
        return _pack(doc)

    def _body_keys(self, doc: dict[Any, Any]) -> bytes:
        rng = self.rng
        choice = rng.randrange(4)
        if choice == 0:
            doc[rng.choice(["input", "Inputs", 1, b"meta", None, 2.5, False, "x" * 5000])] = 1
            return _pack(doc)
        if choice == 1:
            doc.pop("inputs")
            return _pack(doc)
        if choice == 2:
            return _pack(rng.choice([[doc["inputs"]], "inputs", 7, None, b"\x81", 1.5]))
        return _pack({f"k{i}": i for i in range(rng.choice([6, 100, 4097]))})

    def _deep_meta(self, doc: dict[str, Any]) -> bytes:
        rng = self.rng
        depth = rng.choice([10, 100, 500, 1000, 1023, 1024, 1100, 2000, 4000])
        level = rng.choice([b"\x91", b"\x81\xa1k", b"\x81\x01", b"\xdc\x00\x01"])
        raw = level * depth + b"\xc0"
        pairs = [(_pack(k), _pack(v)) for k, v in doc.items() if k != "meta"]
        where = rng.random()
        if where < 0.7:
            pairs.append((_pack("meta"), raw))
        elif where < 0.85:
            pairs.append((_pack("outputs"), raw))
        else:
            tensor = self._tensor(doc)
            tensor["shape"] = "placeholder"
            pairs = [(_pack(k), _pack(v)) for k, v in doc.items() if k != "meta"]
            packed = _raw_map(pairs)
            return packed.replace(_pack("placeholder"), raw, 1)
        return _raw_map(pairs)

    def _hostile_value(self, doc: dict[str, Any]) -> bytes:
        """A declared-but-absent length, an ext type or a container bomb, somewhere in the body."""
        rng = self.rng
        raw = rng.choice(_HOSTILE_RAW)
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
        return _pack(doc).replace(_pack("\x00placeholder"), raw, 1)

    def _meta_size(self, doc: dict[str, Any]) -> bytes:
        """Meta just under, at and over 4 KiB encoded (4096 is allowed, 4097 is TOO_LARGE)."""
        size = self.rng.choice([4095, 4096, 4097, 4200, 8000])
        doc["meta"] = b"m" * (size - 3)  # bin16 header: 3 bytes
        return _pack(doc)

    def _outputs(self, doc: dict[str, Any]) -> bytes:
        names = list(self.spec.outputs)
        doc["outputs"] = self.rng.choice(
            [[], ["nope"], names * 2, "probs", [1], None, [names[0], b"x"], ["a"] * 4097, [""]]
        )
        return _pack(doc)

    def _deadline(self, doc: dict[str, Any]) -> bytes:
        now = int(time.time() * 1000)
        doc["deadline_ms"] = self.rng.choice(
            [0, 1, now - _DAY_MS, -1, 2**64 - 1, 1.5e12, "soon", True, None, now + _DAY_MS]
        )
        return _pack(doc)

    def _reply_ttl(self, doc: dict[str, Any]) -> bytes:
        doc["reply_ttl_s"] = self.rng.choice([0, -1, 1, 2**63, 2**64 - 1, 60.0, "60", False])
        return _pack(doc)

    def _oversize(self, doc: dict[str, Any]) -> bytes:
        """A body just over max_request_bytes, with the bulk in a key or in meta."""
        size = self.target.max_request_bytes + self.rng.randint(1, 64)
        key = self.rng.choice(["meta", "pad", "outputs"])
        doc[key] = b""
        base = len(_pack(doc))
        doc[key] = b"p" * max(size - base - 4, 0)
        return _pack(doc)

    def _duplicate_key(self, doc: dict[str, Any]) -> bytes:
        key = self.rng.choice(list(doc))
        pairs = [(_pack(k), _pack(v)) for k, v in doc.items()]
        pairs.append((_pack(key), _pack(self.rng.choice([doc[key], 1, "a" * 5000]))))
        return _raw_map(pairs)

    # -- whole entries --------------------------------------------------------------------------

    def bad_rid(self) -> bytes:
        """A rid that breaks the contract's pattern: no reply key may be written for it."""
        return self.rng.choice(
            [b"", b"a b", b"x" * 129, b"r\x00", "r\u00e9".encode(), b"\xff\xfe", b"r/1", b"*"]
        )


# ---------------------------------------------------------------------------------------------
# Predicting each input's code


def _outcome(item: WorkItem) -> str:
    if item.dead_reason is not None:
        return "DEAD"
    if item.rejection is not None:
        return item.rejection.code
    return "OK"


def _expected(item: WorkItem, schema: Schema, now_ms: int) -> frozenset[str]:
    """Codes the worker may answer ``item`` with, from admit, the value screen and the deadline."""
    code = _outcome(item)
    if code != "OK" or item.request is None:
        return frozenset({code})
    if schema.screen(item.request.inputs, [item.request]):
        code = "INVALID_INPUT"
    deadline = item.deadline_ms
    if deadline is None or deadline > now_ms + 600_000:
        return frozenset({code})
    if deadline < now_ms:
        return frozenset({"DEADLINE_EXCEEDED", code})  # which check runs first is the worker's
    return frozenset({code, "DEADLINE_EXCEEDED"})  # near now: either is right


def _entry(rid: bytes, body: bytes | None) -> RawEntry:
    fields = {b"rid": rid} if body is None else {b"rid": rid, b"body": body}
    return RawEntry(b"%d-0" % int(time.time() * 1000), fields)


def _vm_rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None  # a zombie has no VmRSS


class _Rss:
    """Start, peak and end resident memory of one process, sampled as the run goes."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start_kb = self.peak_kb = self.end_kb = _vm_rss_kb(pid) or 0
        self.timeline_kb: list[int] = []  # one sample per tenth of the run: flat or a slope?

    def sample(self) -> bool:
        """Take a sample; False when the process is gone."""
        kb = _vm_rss_kb(self.pid)
        if kb is None:
            return False
        self.end_kb = kb
        self.peak_kb = max(self.peak_kb, kb)
        return True

    def summary(self) -> dict[str, Any]:
        mb = 1024.0
        return {
            "start": round(self.start_kb / mb, 1),
            "peak": round(self.peak_kb / mb, 1),
            "end": round(self.end_kb / mb, 1),
            "growth": round((self.end_kb - self.start_kb) / mb, 1),
            "by_tenth": [round(kb / mb, 1) for kb in self.timeline_kb],
        }


# ---------------------------------------------------------------------------------------------
# Driver (a): admit in-process


def fuzz_admit(
    n: int,
    seed: int,
    *,
    target: FuzzTarget | None = None,
    track_allocations: bool = False,
) -> dict[str, Any]:
    """Run ``admit`` on ``n`` fuzzed entries; any exception escaping it is recorded, not raised.

    With ``track_allocations`` each admit runs under tracemalloc (several times slower) and the
    summary holds the largest peak one input allocated, against its body size.
    """
    target = target or FuzzTarget()
    schema = schema_for(target)
    mutator = Mutator(target, seed)
    outcomes: Counter[str] = Counter()
    failures: list[dict[str, Any]] = []
    worst: dict[str, Any] = {"bytes": 0, "body_bytes": 0, "index": -1, "mutation": ""}
    rss = _Rss(os.getpid())
    if track_allocations:
        tracemalloc.start()
    started = time.perf_counter()
    try:
        for index in range(n):
            rid, body, mutation = _fuzz_entry(mutator, index)
            if track_allocations:
                tracemalloc.reset_peak()
                base = tracemalloc.get_traced_memory()[0]
            try:
                item = admit(_entry(rid, body), schema, target.max_request_bytes)
            except Exception as exc:  # the finding itself: admit must never raise
                outcomes["EXCEPTION"] += 1
                failures.append(_failure(index, mutation, "EXCEPTION", repr(exc)))
                continue
            code = _outcome(item)
            outcomes[code] += 1
            if code not in ADMIT_CODES:
                failures.append(_failure(index, mutation, code, _message(item)))
            if track_allocations:
                grew = tracemalloc.get_traced_memory()[1] - base
                if grew > worst["bytes"]:
                    worst = {
                        "bytes": grew,
                        "body_bytes": len(body or b""),
                        "index": index,
                        "mutation": mutation,
                    }
            if index % 1000 == 0:
                rss.sample()
            if (index + 1) * 10 // n > index * 10 // n:
                rss.timeline_kb.append(rss.end_kb)
    finally:
        if track_allocations:
            tracemalloc.stop()
    rss.sample()
    elapsed = time.perf_counter() - started
    return {
        "seed": seed,
        "model": target.model,
        "inputs": n,
        "outcomes": dict(sorted(outcomes.items())),
        "failures": len(failures),
        "failure_examples": failures[:10],
        "max_alloc_per_input": worst if track_allocations else None,
        "rss_mb": rss.summary(),
        "elapsed_s": round(elapsed, 2),
        "ok": not failures,
    }


def _fuzz_entry(mutator: Mutator, index: int) -> tuple[bytes, bytes | None, str]:
    """The index-th entry: mostly a fuzzed body under a good rid, sometimes a bad rid or no body."""
    roll = mutator.rng.random()
    rid = f"fz-{index}".encode()
    if roll < 0.01:
        return mutator.bad_rid(), mutator.valid_body(), "bad_rid"
    if roll < 0.015:
        return rid, None, "no_body"
    mutation, body = mutator.mutate()
    return rid, body, mutation


def _message(item: WorkItem) -> str:
    return item.rejection.message[:300] if item.rejection is not None else ""


def _failure(index: int, mutation: str, code: str, detail: str) -> dict[str, Any]:
    return {"index": index, "mutation": mutation, "code": code, "detail": detail[:300]}


# ---------------------------------------------------------------------------------------------
# Driver (b): a real worker, through Redis


@dataclass(slots=True)
class _Sent:
    """What is known about one input sent: its rid, how it was made and the codes allowed."""

    rid: str
    mutation: str
    expected: frozenset[str]
    healthy: dict[str, np.ndarray] | None = None
    rows: int = 0
    outputs: tuple[str, ...] = ()
    may_expire: bool = False


def wait_for_worker(redis_url: str, target: FuzzTarget, timeout_s: float = 120.0) -> None:
    """Block until a worker has registered for ``target.model`` (it registers once warmed up)."""
    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + timeout_s
        while not client.scard(workers_key(target.prefix, target.model)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no worker registered for {target.model} in {timeout_s}s")
            time.sleep(0.1)
    finally:
        client.close()


def fuzz_worker(
    redis_url: str,
    n: int,
    seed: int,
    *,
    target: FuzzTarget | None = None,
    worker_pid: int | None = None,
    healthy_every: int = 50,
    reference: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
    chunk: int = 500,
    window: int = 5000,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Send ``n`` fuzzed entries (plus a healthy request every ``healthy_every``) to a running
    worker and check every answer; returns a plain summary dict (see ``_summary`` for keys).

    XADDs go out pipelined in chunks, keeping at most ``window`` entries unanswered; replies are
    read back in bulk once the stream is drained. ``worker_pid`` (a subprocess worker) is
    watched for death and its VmRSS sampled; without it this process's RSS is sampled, which
    suits a worker running in a thread here. ``reference`` maps a healthy request's inputs to
    the outputs a bare runtime gives, to check healthy answers by value.
    """
    target = target or FuzzTarget()
    client = redis.Redis.from_url(redis_url, socket_timeout=60)
    stream = request_stream(target.prefix, target.model)
    dead = dead_key(target.prefix, target.model)
    schema = schema_for(target)
    mutator = Mutator(target, seed)
    tag = secrets.token_hex(3)
    rss = _Rss(worker_pid or os.getpid())
    dead_before = client.xlen(dead)
    sent: list[_Sent] = []
    bad_rids = 0
    alive = True
    started = time.perf_counter()
    try:
        for first in range(0, n, chunk):
            alive = _wait_backlog(client, stream, window, rss, worker_pid, timeout_s)
            if not alive:
                break
            pipe = client.pipeline(transaction=False)
            now_ms = int(time.time() * 1000)
            for index in range(first, min(first + chunk, n)):
                if healthy_every and index % healthy_every == 0:
                    sent.append(_healthy(mutator, f"fz{tag}-h{index}", pipe, stream))
                rid, body, mutation = _fuzz_entry(mutator, index)
                fields = {b"rid": rid} if body is None else {b"rid": rid, b"body": body}
                pipe.xadd(stream, fields)  # type: ignore[arg-type]
                item = admit(_entry(rid, body), schema, target.max_request_bytes)
                if item.dead_reason is not None:
                    bad_rids += 1
                    continue
                sent.append(_predicted(rid.decode(), item, mutation, schema, now_ms))
            pipe.execute()
            if (first + chunk) * 10 // n > first * 10 // n:
                rss.timeline_kb.append(rss.end_kb)
        alive = alive and _wait_backlog(client, stream, 0, rss, worker_pid, timeout_s)
        rss.sample()
        drained_s = time.perf_counter() - started
        result = _collect(client, target, sent, reference)
        result["dead_lettered"] = client.xlen(dead) - dead_before
    finally:
        client.close()
    return _summary(target, seed, n, sent, bad_rids, result, alive, rss, drained_s)


def _healthy(mutator: Mutator, rid: str, pipe: Any, stream: str) -> _Sent:
    inputs = mutator.valid_inputs()
    pipe.xadd(stream, {"rid": rid, "body": encode_request(inputs)})
    rows = next(iter(inputs.values())).shape[0]
    outputs = tuple(mutator.spec.outputs)
    return _Sent(rid, "healthy", frozenset({"OK"}), inputs, rows, outputs)


def _predicted(rid: str, item: WorkItem, mutation: str, schema: Schema, now_ms: int) -> _Sent:
    entry = _Sent(rid, mutation, _expected(item, schema, now_ms))
    entry.may_expire = item.reply_ttl_s is not None and item.reply_ttl_s < _MIN_TTL_S
    if item.request is not None:
        entry.rows = item.request.rows
        entry.outputs = item.request.outputs
    return entry


def _wait_backlog(
    client: redis.Redis,
    stream: str,
    limit: int,
    rss: _Rss,
    worker_pid: int | None,
    timeout_s: float,
) -> bool:
    """Wait until at most ``limit`` entries are unanswered; False if the worker died."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not rss.sample() and worker_pid is not None:
            return False
        pipe = client.pipeline(transaction=False)
        pipe.xlen(stream)
        pipe.xpending(stream, CONSUMER_GROUP)
        try:
            backlog, pending = pipe.execute()
        except redis.ResponseError:  # no group yet: the worker has not started
            backlog, pending = client.xlen(stream), {"pending": 0}
        if backlog <= limit and (limit or not pending["pending"]):
            return True
        if time.monotonic() > deadline:
            raise TimeoutError(f"{backlog} entries still unanswered after {timeout_s}s")
        time.sleep(0.02 if limit else 0.05)


def _collect(
    client: redis.Redis,
    target: FuzzTarget,
    sent: list[_Sent],
    reference: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None,
) -> dict[str, Any]:
    """Read every reply key (LLEN and LINDEX, pipelined), check it, then delete it."""
    codes: Counter[str] = Counter()
    counts = Counter[str]()
    examples: list[dict[str, Any]] = []

    def fail(kind: str, s: _Sent, detail: str) -> None:
        counts[kind] += 1
        if len(examples) < 10:
            examples.append({"kind": kind, "rid": s.rid, "mutation": s.mutation, "detail": detail})

    for first in range(0, len(sent), 1000):
        part = sent[first : first + 1000]
        pipe = client.pipeline(transaction=False)
        for s in part:
            key = reply_key(target.prefix, s.rid)
            pipe.llen(key)
            pipe.lindex(key, 0)
            pipe.delete(key)
        answers = pipe.execute()
        for offset, s in enumerate(part):
            length, raw = answers[3 * offset], answers[3 * offset + 1]
            if not length:
                if s.may_expire:
                    counts["expired_unchecked"] += 1  # asked for a short reply_ttl_s
                else:
                    fail("missing_replies", s, "no reply")
                continue
            if length > 1:
                fail("duplicate_replies", s, f"{length} replies")
            try:
                reply = decode_reply(raw)
            except WireFormatError as exc:
                fail("undecodable_replies", s, str(exc)[:200])
                continue
            code = "OK" if reply.ok else reply.error.code if reply.error else "?"
            codes[code] += 1
            if code not in WORKER_CODES:
                fail("unexpected_codes", s, _detail(reply))
            elif code not in s.expected:
                fail("wrong_codes", s, f"expected {sorted(s.expected)}: {_detail(reply)}")
            elif reply.ok and not _outputs_fit(reply, s, reference):
                fail("wrong_outputs", s, _detail(reply))
    return {
        "replies_by_code": dict(sorted(codes.items())),
        "failures": counts,
        "examples": examples,
    }


def _detail(reply: Reply) -> str:
    if reply.ok:
        shapes = {n: list(a.shape) for n, a in (reply.outputs or {}).items()}
        return f"OK {shapes}"
    assert reply.error is not None
    return f"{reply.error.code}: {reply.error.message[:200]}"


def _outputs_fit(
    reply: Reply,
    s: _Sent,
    reference: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None,
) -> bool:
    """The asked-for outputs, each with the request's rows; healthy ones by value if we can."""
    outputs = reply.outputs or {}
    if set(outputs) != set(s.outputs) or any(a.shape[:1] != (s.rows,) for a in outputs.values()):
        return False
    if s.healthy is None or reference is None:
        return True
    expected = reference(s.healthy)
    return all(np.allclose(outputs[name], expected[name], rtol=1e-4, atol=1e-5) for name in outputs)


def _summary(
    target: FuzzTarget,
    seed: int,
    n: int,
    sent: list[_Sent],
    bad_rids: int,
    result: dict[str, Any],
    alive: bool,
    rss: _Rss,
    drained_s: float,
) -> dict[str, Any]:
    failures: Counter[str] = result["failures"]
    healthy = sum(1 for s in sent if s.healthy is not None)
    dead_ok = result["dead_lettered"] == bad_rids
    keys = ("missing_replies", "duplicate_replies", "undecodable_replies", "unexpected_codes")
    counts = {k: failures.get(k, 0) for k in (*keys, "wrong_codes", "wrong_outputs")}
    expired = failures.get("expired_unchecked", 0)
    return {
        "seed": seed,
        "model": target.model,
        "max_request_bytes": target.max_request_bytes,
        "max_batch_size": target.max_batch_size,
        "inputs": n,
        "healthy_requests": healthy,
        "bad_rid_entries": bad_rids,
        "dead_lettered": result["dead_lettered"],
        "replies_by_code": result["replies_by_code"],
        **counts,
        "expired_unchecked": expired,
        "crashes": 0 if alive else 1,
        "worker_alive": alive,
        "worker_rss_mb": rss.summary(),
        "elapsed_s": round(drained_s, 1),
        "inputs_per_s": round(n / drained_s) if drained_s else 0,
        "failure_examples": result["examples"],
        "ok": alive and dead_ok and not any(counts.values()),
    }


def iter_bodies(target: FuzzTarget, seed: int, n: int) -> Iterator[tuple[str, bytes]]:
    """The first ``n`` fuzzed bodies of ``seed`` with their mutation names, for tests."""
    mutator = Mutator(target, seed)
    for _ in range(n):
        yield mutator.mutate()
