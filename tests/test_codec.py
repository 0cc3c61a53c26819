"""The wire codec round-trips every value the contract allows and refuses all else by name."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_strategies import DTYPE_NAMES, RID, a_reply, arrays, meta_values, names

from producer.protocol import codec
from producer.protocol.bounded import quote
from producer.protocol.errors import ERROR_CODES, WireFormatError

MAX_BYTES = 1 << 20
CONTRACT_EXAMPLE = bytes.fromhex(
    "81a6696e7075747381a17883a56474797065a7666c6f61743332a57368617065920102"
    "a464617461c4080000803f000020c0"
)
MISSING = object()


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def tensor(**changes: Any) -> dict[str, Any]:
    """The contract example's tensor with some keys changed (MISSING removes one)."""
    t: dict[str, Any] = {"dtype": "float32", "shape": [1, 2], "data": struct.pack("<2f", 1, -2.5)}
    t.update(changes)
    return {k: v for k, v in t.items() if v is not MISSING}


def body(**changes: Any) -> dict[str, Any]:
    """The contract example's body with some keys changed (MISSING removes one)."""
    b: dict[str, Any] = {"inputs": {"x": tensor()}}
    b.update(changes)
    return {k: v for k, v in b.items() if v is not MISSING}


def body_with_raw(key: str, raw_value: bytes) -> bytes:
    """The contract example's body plus one key whose value is given as msgpack bytes."""
    return b"\x82" + pack("inputs") + pack({"x": tensor()}) + pack(key) + raw_value


def refused(raw: bytes, max_bytes: int = MAX_BYTES) -> WireFormatError:
    with pytest.raises(WireFormatError) as info:
        codec.decode_request(raw, max_bytes)
    return info.value


def assert_same_array(decoded: np.ndarray, name: str, original: np.ndarray) -> None:
    """Same dtype (little-endian), shape and bytes; bytes so NaN payloads and -0.0 count too."""
    assert decoded.dtype == codec.DTYPES[name]
    assert decoded.dtype.byteorder != ">"
    assert decoded.shape == original.shape
    expected = np.ascontiguousarray(original).astype(codec.DTYPES[name])
    assert decoded.tobytes() == expected.tobytes()


# ---------------------------------------------------------------------------------------------
# Round trips


@settings(max_examples=150, deadline=None)
@given(arrays())
def test_every_dtype_and_layout_round_trips(named: tuple[str, np.ndarray]) -> None:
    name, arr = named
    raw = codec.encode_request({"x": arr})
    decoded = codec.decode_request(raw, MAX_BYTES).inputs["x"]
    assert_same_array(decoded, name, arr)


@settings(max_examples=60, deadline=None)
@given(arrays(min_dims=0))
def test_wire_maps_of_rank_0_to_4_decode(named: tuple[str, np.ndarray]) -> None:
    name, arr = named
    little = np.ascontiguousarray(arr).astype(codec.DTYPES[name])
    wire = {"dtype": name, "shape": list(arr.shape), "data": little.tobytes()}
    decoded = codec.decode_tensor(msgpack.unpackb(pack(wire)), "input 'x'")
    assert_same_array(decoded, name, arr)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_every_dtype_round_trips_its_extremes(name: str) -> None:
    dtype = codec.DTYPES[name]
    if dtype.kind == "b":
        values = np.array([[True, False]])
    elif dtype.kind == "f":
        fi = np.finfo(dtype)
        values = np.array([[fi.min, fi.max, fi.tiny, -0.0, np.inf, np.nan]], dtype)
    else:
        ii = np.iinfo(dtype)
        values = np.array([[ii.min, ii.max, 0]], dtype)
    decoded = codec.decode_request(codec.encode_request({"x": values}), MAX_BYTES).inputs["x"]
    assert_same_array(decoded, name, values)


