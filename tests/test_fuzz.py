"""Fuzzing, fast tier: no input crashes, hangs or bloats the decoder, admit or a real worker.

Each hostile-input rule has an explicit case; hypothesis and the seeded mutator of
``tests/fuzzing/`` cover the space between them. Everything is seeded or derandomized, so a
failure here fails the same way on every run. The full tier (100,000 inputs and more through a
subprocess worker) is ``fuzz_worker`` called from ``scripts/reliability.py``.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import onnxruntime as ort
import pytest
import redis
from fuzzing import (
    ADMIT_CODES,
    INVALID_UTF8,
    FuzzTarget,
    Mutator,
    fuzz_admit,
    fuzz_worker,
    iter_bodies,
    raw_str,
    schema_for,
    text_schema,
)
from harness import running_worker, write_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer.protocol import bounded as guards
from producer.protocol import codec
from producer.protocol.errors import WireFormatError
from worker.intake.admit import admit
from worker.intake.layouts import Layouts
from worker.items import DeadLetter, Refused
from worker.redisio.stream import RawEntry

TARGET = FuzzTarget("demo", max_request_bytes=16384, max_batch_size=8)
SCHEMA = schema_for(TARGET)
BIG = 16 * 1024 * 1024  # the default max_request_bytes
FAST = settings(
    max_examples=300,
    deadline=2000,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FEATURES = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
TENSOR = {"dtype": "float32", "shape": [1, 16], "data": FEATURES.tobytes()}


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def with_raw(key: str, raw: bytes) -> bytes:
    """A valid demo body plus ``key`` whose value is the raw msgpack ``raw``."""
    return b"\x82" + pack("inputs") + pack({"features": TENSOR}) + pack(key) + raw


def tensor_with_raw(field: str, raw: bytes) -> bytes:
    """A demo body whose tensor's ``field`` is the raw msgpack ``raw``."""
    fields = {k: v for k, v in TENSOR.items() if k != field}
    inner = b"\x83" + b"".join(pack(k) + pack(v) for k, v in fields.items()) + pack(field) + raw
    return b"\x81" + pack("inputs") + b"\x81" + pack("features") + inner


def outcome(body: bytes, max_bytes: int = TARGET.max_request_bytes) -> str:
    """admit's answer for a body: OK or the code; admit raising fails the test."""
    item = admit(RawEntry(b"1-0", {b"rid": b"r1", b"body": body}), SCHEMA, max_bytes)
    assert not isinstance(item, DeadLetter)
    return item.error.code if isinstance(item, Refused) else "OK"


def refused(body: bytes, max_bytes: int = BIG) -> WireFormatError:
    with pytest.raises(WireFormatError) as info:
        codec.decode_request(body, max_bytes)
    return info.value


