"""docs/protocol.md against the code (issue 27): every limit section 3's table states is checked
at the limit and one past it, through the worker's admission and the reference decoder, with the
code the table names; the order in which checks answer and the `meta` rule are checked on the
cases the document names; and its numbered lists and sections count 1, 2, 3.

The table is read from the document, so a limit changed in the code or in the text without the
other fails here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from producer.protocol import codec
from producer.protocol.codec import STRING
from producer.protocol.errors import WireFormatError
from worker.config import BatchingConfig, LimitsConfig, ModelConfig, RedisConfig, WorkerConfig
from worker.intake.admit import admit
from worker.items import Admitted, Item, Refused
from worker.model.schema import Schema
from worker.model.tensorspec import Dim, TensorSpec
from worker.redisio.stream import RawEntry

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
TEXT = DOC.read_text()
WORDS = " ".join(TEXT.split())  # the prose with its line breaks undone
_ROW = re.compile(r"^\| `(\w+)` \| ([\d,]+) \| `([A-Z_]+)` \|")
U8: np.dtype[Any] = np.dtype("uint8")


def _limits_table() -> dict[str, tuple[int, str]]:
    """Section 3's limits table: name -> (limit, code past it)."""
    block = TEXT.split("<!-- limits:begin", 1)[1].split("<!-- limits:end -->", 1)[0]
    rows = {}
    for line in block.splitlines():
        found = _ROW.match(line)
        if found:
            rows[found[1]] = (int(found[2].replace(",", "")), found[3])
    return rows


LIMITS = _limits_table()


# -- a worker's admission, without Redis or a model -------------------------------------------


def _schema(
    inputs: Mapping[str, tuple[np.dtype[Any], tuple[Dim, ...]]],
    outputs: tuple[str, ...] = ("y",),
    max_batch_size: int = 32,
) -> Schema:
    config = WorkerConfig(
        RedisConfig(),
        ModelConfig("m", Path("m.onnx")),
        batching=BatchingConfig(max_batch_size=max_batch_size),
    )
    specs = tuple(TensorSpec(n, d, dims) for n, (d, dims) in inputs.items())
    return Schema(specs, tuple(TensorSpec(n, U8, ("N",)) for n in outputs), config)


X = _schema({"x": (U8, ("N", "D"))})


def _admit(
    body: bytes,
    schema: Schema = X,
    max_bytes: int = 1 << 20,
    max_element_bytes: int | None = None,
    fields: Mapping[bytes, bytes] | None = None,
) -> Item:
    entry = RawEntry(b"1-0", {b"rid": b"r1", b"body": body, **(fields or {})})
    return admit(entry, schema, max_bytes, max_element_bytes=max_element_bytes)


def _outcome(item: Item) -> str:
    """OK for an admitted request, else the code it is answered with."""
    if isinstance(item, Admitted):
        return "OK"
    assert isinstance(item, Refused), item
    return item.error.code


def _x(rows: int = 1, width: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.zeros((rows, width), np.uint8)}


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


# -- one check per row of the table: the limit and one past it --------------------------------


def _body_of_length(length: int) -> bytes:
    """A valid body of exactly ``length`` bytes: one uint8 input, its width chosen to fit."""
    width = length - len(codec.encode_request(_x(width=length)))
    body = codec.encode_request(_x(width=length + width))
    assert len(body) == length
    return body


def check_body_bytes(limit: int, code: str) -> None:
    assert limit == LimitsConfig().max_request_bytes
    body = _body_of_length(limit)
    assert _outcome(_admit(body, max_bytes=limit)) == "OK"
    past = _body_of_length(limit + 1)
    assert _outcome(_admit(past, max_bytes=limit)) == code
    with pytest.raises(WireFormatError) as info:
        codec.decode_request(past, limit)
    assert info.value.code == code