def test_rank_0_array_round_trips() -> None:
    wire = codec.encode_tensor(np.float32(1.5))
    assert wire["shape"] == []


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3), (1, 0, 4), (3, 2, 0, 1)])
def test_zero_sized_dimensions_round_trip_with_empty_data(shape: tuple[int, ...]) -> None:
    raw = codec.encode_request({"x": np.zeros(shape, np.int16)})
    assert b"\xc4\x00" in raw
    decoded = codec.decode_request(raw, MAX_BYTES).inputs["x"]
    assert decoded.shape == shape
    assert decoded.dtype == np.dtype("<i2")


@settings(max_examples=60, deadline=None)
@given(
    inputs=st.dictionaries(names, arrays(), min_size=1, max_size=3),
    outputs=st.none() | st.lists(names, max_size=3),
    deadline_ms=st.none() | st.integers(0, 2**64 - 1),
    meta=meta_values,
    reply_ttl_s=st.none() | st.integers(1, 2**32),
)
def test_request_bodies_with_optional_keys_round_trip(
    inputs: dict[str, tuple[str, np.ndarray]],
    outputs: list[str] | None,
    deadline_ms: int | None,
    meta: Any,
    reply_ttl_s: int | None,
) -> None:
    raw = codec.encode_request(
        {k: arr for k, (_, arr) in inputs.items()},
        outputs=outputs,
        deadline_ms=deadline_ms,
        meta=meta,
        reply_ttl_s=reply_ttl_s,
    )
    got = codec.decode_request(raw, MAX_BYTES)
    assert set(got.inputs) == set(inputs)
    for key, (name, arr) in inputs.items():
        assert_same_array(got.inputs[key], name, arr)
    assert got.outputs == (None if outputs is None else tuple(outputs))
    assert got.deadline_ms == deadline_ms
    assert got.reply_ttl_s == reply_ttl_s
    assert got.meta_raw == codec.pack_meta(meta)


@settings(max_examples=60, deadline=None)
@given(
    ok=st.booleans(),
    rid=st.from_regex(RID, fullmatch=True),
    outputs=st.dictionaries(names, arrays(), max_size=2),
    error=st.builds(codec.ErrorInfo, st.sampled_from(ERROR_CODES), st.text(), st.booleans()),
    batch_rows=st.integers(1, 4096),
    timings=st.fixed_dictionaries({"queued": st.floats(0, 1e6), "inference": st.floats(0, 1e6)}),
    meta=meta_values,
    sent_meta=st.booleans(),
    single_float=st.booleans(),
)
def test_replies_round_trip_and_echo_meta_bytes(
    ok: bool,
    rid: str,
    outputs: dict[str, tuple[str, np.ndarray]],
    error: codec.ErrorInfo,
    batch_rows: int,
    timings: dict[str, float],
    meta: Any,
    sent_meta: bool,
    single_float: bool,
) -> None:
    # Given meta as some sender wrote it (floats maybe as float 32, which unpack/pack would widen)
    meta_raw = msgpack.packb(meta, use_bin_type=True, use_single_float=single_float)
    reply = a_reply(
        rid=rid,
        ok=ok,
        outputs={k: arr for k, (_, arr) in outputs.items()} if ok else None,
        error=None if ok else error,
        batch_rows=batch_rows if ok else None,
        timings_ms=timings,
        meta_raw=meta_raw if sent_meta else None,
    )
    raw = codec.encode_reply(reply)
    got = codec.decode_reply(raw)
    assert (got.rid, got.ok, got.model, got.worker) == (rid, ok, reply.model, reply.worker)
    assert got.timings_ms == timings
    assert got.meta_raw == (meta_raw if sent_meta else None)
    if ok:
        assert got.error is None
        assert got.batch_rows == batch_rows
        assert got.outputs is not None
        assert set(got.outputs) == set(outputs)
        for key, (name, arr) in outputs.items():
            assert_same_array(got.outputs[key], name, arr)
    else:
        assert got.outputs is None
        assert got.error == error
    assert codec.encode_reply(got) == raw  # a relay that decodes and re-encodes changes nothing