def peak_bytes(work: Callable[[], object]) -> int:
    """Peak traced allocation while ``work`` runs, above what was allocated before."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        work()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def decode_or_code(body: bytes, max_bytes: int = TARGET.max_request_bytes) -> str:
    try:
        codec.decode_request(body, max_bytes)
    except WireFormatError as exc:
        return exc.code
    return "OK"


def reply_or_code(raw: bytes) -> str:
    try:
        codec.decode_reply(raw)
    except WireFormatError as exc:
        return exc.code
    return "OK"


# ---------------------------------------------------------------------------------------------
# Hypothesis: the decoder and admit never raise anything else


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(max_size=8) | st.integers(0, 9), inner, max_size=5)
    ),
    max_leaves=20,
)


@FAST
@given(st.binary(max_size=512))
def test_arbitrary_bytes_get_a_wire_format_code(body: bytes) -> None:
    assert decode_or_code(body) in {"MALFORMED", "TOO_LARGE", "OK"}
    assert outcome(body) in ADMIT_CODES


@FAST
@given(msgpack_values)
def test_arbitrary_msgpack_values_as_a_body_or_in_it_get_a_code(value: Any) -> None:
    for body in (pack(value), pack({"inputs": value}), pack({"inputs": {"features": value}})):
        assert outcome(body) in ADMIT_CODES
    assert outcome(with_raw("meta", pack(value))) in {"OK", "TOO_LARGE"}


@FAST
@given(st.integers(0, 2**32), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255))))
def test_byte_edits_of_a_valid_body_get_an_allowed_code(seed: int, edits: list[Any]) -> None:
    body = bytearray(Mutator(TARGET, seed).valid_body())
    for at, value in edits:
        body[at % len(body)] = value
    assert outcome(bytes(body)) in ADMIT_CODES


@FAST
@given(st.integers(0, 2**32), st.integers(0, 10**6), st.integers(0, 10**6))
def test_cut_and_spliced_bodies_get_an_allowed_code(seed: int, cut: int, join: int) -> None:
    mutator = Mutator(TARGET, seed)
    one, two = mutator.valid_body(), mutator.valid_body()
    assert outcome(one[: cut % len(one)]) == "MALFORMED"
    assert outcome(one[: cut % len(one)] + two[join % len(two) :]) in ADMIT_CODES


@settings(FAST, max_examples=100)
@given(st.integers(0, 2**32))
def test_seeded_mutations_get_an_allowed_code(seed: int) -> None:
    for _, body in iter_bodies(TARGET, seed, 20):
        assert outcome(body) in ADMIT_CODES


# ---------------------------------------------------------------------------------------------
# Seeded mutator: many inputs through admit, no failure, bounded allocation, flat memory


def test_admit_survives_twenty_thousand_seeded_mutations_with_flat_memory() -> None:
    summary = fuzz_admit(20_000, seed=20240601, target=TARGET)
    assert summary["ok"], summary["failure_examples"]
    assert set(summary["outcomes"]) <= ADMIT_CODES
    assert {"OK", "MALFORMED", "INVALID_INPUT", "TOO_LARGE", "DEAD"} <= set(summary["outcomes"])
    assert summary["rss_mb"]["growth"] < 20, summary["rss_mb"]


def test_no_fuzzed_input_makes_admit_allocate_more_than_a_few_megabytes() -> None:
    summary = fuzz_admit(2_000, seed=7, target=TARGET, track_allocations=True)
    assert summary["ok"], summary["failure_examples"]
    assert summary["max_alloc_per_input"]["bytes"] < 2_000_000, summary["max_alloc_per_input"]


# ---------------------------------------------------------------------------------------------
# Hostile-input rules, one by one


def test_size_limit_is_applied_before_any_decoding() -> None:
    body = b"\xdd\xff\xff\xff\xff" + b"\x90" * 70_000  # an array bomb, but too large first
    err = refused(body, max_bytes=len(body) - 1)
    assert err.code == "TOO_LARGE"
    assert peak_bytes(lambda: decode_or_code(body, len(body) - 1)) < 10_000


@pytest.mark.parametrize(
    "shape",
    [[2**20, 2**20], [2**62, 2**62], [2**64 - 1] * 32, [0, 2**63], [2**31] * 3, [1, 2**40]],
    ids=[
        "2**40-elements",
        "2**124-elements",
        "rank-32-of-uint64-max",
        "zero-and-2**63",
        "2**93",
        "2**40-columns",
    ],
)
def test_huge_declared_shapes_are_malformed_without_allocating(shape: list[int]) -> None:
    body = pack({"inputs": {"features": {"dtype": "float32", "shape": shape, "data": b"\0" * 8}}})
    if 0 in shape:
        body = body.replace(b"\xc4\x08" + b"\0" * 8, b"\xc4\x00")
    assert refused(body).code == "MALFORMED"
    assert peak_bytes(lambda: decode_or_code(body, BIG)) < 100_000


def test_rows_over_max_batch_size_are_too_large() -> None:
    rows = np.zeros((TARGET.max_batch_size + 1, 16), np.float32)
    assert outcome(codec.encode_request({"features": rows})) == "TOO_LARGE"


@pytest.mark.parametrize(
    "raw",
    [
        b"\xdd\xff\xff\xff\xff",
        b"\xdf\xff\xff\xff\xff\xc0",
        b"\xdb\x7f\xff\xff\xffabc",
        b"\xc6\xff\xff\xff\xff\x00",
        b"\xc9\xff\xff\xff\xff\x01ab",
        b"\xdd\x00\x00\x10\x00" * 1000,
        b"\xdf\x00\x00\x10\x00" * 1000,
    ],
    ids=["array32", "map32", "str32", "bin32", "ext32", "nested-arrays", "nested-maps"],
)
@pytest.mark.parametrize("where", ["meta", "shape", "data", "dtype", "outputs"])
def test_declared_but_absent_lengths_are_malformed_without_allocating(
    raw: bytes, where: str
) -> None:
    body = with_raw(where, raw) if where in ("meta", "outputs") else tensor_with_raw(where, raw)
    assert refused(body).code == "MALFORMED"
    assert peak_bytes(lambda: decode_or_code(body, BIG)) < 100_000


def test_a_body_of_empty_containers_is_refused_fast_and_small() -> None:
    # Regression: 16 MB of nested empty lists took 1.2 GB and 9 s to refuse
    inner = b"\xdc\x10\x00" + b"\x90" * 4096
    bomb = b"\xdc" + (4090).to_bytes(2, "big") + inner * 4090
    body = with_raw("meta", bomb)
    started = time.perf_counter()
    assert peak_bytes(lambda: decode_or_code(body, BIG)) < 100_000
    assert time.perf_counter() - started < 5
    assert f"more than {codec.MAX_VALUES}" in str(refused(body))


@pytest.mark.parametrize("where", ["reply_ttl_s value", "key"])
def test_a_bomb_where_error_replies_look_for_meta_and_ttl_is_refused_fast_and_small(
    where: str,
) -> None:
    # Regression: reading a refused body's meta and reply_ttl_s for its error reply unpacked
    # these in full: 5.7 s and 1.15 GB for 16 MiB
    inner = b"\xdc\x10\x00" + b"\x90" * 4096
    bomb = b"\xdc" + (4090).to_bytes(2, "big") + inner * 4090
    body = b"\x81" + (pack("reply_ttl_s") + bomb if where == "key" else bomb + pack(1))
    started = time.perf_counter()
    assert peak_bytes(lambda: decode_or_code(body, BIG)) < 100_000
    assert time.perf_counter() - started < 5
    assert refused(body).code == "MALFORMED"


def test_a_meta_whose_header_declares_more_than_follows_is_malformed() -> None:
    # msgpack's skip reads an ext 32 of 4 GiB as complete; echoed, no other decoder could read
    # the reply back
    assert refused(with_raw("meta", b"\xc9\xff\xff\xff\xff")).code == "MALFORMED"


@pytest.mark.parametrize(
    "level",
    [b"\xdc\x0f\xff", b"\xdc\x03\xff", b"\xde\x01\xff", b"\x9f"],
    ids=["array16-of-4095", "array16-of-1023", "map16-of-511", "fixarray-of-15"],
)
def test_small_msgpack_is_bounded_without_the_header_walk(level: bytes) -> None:
    # At most 1 KiB is not walked first (guards._SMALL); containers are capped at its length,
    # so a hostile one nests at most a third of a KiB of them: a few MB at worst.
    body = with_raw("meta", b"")
    body += (level * 1024)[: guards._SMALL - len(body)]
    raw = (level * 1024)[: guards._SMALL]
    assert len(body) == len(raw) == guards._SMALL
    assert decode_or_code(body, BIG) == "MALFORMED"
    assert peak_bytes(lambda: decode_or_code(body, BIG)) < 4_000_000
    assert reply_or_code(raw) == "MALFORMED"
    assert peak_bytes(lambda: reply_or_code(raw)) < 4_000_000


def test_a_container_as_long_as_a_small_body_allows_is_accepted() -> None:
    meta = [0] * 900  # 900 values in 903 bytes: the cap is the body's length, never below it
    body = with_raw("meta", pack(meta))
    assert len(body) <= guards._SMALL
    assert codec.decode_request(body, BIG).meta_raw == pack(meta)


def test_values_up_to_the_limit_are_accepted() -> None:
    meta = [0] * 4090  # 4 KiB of values in meta; the body as a whole stays far under MAX_VALUES
    assert codec.decode_request(with_raw("meta", pack(meta)), BIG).meta_raw == pack(meta)


@pytest.mark.parametrize("depth", [10, 100, 1000])
def test_nesting_in_meta_is_echoed_up_to_msgpacks_limit(depth: int) -> None:
    raw = b"\x91" * depth + b"\xc0"
    assert codec.decode_request(with_raw("meta", raw), BIG).meta_raw == raw


@pytest.mark.parametrize("where", ["meta", "outputs", "shape", "dtype", "data"])
@pytest.mark.parametrize("level", [b"\x91", b"\x81\xa1k"], ids=["arrays", "maps"])
def test_deep_nesting_anywhere_is_malformed_with_a_short_message(where: str, level: bytes) -> None:
    # Regression: 'outputs' nested 1000 deep raised RecursionError out of admit
    for depth in (1000, 5000):
        raw = level * depth + b"\xc0"
        body = with_raw(where, raw) if where in ("meta", "outputs") else tensor_with_raw(where, raw)
        if where == "meta" and depth < 1024:
            continue  # within msgpack's limit, meta may nest (see the test above)
        err = refused(body)
        assert err.code == "MALFORMED"
        assert len(err.message) < 500
        assert outcome(body) == "MALFORMED"


EXT_VALUES = {
    "fixext1": b"\xd4\x01\x00",
    "fixext16": b"\xd8\x05" + b"\0" * 16,
    "ext8": b"\xc7\x03\x07abc",
    "empty-ext": b"\xc7\x00\x05",
    "timestamp": b"\xd6\xff\x00\x00\x00\x01",
}


@pytest.mark.parametrize("raw", EXT_VALUES.values(), ids=EXT_VALUES.keys())
@pytest.mark.parametrize("where", ["outputs", "deadline_ms", "shape", "dtype", "data"])
def test_ext_types_are_malformed_anywhere_but_meta(raw: bytes, where: str) -> None:
    body = with_raw(where, raw) if where in ("outputs", "deadline_ms") else None
    body = body or tensor_with_raw(where, raw)
    assert refused(body).code == "MALFORMED"
    assert refused(raw).code == "MALFORMED"


@pytest.mark.parametrize("raw", EXT_VALUES.values(), ids=EXT_VALUES.keys())
def test_ext_types_in_meta_are_answered_and_echoed(raw: bytes) -> None:
    # The contract lets meta be any msgpack value; the worker only echoes its bytes
    assert codec.decode_request(with_raw("meta", raw), BIG).meta_raw == raw
    assert outcome(with_raw("meta", raw)) == "OK"


@pytest.mark.parametrize("key", [1, -1, b"inputs", None, 1.5, True], ids=repr)
def test_non_string_keys_are_malformed_in_the_body_inputs_and_tensors(key: Any) -> None:
    assert outcome(pack({"inputs": {"features": TENSOR}, key: 1})) == "MALFORMED"
    assert outcome(pack({"inputs": {key: TENSOR}})) == "MALFORMED"
    assert outcome(pack({"inputs": {"features": {**TENSOR, key: 1}}})) == "MALFORMED"


def test_meta_may_use_non_string_keys_as_any_msgpack_value() -> None:
    # The contract lets meta be any msgpack value (and test_codec pins it): only its size counts
    raw = pack({1: "a", None: [b"x"], 2.5: {True: 0}})
    assert codec.decode_request(with_raw("meta", raw), BIG).meta_raw == raw


@pytest.mark.parametrize(("size", "code"), [(4095, "OK"), (4096, "OK"), (4097, "TOO_LARGE")])
def test_meta_over_4_kib_encoded_is_too_large(size: int, code: str) -> None:
    assert outcome(with_raw("meta", pack(b"m" * (size - 3)))) == code


def test_a_long_string_in_meta_is_too_large_by_meta_s_own_limit() -> None:
    assert refused(with_raw("meta", pack("s" * 70_000))).code == "TOO_LARGE"


@pytest.mark.parametrize("where", ["dtype", "outputs"])
def test_long_strings_outside_tensor_data_are_malformed_and_quoted_short(where: str) -> None:
    raw = pack("s" * 70_000)
    body = with_raw(where, raw) if where != "dtype" else tensor_with_raw(where, raw)
    err = refused(body)
    assert err.code == "MALFORMED"
    assert len(err.message) < 400


@pytest.mark.parametrize(
    "body",
    [
        pack({"inputs": {b"\xff" * 60_000: TENSOR}}),
        pack({"inputs": {"features": {**TENSOR, "dtype": "d" * 60_000}}}),
        pack({"inputs": {"features": {**TENSOR, "shape": ["x" * 60_000]}}}),
        pack({"inputs": {"features": TENSOR}, **{"k" * 1000 + str(i): 1 for i in range(100)}}),
        pack({"inputs": {"features": TENSOR}, "outputs": [1, "y" * 60_000]}),
        pack({"inputs": {"features": TENSOR}, "deadline_ms": "z" * 60_000}),
    ],
    ids=["bin-name", "long-dtype", "long-dim", "many-long-keys", "long-output", "long-deadline"],
)
def test_error_messages_stay_short_whatever_the_body_holds(body: bytes) -> None:
    # Regression: a 60 KB bin name made a 240 KB message, written into the reply
    err = refused(body)
    assert err.code == "MALFORMED"
    assert len(err.message) < 1000


# ---------------------------------------------------------------------------------------------
# (v2) String and bytes tensors: their own rules, and what a hostile one may cost

ASTRAL = "\U0001f600"  # 4 bytes of UTF-8; makes Python hold its whole str at 4 bytes a character


def text_body(dtype: str, shape: Any, data: Any) -> bytes:
    """A demo body whose one input is a ``dtype`` tensor; "\x00placeholder" in ``data`` marks
    where ``spliced`` puts raw msgpack."""
    return pack({"inputs": {"features": {"dtype": dtype, "shape": shape, "data": data}}})


def spliced(body: bytes, raw: bytes) -> bytes:
    return body.replace(pack("\x00placeholder"), raw, 1)


def text_outcome(body: bytes, max_element_bytes: int | None = None) -> tuple[str, str]:
    """(code, message) of decoding ``body``; anything but WireFormatError fails the test."""
    try:
        codec.decode_request(body, BIG, max_element_bytes)
    except WireFormatError as exc:
        return exc.code, exc.message
    return "OK", ""


def seconds(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


@pytest.mark.parametrize("bad", INVALID_UTF8, ids=lambda b: b.hex())
@pytest.mark.parametrize("where", ["first", "last-of-many", "bytes-tensor", "0-d"])
def test_invalid_utf8_in_a_text_tensor_is_malformed_with_a_short_message(
    bad: bytes, where: str
) -> None:
    element = raw_str(b"x" * 60_000 + bad)  # long, so an echo would show
    if where == "first":
        body = text_body("string", [1, 2], ["\x00placeholder", "b"])
    elif where == "last-of-many":
        body = text_body("string", [1, 1000], ["a"] * 999 + ["\x00placeholder"])
    elif where == "bytes-tensor":
        body = text_body("bytes", [1, 2], [b"a", "\x00placeholder"])
    else:
        body = text_body("string", [], ["\x00placeholder"])
    body = spliced(body, element)
    code, message = text_outcome(body)
    assert code == "MALFORMED"
    assert "not valid UTF-8" in message
    assert "'bytes' tensor" in message
    assert len(message) < 300
    assert outcome(body, BIG) == "MALFORMED"


@pytest.mark.parametrize(
    ("element", "factor"),
    [(b"\xff" * (BIG - 100), 4), ("e" * (BIG - 100), 4), (ASTRAL * (BIG // 4 - 25), 7)],
    ids=["bytes", "ascii-str", "astral-str"],
)
def test_a_huge_element_is_too_large_cheaply_and_not_echoed(
    element: str | bytes, factor: int
) -> None:
    # Given a body of one element of almost 16 MiB, and a 1 MiB max_element_bytes
    body = text_body("bytes" if isinstance(element, bytes) else "string", [1], [element])
    assert len(body) <= BIG
    # Then it is refused by size, in bounded time and memory, naming the size only
    code, message = text_outcome(body, 1 << 20)
    assert code == "TOO_LARGE"
    assert f"is {BIG - 100} bytes, over limits.max_element_bytes=1048576" in message
    assert len(message) < 200
    assert seconds(lambda: text_outcome(body, 1 << 20)) < 2
    assert peak_bytes(lambda: text_outcome(body, 1 << 20)) < factor * len(body)


@pytest.mark.parametrize(
    ("dtype", "shape", "data"),
    [
        ("string", [1, 1000], [""] * 1000),
        ("bytes", [1, 1000], [b""] * 1000),
        ("string", [0], []),
        ("bytes", [3, 0], []),
        ("string", [], [""]),
    ],
    ids=["empty-strs", "empty-bins", "shape-0", "shape-3x0", "0-d-empty"],
)
def test_empty_elements_and_empty_tensors_are_well_formed(
    dtype: str, shape: list[int], data: list[Any]
) -> None:
    body = text_body(dtype, shape, data)
    assert text_outcome(body, 0) == ("OK", "")
    # The demo model takes float32: the worker answers that, not MALFORMED
    assert outcome(body, BIG) == "INVALID_INPUT"


@pytest.mark.parametrize(
    "shape",
    [[2**64 - 1] * 32, [2**62, 2**62], [0, 2**63], [2**31] * 3, [3], [1], [], [0]],
    ids=["rank-32-of-uint64-max", "2**124", "zero-and-2**63", "2**93", "3", "1", "0-d", "0"],
)
@pytest.mark.parametrize("dtype", ["string", "bytes"])
def test_counts_that_do_not_match_the_shape_are_malformed_without_allocating(
    dtype: str, shape: list[int]
) -> None:
    data: list[Any] = ["a", "b"] if dtype == "string" else [b"a", b"b"]
    body = text_body(dtype, shape, data)
    code, message = text_outcome(body)
    assert code == "MALFORMED"
    assert "data has 2 elements but shape" in message
    assert len(message) < 400  # regression: a rank-32 shape made a 1,373-character message
    assert peak_bytes(lambda: text_outcome(body)) < 100_000


@pytest.mark.parametrize("dtype", ["string", "bytes"])
def test_many_tiny_elements_cost_little_up_to_the_value_limit(dtype: str) -> None:
    # Given as many distinct one- to four-byte elements as a body may hold values
    n = codec.MAX_VALUES - 16
    elements = [f"{i:x}" if dtype == "string" else f"{i:x}".encode() for i in range(n)]
    body = text_body(dtype, [1, n], elements)
    # Then they are read in well under a second, at under ~120 bytes an element
    assert text_outcome(body, 4) == ("OK", "")
    assert seconds(lambda: text_outcome(body, 4)) < 1
    assert peak_bytes(lambda: text_outcome(body, 4)) < 120 * n
    assert outcome(body, BIG) == "INVALID_INPUT"


@pytest.mark.parametrize("n", [codec.MAX_VALUES, 200_000])
@pytest.mark.parametrize("dtype", ["string", "bytes"])
def test_more_elements_than_the_value_limit_are_refused_before_any_is_built(
    dtype: str, n: int
) -> None:
    body = text_body(dtype, [n], ["" if dtype == "string" else b""] * n)
    code, message = text_outcome(body)
    assert code == "MALFORMED"
    assert f"more than {codec.MAX_VALUES} msgpack values" in message
    assert "string or bytes tensor" in message
    assert seconds(lambda: text_outcome(body)) < 0.5
    assert peak_bytes(lambda: text_outcome(body)) < 100_000


@pytest.mark.parametrize("depth", [1, 100, 1000, 5000])
@pytest.mark.parametrize("level", [b"\x91", b"\x81\xa1k"], ids=["arrays", "maps"])
@pytest.mark.parametrize("dtype", ["string", "bytes"])
def test_nesting_in_place_of_an_element_is_malformed_with_a_short_message(
    dtype: str, level: bytes, depth: int
) -> None:
    good: Any = "a" if dtype == "string" else b"a"
    body = text_body(dtype, [1, 3], [good, "\x00placeholder", good])
    body = spliced(body, level * depth + b"\xc0")
    code, message = text_outcome(body)
    assert code == "MALFORMED"
    assert len(message) < 300
    assert outcome(body, BIG) == "MALFORMED"
    assert peak_bytes(lambda: text_outcome(body)) < 4_000_000


@pytest.mark.parametrize(
    "raw",
    [
        b"\xdd\xff\xff\xff\xff",
        b"\xdb\x7f\xff\xff\xffabc",
        b"\xc6\xff\xff\xff\xff\x00",
        b"\xdf\xff\xff\xff\xff\xc0",
        b"\xdd\x00\x00\x10\x00" * 1000,
    ],
    ids=["array32", "str32", "bin32", "map32", "nested-arrays"],
)
@pytest.mark.parametrize("where", ["element", "data"])
def test_declared_but_absent_lengths_in_text_data_are_malformed_without_allocating(
    raw: bytes, where: str
) -> None:
    data: Any = ["a", "\x00placeholder"] if where == "element" else "\x00placeholder"
    body = spliced(text_body("string", [2], data), raw)
    assert text_outcome(body)[0] == "MALFORMED"
    assert peak_bytes(lambda: text_outcome(body)) < 100_000


def test_invalid_utf8_late_in_a_large_body_is_refused_in_bounded_time_and_memory() -> None:
    # Given 16 MiB of strings Python holds at 4 bytes a character, the last one not UTF-8:
    # the unpacker builds them all before it meets it, and the body is read twice (the second
    # pass steps around 'meta', which may hold such bytes)
    element = "a" * 250 + ASTRAL  # 256 bytes with its header
    n = 65_000  # under MAX_VALUES, which would refuse the body before reading any
    body = text_body("string", [n], [element] * (n - 1) + ["\x00placeholder"])
    body = spliced(body, raw_str(b"a" * 250 + b"\xf0\x9f\x98"))
    assert BIG - 200_000 < len(body) <= BIG
    code, message = text_outcome(body)
    assert code == "MALFORMED"
    assert message.startswith("body holds a msgpack str that is not valid UTF-8")
    assert seconds(lambda: text_outcome(body)) < 5
    # Memory, measured on an eighth of it (tracing 65,000 strings is slow)
    small = text_body("string", [n // 8], [element] * (n // 8 - 1) + ["\x00placeholder"])
    small = spliced(small, raw_str(b"\xff"))
    assert text_outcome(small)[0] == "MALFORMED"
    assert peak_bytes(lambda: text_outcome(small)) < 8 * len(small)


def test_admit_on_a_text_model_gives_every_text_mutation_an_allowed_code() -> None:
    # Given a model that takes strings, so text mutations get past the dtype check, with a
    # 64-byte max_element_bytes; and the layouts a worker keeps, which must never admit a body
    # that decoding would refuse
    schema = text_schema(TARGET, max_element_bytes=64)
    mutator = Mutator(TARGET, 11)
    layouts = Layouts()
    codes: Counter[str] = Counter()
    for index in range(1000):
        entry = RawEntry(b"1-0", {b"rid": b"r%d" % index, b"body": mutator.text_mutation()})
        limits = {"max_request_bytes": TARGET.max_request_bytes, "max_element_bytes": 64}
        item = admit(entry, schema, **limits)
        fast = admit(entry, schema, layouts=layouts, **limits)
        code = item.error.code if isinstance(item, Refused) else "OK"
        assert code == (fast.error.code if isinstance(fast, Refused) else "OK")
        if isinstance(item, Refused):
            assert len(item.error.message) < 500
            codes["over max_element_bytes"] += "max_element_bytes" in item.error.message
        codes[code] += 1
    assert {"OK", "MALFORMED", "INVALID_INPUT", "TOO_LARGE"} <= set(codes), codes
    assert codes["over max_element_bytes"], codes


@settings(FAST, max_examples=100)
@given(msgpack_values, st.sampled_from(["string", "bytes"]), st.booleans())
def test_arbitrary_msgpack_values_as_text_data_or_elements_get_a_code(
    value: Any, dtype: str, as_element: bool
) -> None:
    data = ["a" if dtype == "string" else b"a", value] if as_element else value
    body = text_body(dtype, [1, 2], data)
    assert text_outcome(body, 8)[0] in {"OK", "MALFORMED", "TOO_LARGE"}
    assert outcome(body) in ADMIT_CODES


@pytest.mark.parametrize(
    ("data", "shape"),
    [(["a", "\x00placeholder"], [2]), (["a"], [2**64 - 1] * 32), (["a", b"b"], [2])],
    ids=["invalid-utf8", "count", "element-type"],
)
def test_replies_with_hostile_text_outputs_are_refused_short(data: Any, shape: Any) -> None:
    doc = {
        "rid": "r1",
        "ok": True,
        "outputs": {"y": {"dtype": "string", "shape": shape, "data": data}},
        "model": {"name": "demo", "version": "1", "sha256": "0" * 64},
        "worker": "w",
        "timings_ms": {"queued": 0.0, "inference": 0.0},
    }
    raw = spliced(pack(doc), raw_str(b"\xff" * 5000))  # the first case's placeholder
    assert reply_or_code(raw) == "MALFORMED"
    with pytest.raises(WireFormatError) as info:
        codec.decode_reply(raw)
    assert len(info.value.message) < 400


# ---------------------------------------------------------------------------------------------
# End to end: seeded mutations through a real worker


@pytest.fixture
def demo_config(tmp_path: Path, redis_url: str) -> Path:
    return write_config(
        tmp_path,
        "demo",
        redis_url,
        batching=f"max_batch_size = {TARGET.max_batch_size}\nmax_wait_ms = 2",
        extra=f"[limits]\nmax_request_bytes = {TARGET.max_request_bytes}",
    )


@pytest.fixture
def reference(tmp_path: Path, demo_config: Path) -> Callable[..., dict[str, Any]]:
    """The demo model run by a bare ONNX Runtime session, for checking healthy answers."""
    session = ort.InferenceSession(str(tmp_path / "demo.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return lambda feeds: dict(zip(names, session.run(names, dict(feeds)), strict=True))


def test_worker_answers_every_fuzzed_request_once_with_its_code(
    demo_config: Path, redis_url: str, rconn: redis.Redis, reference: Callable[..., Any]
) -> None:
    with running_worker(demo_config) as worker:
        summary = fuzz_worker(
            redis_url, 3000, seed=424242, target=TARGET, healthy_every=20, reference=reference
        )
        assert not worker.stop.is_set()
    assert summary["ok"], json.dumps(summary, indent=1)
    assert summary["healthy_requests"] == 150
    assert summary["dead_lettered"] == summary["bad_rid_entries"] > 0
    assert {"OK", "MALFORMED", "INVALID_INPUT", "TOO_LARGE"} <= set(summary["replies_by_code"])