def _values(value: Any) -> int:
    """Values inside ``value`` as section 3 counts them: each key and value of a map and each
    element of an array, at any depth; ``value`` itself not counted."""
    if isinstance(value, dict):
        return sum(2 + _values(k) + _values(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(1 + _values(v) for v in value)
    return 0


def _text_body(count: int) -> bytes:
    return codec.encode_request({"t": np.array([""] * count, dtype=STRING)})


def check_values(limit: int, code: str) -> None:
    assert limit == codec.MAX_VALUES
    example = "(the contract's example below holds 12)"
    assert example in WORDS
    assert _values(msgpack.unpackb(_vector("contract-example"))) == 12
    overhead = _values(msgpack.unpackb(_text_body(0)))
    assert overhead == 11  # section 2: "its keys, dtype and shape are the other 11 values"
    assert "carries at most 65,525 elements" in WORDS
    assert limit - overhead == 65_525
    text = _schema({"t": (STRING, ("N",))}, max_batch_size=limit)
    at = _text_body(limit - overhead)
    assert _values(msgpack.unpackb(at)) == limit
    assert _outcome(_admit(at, text)) == "OK"
    assert _outcome(_admit(_text_body(limit - overhead + 1), text)) == code


def _with_meta(meta_raw: bytes, inputs: Mapping[str, np.ndarray] | None = None) -> bytes:
    """A valid body whose ``meta`` is the raw msgpack ``meta_raw``."""
    tensors = codec.encode_request(inputs or _x())[1:]  # the body map's one pair
    return b"\x82" + tensors + _pack("meta") + meta_raw


def check_depth(limit: int, code: str) -> None:
    def nested(levels: int) -> bytes:  # arrays in arrays, innermost empty
        return b"\x91" * (levels - 1) + b"\x90"

    at = _with_meta(nested(limit - 1))  # the body map is the first level
    item = _admit(at)
    assert _outcome(item) == "OK"
    assert isinstance(item, Admitted)
    assert item.meta_raw == nested(limit - 1)
    assert _outcome(_admit(_with_meta(nested(limit)))) == code


def check_name_chars(limit: int, code: str) -> None:
    assert limit == codec.MAX_NAME_CHARS
    name = "é" * limit  # characters, not bytes: 2 bytes each
    schema = _schema({name: (U8, ("N", "D"))}, outputs=(name,))
    tensor = np.zeros((1, 1), np.uint8)
    body = codec.encode_request({name: tensor}, outputs=[name])
    assert _outcome(_admit(body, schema)) == "OK"
    longer = name + "é"
    assert _outcome(_admit(codec.encode_request({longer: tensor}), schema)) == code
    assert _outcome(_admit(codec.encode_request({name: tensor}, outputs=[longer]), schema)) == code


def check_rank(limit: int, code: str) -> None:
    assert limit == codec.MAX_RANK
    schema = _schema({"x": (U8, ("N", *[1] * (limit - 1)))})
    at = codec.encode_request({"x": np.zeros([1] * limit, np.uint8)})
    assert _outcome(_admit(at, schema)) == "OK"
    past = codec.encode_request({"x": np.zeros([1] * (limit + 1), np.uint8)})
    assert _outcome(_admit(past, schema)) == code


def check_meta_bytes(limit: int, code: str) -> None:
    assert limit == codec.MAX_META_BYTES
    meta = b"m" * (limit - 3)  # bin 16: a 3-byte header
    assert len(_pack(meta)) == limit
    item = _admit(codec.encode_request(_x(), meta=meta))
    assert isinstance(item, Admitted)
    assert item.meta_raw == _pack(meta)
    past = _admit(codec.encode_request(_x(), meta=meta + b"m"))
    assert _outcome(past) == code
    assert isinstance(past, Refused)
    assert past.meta_raw is None


def check_element_bytes(limit: int, code: str) -> None:
    assert limit == LimitsConfig().max_element_bytes
    schema = _schema({"b": (np.dtype(object, metadata={"wire": "bytes"}), ("N",))})
    room = 2 * limit  # the body may hold it: only the element's own limit applies

    def body(size: int) -> bytes:
        return codec.encode_request({"b": [b"\x00" * size]})

    assert _outcome(_admit(body(limit), schema, room, limit)) == "OK"
    assert _outcome(_admit(body(limit + 1), schema, room, limit)) == code
    # a string's length counts its UTF-8 bytes: 501 characters, 1,001 bytes
    text = _schema({"t": (STRING, ("N",))})
    assert _outcome(_admit(codec.encode_request({"t": ["é" * 500]}), text, room, 1000)) == "OK"
    longer = codec.encode_request({"t": ["é" * 500 + "a"]})
    assert _outcome(_admit(longer, text, room, 1000)) == code


def check_rows(limit: int, code: str) -> None:
    assert limit == BatchingConfig().max_batch_size
    schema = _schema({"x": (U8, ("N", "D"))}, max_batch_size=limit)
    assert _outcome(_admit(codec.encode_request(_x(rows=limit)), schema)) == "OK"
    assert _outcome(_admit(codec.encode_request(_x(rows=limit + 1)), schema)) == code


CHECKS: dict[str, Callable[[int, str], None]] = {
    "body_bytes": check_body_bytes,
    "values": check_values,
    "depth": check_depth,
    "name_chars": check_name_chars,
    "rank": check_rank,
    "meta_bytes": check_meta_bytes,
    "element_bytes": check_element_bytes,
    "rows": check_rows,
}


def test_every_limit_in_the_table_has_a_check() -> None:
    assert set(LIMITS) == set(CHECKS), "section 3's limits table and this test's checks differ"


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_limit_holds_at_its_value_and_refuses_past_it(name: str) -> None:
    limit, code = LIMITS[name]
    CHECKS[name](limit, code)


# -- which check answers, and when a reply has meta (section 3) -------------------------------


def test_rows_answer_before_dtype() -> None:
    """The issue's case: 5,000 rows of the wrong dtype are TOO_LARGE, by rows or by bytes."""
    schema = _schema({"x": (np.dtype("float32"), ("N", 16))})
    body = codec.encode_request({"x": np.zeros((5000, 16), np.float64)}, meta=1)
    by_rows = _admit(body, schema, max_bytes=1 << 20)
    assert isinstance(by_rows, Refused)
    assert by_rows.error.code == "TOO_LARGE"
    assert "5000 rows" in by_rows.error.message
    assert by_rows.meta_raw == b"\x01"  # a body that decoded keeps its meta
    by_bytes = _admit(body, schema, max_bytes=1 << 16)
    assert isinstance(by_bytes, Refused)
    assert by_bytes.error.code == "TOO_LARGE"
    assert "max_request_bytes" in by_bytes.error.message
    assert by_bytes.meta_raw is None  # an oversized body has none
    few = codec.encode_request({"x": np.zeros((2, 16), np.float64)})
    assert "dtype" in _refused(_admit(few, schema)).error.message


def _refused(item: Item) -> Refused:
    assert isinstance(item, Refused), item
    return item


def test_fields_answer_before_the_body() -> None:
    """Step 3: an extra field is MALFORMED even when the body is over the size limit."""
    big = codec.encode_request(_x(width=5000), meta=1)
    item = _refused(_admit(big, max_bytes=1024, fields={b"trace": b"t"}))
    assert item.error.code == "MALFORMED"
    assert item.meta_raw is None


def test_structure_answers_before_meta_size() -> None:
    """Step 10 comes last in decoding: malformed and a long meta is MALFORMED."""
    body = _pack({"inputs": {"x": {"dtype": "uint8", "shape": [1, 1], "data": b"\0"}}, "odd": 1})
    body = b"\x83" + body[1:] + _pack("meta") + _pack(b"m" * 5000)
    assert _refused(_admit(body)).error.code == "MALFORMED"


def test_tensors_answer_in_body_order() -> None:
    """Step 8: each tensor whole before the next, so the first at fault answers."""
    long_text = {"dtype": "string", "shape": [1], "data": ["é" * 600]}
    broken = {"dtype": "uint8", "shape": [1, 1], "data": b""}
    schema = _schema({"a": (STRING, ("N",)), "b": (U8, ("N", "D"))})
    first_long = _pack({"inputs": {"a": long_text, "b": broken}})
    first_broken = _pack({"inputs": {"b": broken, "a": long_text}})
    assert _refused(_admit(first_long, schema, max_element_bytes=1000)).error.code == "TOO_LARGE"
    assert _refused(_admit(first_broken, schema, max_element_bytes=1000)).error.code == "MALFORMED"


def test_repeated_outputs_are_answered_once() -> None:
    schema = _schema({"x": (U8, ("N", "D"))}, outputs=("y", "z"))
    item = _admit(codec.encode_request(_x(), outputs=["z", "y", "z"]), schema)
    assert isinstance(item, Admitted)
    assert item.request.outputs == ("z", "y")
    assert "A name given twice is answered once" in WORDS


def test_meta_of_a_malformed_map_is_echoed_but_not_of_a_non_map() -> None:
    body = _pack({"inputs": {}, "meta": [1, 2], "reply_ttl_s": 9})
    item = _refused(_admit(body))
    assert (item.error.code, item.meta_raw, item.reply_ttl_s) == ("MALFORMED", _pack([1, 2]), 9)
    not_map = _refused(_admit(_pack([{"meta": 1}])))
    assert not_map.meta_raw is None
    assert not_map.reply_ttl_s is None


# -- the document's own numbering -------------------------------------------------------------

_ITEM = re.compile(r"^( *)(\d+)\. ")


def _numbered_lists(text: str) -> list[tuple[int, int, int]]:
    """(line, expected, got) for every numbered item out of sequence; code blocks skipped."""
    wrong = []
    active: dict[int, int] = {}  # indent -> last number of the list open there
    fenced = False
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        item = _ITEM.match(line)
        for open_indent in [i for i in active if i > indent or (i == indent and not item)]:
            del active[open_indent]  # a line this far left ends the lists indented deeper
        if item:
            expected = active.get(indent, 0) + 1
            if int(item[2]) != expected:
                wrong.append((lineno, expected, int(item[2])))
            active[indent] = int(item[2])
    return wrong


def test_numbered_lists_count_from_one() -> None:
    assert _numbered_lists(TEXT) == []
    assert _numbered_lists("1. a\n2. b\n4. c\n") == [(3, 3, 4)]  # the check can fail
    assert _numbered_lists("1. a\n   more\n   1. x\n   2. y\n2. b\n\ntext\n\n1. c\n") == []


def test_sections_are_numbered_in_order_and_listed() -> None:
    headings = re.findall(r"^## (\d+)\. (.+)$", TEXT, re.M)
    assert [int(n) for n, _ in headings] == list(range(1, len(headings) + 1))
    contents = re.findall(r"^(\d+)\. \[(.+?)\]\(#", TEXT, re.M)
    assert [(int(n), title) for n, title in contents] == [(int(n), t) for n, t in headings]


def _vector(name: str) -> bytes:
    block = TEXT.split(f"### vector: {name}\n", 1)[1]
    hex_text = block.split("```hex\n", 1)[1].split("```", 1)[0]
    return bytes.fromhex("".join(hex_text.split()))


def test_an_element_too_long_keeps_its_meta() -> None:
    """`element_bytes` is refused while decoding, and the body is a map: its meta comes back."""
    schema = _schema({"t": (STRING, ("N",))})
    body = codec.encode_request({"t": ["x" * 2000]}, meta=7, reply_ttl_s=60)
    item = _refused(_admit(body, schema, max_element_bytes=1000))
    assert (item.error.code, item.meta_raw, item.reply_ttl_s) == ("TOO_LARGE", b"\x07", 60)