# ---------------------------------------------------------------------------------------------
# Meta is echoed byte for byte


def test_float32_meta_is_echoed_without_widening() -> None:
    float32_meta = b"\xca" + struct.pack(">f", 0.1)
    assert pack(msgpack.unpackb(float32_meta)) != float32_meta  # decode/re-encode widens it
    request = codec.decode_request(body_with_raw("meta", float32_meta), MAX_BYTES)
    assert request.meta_raw == float32_meta

    raw = codec.encode_reply(a_reply(meta_raw=request.meta_raw))
    assert raw.endswith(pack("meta") + float32_meta)
    reply = codec.decode_reply(raw)
    assert reply.meta_raw == float32_meta
    assert reply.meta == pytest.approx(0.1)


def test_meta_keeps_key_order_and_integer_widths() -> None:
    # Given a map in reverse key order with 1 written as uint16 and 2 as int64
    meta = b"\x82\xa1b\xcd\x00\x01\xa1a\xd3" + struct.pack(">q", 2)
    request = codec.decode_request(body_with_raw("meta", meta), MAX_BYTES)
    assert request.meta_raw == meta
    assert codec.decode_reply(codec.encode_reply(a_reply(meta_raw=meta))).meta_raw == meta


def test_nil_meta_is_a_value_and_is_echoed() -> None:
    request = codec.decode_request(body_with_raw("meta", b"\xc0"), MAX_BYTES)
    assert request.meta_raw == b"\xc0"
    reply = codec.decode_reply(codec.encode_reply(a_reply(meta_raw=b"\xc0")))
    assert reply.meta_raw == b"\xc0"
    assert reply.meta is None


def test_meta_of_4096_bytes_passes_and_4097_is_too_large() -> None:
    at_limit = pack("a" * 4093)  # str 16: 3 header bytes + 4093
    assert len(at_limit) == codec.MAX_META_BYTES
    assert codec.decode_request(body_with_raw("meta", at_limit), MAX_BYTES).meta_raw == at_limit

    err = refused(body_with_raw("meta", pack("a" * 4094)))
    assert err.code == "TOO_LARGE"
    assert "4097 bytes" in str(err)
    assert "4096" in str(err)


# ---------------------------------------------------------------------------------------------
# Size


def test_body_over_max_bytes_is_too_large() -> None:
    assert codec.decode_request(CONTRACT_EXAMPLE, max_bytes=50).inputs["x"].shape == (1, 2)
    err = refused(CONTRACT_EXAMPLE, max_bytes=49)
    assert err.code == "TOO_LARGE"
    assert "50 bytes" in str(err)
    assert "max_request_bytes=49" in str(err)


def test_size_is_checked_before_decoding() -> None:
    err = refused(b"\xc1" * 100, max_bytes=99)  # not msgpack at all, but too large first
    assert err.code == "TOO_LARGE"


# ---------------------------------------------------------------------------------------------
# Every structural fault is MALFORMED, with a message that names it

