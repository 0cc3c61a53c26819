"""(v2) ``string`` and ``bytes`` tensors: every value a caller holds round-trips, element for
element, and every body that breaks contract section 2's rules for them is refused by name."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_strategies import a_reply, blobs, meta_values, text_arrays, texts

from producer.protocol import codec
from producer.protocol.errors import WireFormatError

MAX_BYTES = 1 << 20
UNICODE = [
    "",
    "a",
    "caf\u00e9",  # 2-byte UTF-8
    "\u65e5\u672c\u8a9e",  # 3-byte
    "\U0001f600",  # astral: 4 bytes, a surrogate pair in UTF-16
    "\U0010ffff",  # the last code point
    "\x00",
    "a\x00b",
    "ends in NUL\x00\x00",
    "e\u0301",  # a combining mark
    "\u202eright to left",
    "\ufeffBOM",
]
BLOBS = [b"", b"\x00", b"\x00\xffabc", b"trailing\x00\x00", bytes(range(256)), b"\x89PNG\r\n\x1a\n"]


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def text_body(dtype: Any, shape: Any, data: Any) -> bytes:
    return pack({"inputs": {"t": {"dtype": dtype, "shape": shape, "data": data}}})


def round_trip(value: Any, **limits: Any) -> np.ndarray:
    raw = codec.encode_request({"t": value})
    return codec.decode_request(raw, MAX_BYTES, **limits).inputs["t"]


def refused(raw: bytes, **limits: Any) -> WireFormatError:
    with pytest.raises(WireFormatError) as info:
        codec.decode_request(raw, MAX_BYTES, **limits)
    return info.value


def outcome(raw: bytes, **limits: Any) -> tuple[str, str, np.ndarray | None]:
    """(code, message, the decoded input 't'): OK and None where there is nothing to say."""
    try:
        return "OK", "", codec.decode_request(raw, MAX_BYTES, **limits).inputs["t"]
    except WireFormatError as exc:
        return exc.code, exc.message, None


def refused_on_encode(value: Any) -> WireFormatError:
    with pytest.raises(WireFormatError) as info:
        codec.encode_request({"t": value})
    return info.value


def assert_text(array: np.ndarray, name: str, expected: Any) -> None:
    """An object array of exactly ``str`` or ``bytes`` elements, named ``name``, as expected."""
    assert array.dtype == object
    assert codec.wire_dtype(array) == name
    want = str if name == "string" else bytes
    assert all(type(e) is want for e in array.ravel())
    assert array.tolist() == expected
    assert np.shape(expected) == array.shape or array.size == 0


# ---------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize(
    ("value", "shape"),
    [
        (["a", "bc"], (2,)),
        ([["a", "b", "c"], ["d", "e", "f"]], (2, 3)),
        ([[["x"]], [["y"]]], (2, 1, 1)),
        ("alone", ()),
    ],
    ids=["1-d", "2-d", "3-d", "0-d"],
)
def test_string_tensors_of_any_rank_round_trip(value: Any, shape: tuple[int, ...]) -> None:
    decoded = round_trip(value)
    assert decoded.shape == shape
    assert_text(decoded, "string", value)


@pytest.mark.parametrize(
    ("value", "shape"),
    [([b"a", b"bc"], (2,)), ([[b"\x00"], [b"\xff"]], (2, 1)), (b"alone\x00", ())],
    ids=["1-d", "2-d", "0-d"],
)
def test_bytes_tensors_of_any_rank_round_trip(value: Any, shape: tuple[int, ...]) -> None:
    decoded = round_trip(value)
    assert decoded.shape == shape
    assert_text(decoded, "bytes", value)


@pytest.mark.parametrize(
    ("dtype", "name"),
    [(codec.STRING, "string"), (codec.BYTES, "bytes"), ("U3", "string"), ("S3", "bytes")],
    ids=["string", "bytes", "U", "S"],
)
@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3)])
def test_empty_shapes_round_trip_with_an_empty_data_array(
    dtype: Any, name: str, shape: Any
) -> None:
    value = np.empty(shape, dtype)
    wire = codec.encode_tensor(value)
    assert wire == {"dtype": name, "shape": list(shape), "data": []}
    decoded = round_trip(value)
    assert decoded.shape == shape
    assert codec.wire_dtype(decoded) == name


def test_unicode_round_trips_astral_nul_and_combining_characters() -> None:
    decoded = round_trip(UNICODE)
    assert_text(decoded, "string", UNICODE)


def test_bytes_keep_trailing_nuls_and_every_byte_value() -> None:
    decoded = round_trip(BLOBS)
    assert_text(decoded, "bytes", BLOBS)
    assert decoded[3] == b"trailing\x00\x00"


def test_strings_go_as_msgpack_str_and_bytes_as_bin_in_c_order() -> None:
    # Given a Fortran-ordered 2x2 string array and a bytes array
    strings = np.asfortranarray(np.array([["a", "b"], ["c", "d"]], dtype=object))
    raw = codec.encode_request({"s": strings, "b": [b"\x00", b"\xff"]})
    # Then the elements are str (fixstr a1..) and bin (c4 01 ..), row by row
    expected_s = b"\x83\xa5dtype\xa6string\xa5shape\x92\x02\x02\xa4data\x94\xa1a\xa1b\xa1c\xa1d"
    expected_b = b"\x83\xa5dtype\xa5bytes\xa5shape\x91\x02\xa4data\x92\xc4\x01\x00\xc4\x01\xff"
    assert expected_s in raw
    assert expected_b in raw


def test_numpy_unicode_and_byte_string_arrays_are_sent_as_string_and_bytes() -> None:
    unicode = np.array([["caf\u00e9", "\U0001f600"], ["", "x"]])
    byte_strings = np.array([b"\x00\xffabc", b"", b"z"])
    assert unicode.dtype.kind == "U"
    assert byte_strings.dtype.kind == "S"
    assert_text(round_trip(unicode), "string", unicode.tolist())
    assert_text(round_trip(byte_strings), "bytes", byte_strings.tolist())
    big_endian = unicode.astype(unicode.dtype.newbyteorder(">"))
    assert_text(round_trip(big_endian), "string", unicode.tolist())


@pytest.mark.parametrize("metadata", [True, False], ids=["wire-dtype", "plain-object"])
def test_object_arrays_are_sent_by_their_elements(metadata: bool) -> None:
    strings = np.array(UNICODE, dtype=codec.STRING if metadata else object)
    blobs_ = np.array(BLOBS, dtype=codec.BYTES if metadata else object)
    assert_text(round_trip(strings), "string", UNICODE)
    assert_text(round_trip(blobs_), "bytes", BLOBS)


def test_lists_tuples_and_nested_lists_are_sent_as_text_tensors() -> None:
    assert_text(round_trip(("a", "b")), "string", ["a", "b"])
    nested = [[["a", "b"], ["c", "d"]], [["e", "f"], ["g", "h"]]]
    assert round_trip(nested).shape == (2, 2, 2)
    assert_text(round_trip(nested), "string", nested)
    assert_text(round_trip([[b"ab\x00"], [b"\x00"]]), "bytes", [[b"ab\x00"], [b"\x00"]])


def test_bytearray_and_memoryview_elements_are_sent_as_bytes() -> None:
    # Regression: np.array(..., dtype=object) unpacked them into their integers
    value = [bytearray(b"ab\x00"), memoryview(b"\x00cd"), b"ef"]
    assert_text(round_trip(value), "bytes", [b"ab\x00", b"\x00cd", b"ef"])
    assert_text(round_trip([[bytearray(b"x")], [memoryview(b"y")]]), "bytes", [[b"x"], [b"y"]])
    assert_text(round_trip(memoryview(b"\x00z\x00")), "bytes", b"\x00z\x00")
    as_object = np.empty(2, object)
    as_object[:] = [bytearray(b"p"), memoryview(b"q\x00")]
    assert_text(round_trip(as_object), "bytes", [b"p", b"q\x00"])


def test_as_tensor_keeps_the_wire_dtype_through_views() -> None:
    arr = codec.as_tensor([["a", "b"], ["c", "d"]])
    assert arr.dtype.metadata == {"wire": "string"}
    for view in (arr.T, arr[1:], arr.reshape(4), arr.ravel(), arr.copy()):
        assert codec.wire_dtype(view) == "string"
    assert codec.wire_dtype(np.empty(0, codec.BYTES)) == "bytes"
    assert codec.wire_dtype(codec.as_tensor(b"")) == "bytes"
    assert codec.wire_dtype(codec.as_tensor("")) == "string"


def test_decoded_text_arrays_are_object_arrays_with_the_wire_dtype() -> None:
    decoded = round_trip(np.array([b"a"], dtype=object))
    assert decoded.dtype.metadata == {"wire": "bytes"}
    assert decoded.dtype == codec.BYTES


def test_a_request_may_mix_text_and_numeric_inputs_with_every_option() -> None:
    raw = codec.encode_request(
        {"text": ["hi", "there"], "image": [b"\x89PNG", b"\xff\xd8\xff"], "x": np.ones((2, 2))},
        outputs=["label"],
        deadline_ms=1,
        meta={"k": "v"},
        reply_ttl_s=5,
    )
    body = codec.decode_request(raw, MAX_BYTES, max_element_bytes=16)
    assert_text(body.inputs["text"], "string", ["hi", "there"])
    assert_text(body.inputs["image"], "bytes", [b"\x89PNG", b"\xff\xd8\xff"])
    assert body.inputs["x"].dtype == np.float64
    assert (body.outputs, body.deadline_ms, body.reply_ttl_s) == (("label",), 1, 5)


# ---------------------------------------------------------------------------------------------
# Refused on decode


@pytest.mark.parametrize(
    ("shape", "data"),
    [
        ([2], ["a"]),
        ([2], ["a", "b", "c"]),
        ([0], ["a"]),
        ([], []),
        ([], ["a", "b"]),
        ([2, 2], ["a", "b", "c"]),
        ([1], []),
    ],
    ids=["fewer", "more", "zero-with-one", "0-d-with-none", "0-d-with-two", "2x2-with-3", "none"],
)
@pytest.mark.parametrize("dtype", ["string", "bytes"])
def test_element_count_not_matching_the_shape_is_malformed(
    dtype: str, shape: list[int], data: list[str]
) -> None:
    elements = data if dtype == "string" else [e.encode() for e in data]
    err = refused(text_body(dtype, shape, elements))
    assert err.code == "MALFORMED"
    assert f"data has {len(data)} elements but shape {shape} needs" in err.message


@pytest.mark.parametrize(
    ("dtype", "element", "kind"),
    [
        ("string", b"bin", "bin"),
        ("bytes", "str", "string"),
        ("string", 1, "int"),
        ("bytes", 1.5, "float"),
        ("string", None, "NoneType"),
        ("bytes", True, "bool"),
        ("string", ["nested"], "array"),
        ("bytes", {"k": b"v"}, "map"),
    ],
)
def test_an_element_of_the_wrong_type_is_malformed_and_named(
    dtype: str, element: Any, kind: str
) -> None:
    good = "ok" if dtype == "string" else b"ok"
    err = refused(text_body(dtype, [3], [good, good, element]))
    assert err.code == "MALFORMED"
    want = "str" if dtype == "string" else "bin"
    assert f"element 2 of a {dtype} tensor must be msgpack {want}, got {kind}" in err.message


@pytest.mark.parametrize("data", [b"abc", "abc", {"0": "a"}, None, 3], ids=repr)
@pytest.mark.parametrize("dtype", ["string", "bytes"])
def test_data_that_is_not_an_array_is_malformed(dtype: str, data: Any) -> None:
    err = refused(text_body(dtype, [1], data))
    assert err.code == "MALFORMED"
    assert f"a {dtype} tensor's data must be an array of msgpack" in err.message


@pytest.mark.parametrize(
    "bad",
    [b"\xff", b"\x80", b"ab\xc3", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"],
    ids=["ff", "lone-continuation", "truncated", "overlong", "surrogate", "past-10ffff"],
)
def test_invalid_utf8_in_a_string_tensor_is_malformed_and_suggests_bytes(bad: bytes) -> None:
    placeholder = "\x01" * len(bad)
    raw = text_body("string", [2], ["fine", placeholder])
    raw = raw.replace(placeholder.encode(), bad)
    err = refused(raw)
    assert err.code == "MALFORMED"
    assert "not valid UTF-8" in err.message
    assert "'bytes' tensor" in err.message


def test_the_same_bytes_as_bin_in_a_bytes_tensor_are_accepted() -> None:
    raw = text_body("bytes", [1], [b"\xed\xa0\x80\xff"])
    assert codec.decode_request(raw, MAX_BYTES).inputs["t"][0] == b"\xed\xa0\x80\xff"


@pytest.mark.parametrize(
    ("element", "limit", "code"),
    [
        ("a" * 8, 8, "OK"),
        ("a" * 9, 8, "TOO_LARGE"),
        ("\u00e9" * 4, 8, "OK"),  # 4 characters, 8 bytes
        ("\u00e9" * 4 + "a", 8, "TOO_LARGE"),  # 5 characters, 9 bytes
        ("\U0001f600" * 2, 8, "OK"),  # 2 characters, 8 bytes
        ("\U0001f600" * 2, 7, "TOO_LARGE"),  # 2 characters, 8 bytes: counted in bytes
        ("\u65e5" * 3, 8, "TOO_LARGE"),  # 3 characters, 9 bytes
        (b"\x00" * 8, 8, "OK"),
        (b"\x00" * 9, 8, "TOO_LARGE"),
        ("", 0, "OK"),
        ("a", 0, "TOO_LARGE"),
        (b"", 0, "OK"),
        ("a" * 10_000, None, "OK"),
    ],
)
def test_elements_over_max_element_bytes_are_too_large_counted_in_utf8_bytes(
    element: str | bytes, limit: int | None, code: str
) -> None:
    empty = "" if isinstance(element, str) else b""
    raw = text_body("string" if empty == "" else "bytes", [2], [empty, element])
    got, message, _ = outcome(raw, max_element_bytes=limit)
    assert got == code
    if code != "OK":
        size = len(element.encode() if isinstance(element, str) else element)
        assert f"element 1 is {size} bytes, over limits.max_element_bytes={limit}" in message


def test_decode_tensor_applies_max_element_bytes_too() -> None:
    wire = {"dtype": "bytes", "shape": [1], "data": [b"12345"]}
    assert codec.decode_tensor(wire, "output 'y'", 5)[0] == b"12345"
    with pytest.raises(WireFormatError) as info:
        codec.decode_tensor(wire, "output 'y'", 4)
    assert info.value.code == "TOO_LARGE"
    assert info.value.message.startswith("output 'y': element 0 is 5 bytes")


def test_an_element_over_the_limit_is_not_quoted_in_the_message() -> None:
    err = refused(text_body("string", [1], ["secret" * 1000]), max_element_bytes=100)
    assert err.code == "TOO_LARGE"
    assert "secret" not in err.message
    assert len(err.message) < 200


def test_a_text_tensor_with_a_bad_shape_is_malformed_like_any_other() -> None:
    assert refused(text_body("string", [-1], [])).code == "MALFORMED"
    assert refused(text_body("bytes", "2", [b"", b""])).code == "MALFORMED"
    assert refused(text_body("string", [1] * 33, ["a"])).code == "MALFORMED"


@pytest.mark.parametrize("dtype", ["String", "str", "text", "utf8", "object", "binary"])
def test_other_names_for_text_dtypes_are_unknown(dtype: str) -> None:
    err = refused(text_body(dtype, [1], ["a"]))
    assert err.code == "MALFORMED"
    assert "string, bytes" in err.message


# ---------------------------------------------------------------------------------------------
# Refused on encode


@pytest.mark.parametrize(
    "value",
    [
        ["a", b"b"],
        [b"a", "b"],
        [["a"], [b"b"]],
        np.array(["a", b"b"], dtype=object),
        np.array([b"a", "b"], dtype=codec.BYTES),
        np.array(["a", "b"], dtype=codec.BYTES),
        np.array([b"a"], dtype=codec.STRING),
    ],
    ids=["list", "list-bytes-first", "nested", "object", "bytes-dtype", "all-str", "all-bytes"],
)
def test_str_and_bytes_in_one_tensor_are_refused_when_encoding(value: Any) -> None:
    err = refused_on_encode(value)
    assert err.code == "INVALID_INPUT"
    assert "tensor holds" in err.message


@pytest.mark.parametrize(
    "value",
    [[1, "a"], [2.5, b"x"], [np.array(["a"]), np.array([1])], np.array(["a", None], object)],
    ids=["int-then-str", "float-then-bytes", "arrays", "none-in-object"],
)
def test_numbers_beside_text_are_refused_not_turned_into_text(value: Any) -> None:
    # Regression: np.asarray([1, "a"]) is ['1', 'a'], which was sent as the string "1"
    err = refused_on_encode(value)
    assert err.code == "INVALID_INPUT"
    assert "every element must be" in err.message


@pytest.mark.parametrize(
    "value",
    [[["a", "b"], ["c"]], [["a"], "b"], ["a", ["b"]], [[b"a"], [b"b", b"c"]], [[["a"]], ["b"]]],
    ids=["short-row", "leaf-for-row", "row-for-leaf", "bytes", "deeper"],
)
def test_ragged_nested_lists_are_refused_when_encoding(value: Any) -> None:
    err = refused_on_encode(value)
    assert err.code == "INVALID_INPUT"
    assert "must be rectangular" in err.message


def test_a_lone_surrogate_is_refused_when_encoding() -> None:
    err = refused_on_encode(["fine", "bad \ud800 here"])
    assert err.code == "INVALID_INPUT"
    assert "UTF-8 cannot encode" in err.message
    assert "\\ud800" in err.message
    with pytest.raises(WireFormatError) as info:
        codec.encode_reply(a_reply(outputs={"y": np.array(["\udfff"], object)}))
    assert info.value.code == "INVALID_INPUT"


# ---------------------------------------------------------------------------------------------
# Replies


def test_replies_with_string_and_bytes_outputs_round_trip() -> None:
    labels = np.array([["cat", "dog"], ["\U0001f600", ""]], dtype=object)
    crops = codec.as_tensor([b"\x00\x01", b""])
    reply = a_reply(outputs={"labels": labels, "crops": crops, "scores": np.ones((2, 2))})
    decoded = codec.decode_reply(codec.encode_reply(reply))
    assert decoded.outputs is not None
    assert_text(decoded.outputs["labels"], "string", labels.tolist())
    assert_text(decoded.outputs["crops"], "bytes", [b"\x00\x01", b""])
    assert decoded.outputs["scores"].tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_a_reply_with_string_outputs_keeps_its_meta_bytes() -> None:
    reply = a_reply(outputs={"y": ["a\x00"]}, meta_raw=b"\xca\x3f\xc0\x00\x00")
    decoded = codec.decode_reply(codec.encode_reply(reply))
    assert decoded.meta_raw == b"\xca\x3f\xc0\x00\x00"
    assert decoded.outputs is not None
    assert decoded.outputs["y"].tolist() == ["a\x00"]


def test_model_pipeline_round_trips_and_is_left_out_without_one() -> None:
    pipeline = codec.PipelineRef("handlers:ImagePipeline", "cd" * 32)
    model = codec.ModelRef("demo", "1", "ab" * 32, pipeline)
    raw = codec.encode_reply(a_reply(model=model))
    assert codec.decode_reply(raw).model == model
    unpacked = msgpack.unpackb(raw)
    assert unpacked["model"]["pipeline"] == {
        "handler": "handlers:ImagePipeline",
        "sha256": "cd" * 32,
    }
    plain = msgpack.unpackb(codec.encode_reply(a_reply()))
    assert "pipeline" not in plain["model"]
    assert codec.decode_reply(codec.encode_reply(a_reply())).model.pipeline is None


@pytest.mark.parametrize(
    "pipeline", ["handlers:X", {"handler": "h:X"}, {"sha256": "00"}, [1, 2]], ids=repr
)
def test_a_reply_whose_pipeline_is_not_a_pipeline_map_is_refused(pipeline: Any) -> None:
    doc = msgpack.unpackb(codec.encode_reply(a_reply()))
    doc["model"]["pipeline"] = pipeline
    with pytest.raises(WireFormatError):
        codec.decode_reply(pack(doc))


def test_a_reply_with_a_text_output_breaking_the_rules_is_refused() -> None:
    doc = msgpack.unpackb(codec.encode_reply(a_reply(outputs={"y": ["a", "b"]})))
    doc["outputs"]["y"]["data"] = ["a", b"b"]
    with pytest.raises(WireFormatError) as info:
        codec.decode_reply(pack(doc))
    assert "element 1 of a string tensor" in info.value.message


# ---------------------------------------------------------------------------------------------
# Properties


@settings(max_examples=200, deadline=None)
@given(text_arrays())
def test_every_text_tensor_a_caller_holds_round_trips(named: tuple[str, Any, np.ndarray]) -> None:
    name, value, meaning = named
    assert codec.wire_dtype(codec.as_tensor(value)) == name
    decoded = round_trip(value)
    assert codec.wire_dtype(decoded) == name
    assert decoded.shape == meaning.shape
    assert decoded.tolist() == meaning.tolist()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(texts, min_size=1, max_size=6) | st.lists(blobs, min_size=1, max_size=6),
    st.integers(0, 50),
)
def test_max_element_bytes_refuses_exactly_the_longer_elements(
    elements: list[Any], limit: int
) -> None:
    sizes = [len(e.encode() if isinstance(e, str) else e) for e in elements]
    raw = codec.encode_request({"t": elements})
    over = [i for i, size in enumerate(sizes) if size > limit]
    code, message, decoded = outcome(raw, max_element_bytes=limit)
    if over:
        assert code == "TOO_LARGE"
        assert f"element {over[0]} is {sizes[over[0]]} bytes" in message
    else:
        assert decoded is not None
        assert decoded.tolist() == elements


@settings(max_examples=80, deadline=None)
@given(
    outputs=st.dictionaries(st.text(min_size=1, max_size=6), text_arrays(), min_size=1, max_size=3),
    meta=st.none() | meta_values,
    pipeline=st.none() | st.builds(codec.PipelineRef, st.text(max_size=20), st.text(max_size=64)),
)
def test_replies_with_text_outputs_round_trip(
    outputs: dict[str, tuple[str, Any, np.ndarray]], meta: Any, pipeline: Any
) -> None:
    model = codec.ModelRef("demo", "1", "ab" * 32, pipeline)
    reply = a_reply(
        outputs={name: value for name, (_, value, _) in outputs.items()},
        model=model,
        meta_raw=codec.pack_meta(meta),
    )
    decoded = codec.decode_reply(codec.encode_reply(reply))
    assert decoded.model == model
    assert decoded.meta_raw == codec.pack_meta(meta)
    assert decoded.outputs is not None
    for name, (wire, _, meaning) in outputs.items():
        assert codec.wire_dtype(decoded.outputs[name]) == wire
        assert decoded.outputs[name].tolist() == meaning.tolist()


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["string", "bytes"]),
    st.lists(st.integers(0, 3), max_size=3),
    st.lists(
        texts | blobs | st.integers(-(2**63), 2**64 - 1) | st.none() | st.lists(texts, max_size=2),
        max_size=6,
    ),
)
def test_any_text_tensor_map_decodes_or_is_refused_as_malformed(
    dtype: str, shape: list[int], data: list[Any]
) -> None:
    want = str if dtype == "string" else bytes
    valid = len(data) == int(np.prod(shape)) and all(type(e) is want for e in data)
    code, _, decoded = outcome(text_body(dtype, shape, data))
    assert code == ("OK" if valid else "MALFORMED")
    if decoded is not None:
        assert decoded.shape == tuple(shape)
        assert decoded.ravel().tolist() == data