MALFORMED_CASES = [
    pytest.param(b"\xc1", "not valid msgpack", id="not-msgpack"),
    pytest.param(b"", "not valid msgpack", id="empty-bytes"),
    pytest.param(CONTRACT_EXAMPLE[:-3], "not valid msgpack", id="truncated"),
    pytest.param(CONTRACT_EXAMPLE + b"\xc0", "1 trailing bytes after", id="trailing-bytes"),
    pytest.param(pack([1]) + b"\xc0", "extra data", id="trailing-bytes-not-a-map"),
    pytest.param(pack([1, 2]), "body must be a map, got array", id="not-a-map"),
    pytest.param(pack("inputs"), "body must be a map, got string", id="a-string"),
    pytest.param(pack(body(inputs=MISSING, outputs=["y"])), "missing 'inputs'", id="no-inputs"),
    pytest.param(pack(body(inputs={})), "non-empty map", id="empty-inputs"),
    pytest.param(pack(body(inputs=[tensor()])), "non-empty map", id="inputs-not-a-map"),
    pytest.param(pack(body(inputs={b"x": tensor()})), "names must be strings", id="bin-name"),
    pytest.param(pack(body(inputs={1: tensor()})), "names must be strings", id="int-name"),
    pytest.param(pack(body(input={"x": tensor()})), "unknown key 'input'", id="body-typo"),
    pytest.param(pack(body(inputs={"x": [1, 2]})), "tensor must be a map", id="tensor-array"),
    pytest.param(pack(body(inputs={"x": tensor(dtype=MISSING)})), "missing 'dtype'", id="dtype"),
    pytest.param(pack(body(inputs={"x": tensor(shape=MISSING)})), "missing 'shape'", id="shape"),
    pytest.param(pack(body(inputs={"x": tensor(data=MISSING)})), "missing 'data'", id="data"),
    pytest.param(
        pack(body(inputs={"x": tensor(dtype="complex64")})), "unknown dtype", id="complex64"
    ),
    pytest.param(pack(body(inputs={"x": tensor(dtype=5)})), "unknown dtype", id="dtype-int"),
    pytest.param(
        pack(body(inputs={"x": tensor(order="C")})), "unknown key 'order'", id="tensor-extra"
    ),
    pytest.param(pack(body(inputs={"x": tensor(shape="12")})), "shape must be", id="shape-str"),
    pytest.param(
        pack(body(inputs={"x": tensor(shape=[-1, -2])})), "non-negative", id="negative-dim"
    ),
    pytest.param(
        pack(body(inputs={"x": tensor(shape=[True, 2])})), "non-negative integers", id="bool-dim"
    ),
    pytest.param(
        pack(body(inputs={"x": tensor(shape=[1.0, 2])})), "non-negative integers", id="float-dim"
    ),
    pytest.param(
        pack(body(inputs={"x": tensor(shape=[1] * 33, data=b"\0" * 4)})),
        "33 dimensions; at most 32",
        id="rank-33",
    ),
    pytest.param(
        pack(body(inputs={"x": tensor(data=b"\0" * 4)})),
        "data has 4 bytes but shape [1, 2] of float32 needs 8",
        id="data-short",
    ),
    pytest.param(pack(body(inputs={"x": tensor(data=b"\0" * 12)})), "has 12 bytes", id="data-long"),
    pytest.param(pack(body(inputs={"x": tensor(data="\0" * 8)})), "bin, got string", id="data-str"),
    pytest.param(
        pack(body(inputs={"x": tensor(dtype="bool", shape=[3], data=b"\x00\x01\x02")})),
        "bool data must hold only bytes 0 and 1",
        id="bool-byte-2",
    ),
    pytest.param(
        pack(body(inputs={"x": tensor(dtype="bool", shape=[1], data=b"\xff")})),
        "bool data",
        id="bool-byte-ff",
    ),
    pytest.param(
        body_with_raw("meta", b"\x91" * 2000 + b"\xc0"), "nested too deeply", id="deep-nesting"
    ),
    pytest.param(
        body_with_raw("outputs", pack(msgpack.ExtType(1, b"ab"))),
        "an ext type (such as a timestamp) is accepted only inside 'meta'",
        id="ext-outside-meta",
    ),
    pytest.param(
        body_with_raw("outputs", pack([None] * (codec.MAX_VALUES + 1))),
        f"more than {codec.MAX_VALUES} msgpack values",
        id="long-array",
    ),
    pytest.param(b"\x81\xc1\x01", "a byte that begins no msgpack value", id="format-error"),
    pytest.param(CONTRACT_EXAMPLE[:-3], "it ends inside a value", id="truncated-says-so"),
    pytest.param(
        pack({"inputs": {"x": tensor()}, b"outputs": ["y"]}),
        "body keys must be msgpack str, got bin b'outputs'; turn on",
        id="bin-body-key",
    ),
    pytest.param(
        pack({"inputs": {"x": tensor()}, None: 1}),
        "body keys must be msgpack str, got NoneType None",
        id="nil-body-key",
    ),
    pytest.param(
        b"\x82" + pack("inputs") + pack({"x": tensor()}) + b"\x91\x01\x01",
        "body keys must be msgpack str, got array",
        id="array-body-key",
    ),
    pytest.param(
        b"\x81"
        + pack("inputs")
        + b"\x81"
        + pack("x")
        + b"\x84"
        + pack(tensor())[1:]
        + b"\x91\x01\x02",
        "a map key is an array or a map",
        id="array-key-in-a-tensor",
    ),
    pytest.param(pack(body(outputs="y")), "'outputs' must be an array", id="outputs-str"),
    pytest.param(pack(body(outputs=[1])), "'outputs' must be an array", id="outputs-int"),
    pytest.param(pack(body(deadline_ms="soon")), "'deadline_ms' must be an integer", id="dl-str"),
    pytest.param(pack(body(deadline_ms=1.5)), "'deadline_ms' must be an integer", id="dl-float"),
    pytest.param(pack(body(deadline_ms=True)), "'deadline_ms' must be an integer", id="dl-bool"),
    pytest.param(pack(body(deadline_ms=-1)), "'deadline_ms' must be an integer >= 0", id="dl-neg"),
    pytest.param(pack(body(reply_ttl_s="60")), "'reply_ttl_s' must be an integer", id="ttl-str"),
    pytest.param(pack(body(reply_ttl_s=60.0)), "'reply_ttl_s' must be an integer", id="ttl-float"),
    pytest.param(pack(body(reply_ttl_s=False)), "'reply_ttl_s' must be an integer", id="ttl-bool"),
    pytest.param(pack(body(reply_ttl_s=0)), "'reply_ttl_s' must be an integer >= 1", id="ttl-0"),
]


@pytest.mark.parametrize(("raw", "phrase"), MALFORMED_CASES)
def test_structural_fault_is_malformed_and_named(raw: bytes, phrase: str) -> None:
    err = refused(raw)
    assert err.code == "MALFORMED"
    assert phrase in str(err)
    assert err.message == str(err)


def test_long_name_is_malformed_and_quoted_short() -> None:
    err = refused(body_with_raw("outputs", pack(["a" * 70_000])))
    assert err.code == "MALFORMED"
    assert "70000 characters" in str(err)
    assert len(str(err)) < 300


# nil is read in one pass; a timestamp (ext) sends meta through the pair-by-pair second pass
INNERMOST = {"nil": b"\xc0", "timestamp": b"\xd6\xff\x00\x00\x00\x01"}


@pytest.mark.parametrize("innermost", INNERMOST.values(), ids=INNERMOST.keys())
def test_nesting_is_malformed_past_1024_levels_counting_the_body_map(innermost: bytes) -> None:
    # docs/protocol.md: more than 1,024 levels of arrays and maps, the body map the first
    at_limit = b"\x91" * 1023 + innermost  # the body map and 1,023 arrays: 1,024 levels
    assert codec.decode_request(body_with_raw("meta", at_limit), MAX_BYTES).meta_raw == at_limit
    err = refused(body_with_raw("meta", b"\x91" + at_limit))
    assert (err.code, err.message) == (
        "MALFORMED",
        "body is nested too deeply to be msgpack we accept.",
    )
    # A refused body's meta is echoed only where a reply could hold it; the reply map counts too
    assert err.meta_raw is None
    assert codec.decode_reply(codec.encode_reply(a_reply(meta_raw=at_limit))).meta_raw == at_limit
    with pytest.raises(WireFormatError, match="reply is nested too deeply"):
        codec.decode_reply(codec.encode_reply(a_reply(meta_raw=b"\x91" + at_limit)))


def test_a_body_malformed_elsewhere_echoes_meta_nested_to_the_limit() -> None:
    at_limit = b"\x91" * 1023 + b"\xc0"
    raw = b"\x83" + pack("inputs") + pack({"x": tensor()}) + pack("meta") + at_limit
    err = refused(raw + pack("typo") + b"\x01")
    assert "unknown key 'typo'" in err.message
    assert err.meta_raw == at_limit


def test_fault_in_second_input_names_that_input() -> None:
    raw = pack(body(inputs={"x": tensor(), "mask": tensor(dtype="bool", data=b"\x00\x05")}))
    assert "input 'mask'" in str(refused(raw))


def test_reply_that_is_not_a_reply_is_malformed() -> None:
    for raw in (b"\xc1", pack([1]), pack({"rid": "r1"}), pack({"ok": True, "model": 1})):
        with pytest.raises(WireFormatError) as info:
            codec.decode_reply(raw)
        assert info.value.code == "MALFORMED"


# ---------------------------------------------------------------------------------------------
# Encoding refuses what cannot be sent


@pytest.mark.parametrize(
    "array",
    [np.array([1 + 2j]), np.array([1], np.float128)],
    ids=["complex", "float128"],
)
def test_unsendable_dtype_is_refused_by_name(array: np.ndarray) -> None:
    with pytest.raises(WireFormatError) as info:
        codec.encode_request({"x": array})
    assert info.value.code == "INVALID_INPUT"
    assert "cannot be sent" in str(info.value)
    assert "float32" in str(info.value)


def test_object_array_of_neither_str_nor_bytes_is_refused_naming_the_element() -> None:
    with pytest.raises(WireFormatError) as info:
        codec.encode_request({"x": np.array([object()])})
    assert info.value.code == "INVALID_INPUT"
    assert "every element must be str" in str(info.value)


def test_request_without_inputs_is_refused_when_encoding() -> None:
    with pytest.raises(WireFormatError) as info:
        codec.encode_request({})
    assert info.value.code == "INVALID_INPUT"


# ---------------------------------------------------------------------------------------------
# Known faults in codec.py, reported to the lead; strict, so a fix turns them into failures
# that ask for the marker to go.


def test_shape_with_a_zero_and_a_huge_dimension_is_malformed() -> None:
    err = refused(pack(body(inputs={"x": tensor(shape=[0, 2**62], data=b"")})))
    assert err.code == "MALFORMED"


def test_repeated_meta_key_is_malformed() -> None:
    # Given meta twice: msgpack keeps the last value, but the echo slices the first one
    raw = b"\x83" + pack("inputs") + pack({"x": tensor()})
    raw += pack("meta") + pack(1) + pack("meta") + pack("a" * 5000)
    assert refused(raw).code == "MALFORMED"


_META_AND_TTL = pack("meta") + pack({"trace": 7}) + pack("reply_ttl_s") + pack(5)
_REPEATED_SHAPE = b"\x84" + pack("dtype") + pack("float32") + pack("shape") + pack([1, 2])
_REPEATED_SHAPE += pack("shape") + pack([1, 2]) + pack("data") + pack(b"\0" * 8)


@pytest.mark.parametrize(
    "raw",
    [
        b"\x83" + pack("inputs") + pack({"x": tensor()}) + _META_AND_TTL + b"\xc0",
        b"\x84" + pack("inputs") + pack({"x": tensor()}) + _META_AND_TTL
        + pack("outputs") + pack(msgpack.ExtType(1, b"a")),
        b"\x83" + pack("inputs") + b"\x81" + pack("x") + _REPEATED_SHAPE + _META_AND_TTL,
        b"\x84" + pack("inputs") + pack({"x": tensor(dtype="complex64")}) + _META_AND_TTL
        + pack("zz") + pack(1),
    ],
    ids=["trailing-byte", "ext-in-outputs", "repeated-tensor-key", "unknown-dtype-and-key"],
)  # fmt: skip
def test_a_malformed_map_keeps_its_meta_and_reply_ttl_wherever_the_fault_is(raw: bytes) -> None:
    err = refused(raw)
    assert err.code == "MALFORMED"
    assert err.meta_raw == pack({"trace": 7})
    assert err.reply_ttl_s == 5


def test_a_body_both_malformed_and_with_a_long_meta_is_malformed() -> None:
    raw = b"\x83" + pack("inputs") + pack({"x": tensor()}) + pack("zz") + pack(1)
    raw += pack("meta") + pack("a" * 5000)
    err = refused(raw)
    assert err.code == "MALFORMED"
    assert err.meta_raw is None  # too long to echo


@pytest.mark.parametrize(
    "raw_meta",
    [
        pack(msgpack.ExtType(1, b"ab")),
        pack(msgpack.Timestamp(1, 0)),  # what JS and Go encoders write for a date by default
        b"\xc7\x00\x05",  # an empty ext value
        b"\x81\x92\x01\x02\x01",  # an array as a map key
        b"\xa2\xff\xfe",  # a str that is not UTF-8
        b"\x82\xa1a\x01\xa1a\x02",  # a map that repeats a key
        b"\x81\xc4\x01k\x01",  # a bin key
    ],
    ids=["ext", "timestamp", "empty-ext", "array-key", "not-utf8", "repeated-key", "bin-key"],
)
def test_meta_may_be_any_msgpack_value_and_is_echoed_verbatim(raw_meta: bytes) -> None:
    # The contract: meta is "any msgpack value of at most 4 KiB encoded"; it is only echoed.
    request = codec.decode_request(body_with_raw("meta", raw_meta), MAX_BYTES)
    assert request.meta_raw == raw_meta
    reply = codec.decode_reply(codec.encode_reply(a_reply(meta_raw=raw_meta)))
    assert reply.meta_raw == raw_meta


def test_reply_with_text_timing_is_malformed() -> None:
    raw = codec.encode_reply(a_reply(timings_ms={"queued": "soon", "inference": 1.0}))
    with pytest.raises(WireFormatError):
        codec.decode_reply(raw)


def test_meta_may_use_any_msgpack_key_and_is_echoed_verbatim() -> None:
    raw_meta = pack({1: "a", "b": [1, 2]})
    decoded = codec.decode_request(body_with_raw("meta", raw_meta), MAX_BYTES)
    assert decoded.meta_raw == raw_meta


@pytest.mark.parametrize("name", ["x", "a'b", 'é"', "x" * 98, "x" * 100, "\x00" * 40, "y" * 500])
def test_errors_quote_an_input_name_as_reprlib_cuts_it(name: str) -> None:
    body = pack({"inputs": {name: {"dtype": "float32", "shape": [1], "data": b""}}})
    with pytest.raises(WireFormatError) as info:
        codec.decode_request(body, MAX_BYTES)
    quoted = quote(name)
    assert info.value.message.startswith(f"input {quoted}: data has 0 bytes")
    assert len(quoted) <= 104  # a hostile name cannot make the message long


@pytest.mark.parametrize(
    ("meta", "decoded"),
    [
        ({1: "a", 2: "b"}, {1: "a", 2: "b"}),  # integer keys, as Go or JS may send
        ({b"k": 1}, {b"k": 1}),  # a bin key
        ({(1, 2): "x"}, [((1, 2), "x")]),  # an array key: pairs, since Python cannot hash it
    ],
    ids=["int-keys", "bin-key", "array-key"],
)
def test_a_replys_meta_decodes_whatever_its_map_keys(meta: Any, decoded: Any) -> None:
    raw = msgpack.packb(meta, use_bin_type=True)
    reply = codec.decode_reply(codec.encode_reply(a_reply(meta_raw=raw)))
    assert reply.meta_raw == raw
    got = reply.meta
    if isinstance(decoded, list):
        assert [(list(k), v) for k, v in got] == [(list(k), v) for k, v in decoded]
    else:
        assert got == decoded
