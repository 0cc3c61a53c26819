"""The test vectors in docs/protocol.md hold: they decode to their stated meaning and encode back.

Each positive vector is also rebuilt with a small msgpack writer written here from the spec, the
way an implementation in another language would, so the vectors do not merely echo the codec.
A ``string`` tensor's values are JSON strings, and a ``bytes`` tensor's are hex (v2).
"""

from __future__ import annotations

import importlib.util
import json
import re
import struct
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from producer.protocol import codec, keys, lanes
from producer.protocol.errors import WireFormatError

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "protocol.md"
CONTRACT_EXAMPLE = (
    "81a6696e7075747381a17883a56474797065a7666c6f61743332a57368617065920102"
    "a464617461c4080000803f000020c0"
)
REQUIRED = {"contract-example", "multi-input", "zero-sized-dim", "reply-ok", "reply-error"}
# (v2) string and bytes tensors, and a reply's model.pipeline
REQUIRED_V2 = {
    "string-tensor",
    "bytes-tensor",
    "reply-pipeline",
    "rejected-string-invalid-utf8",
}

_HEADING = re.compile(r"^### vector: (?P<name>[a-z0-9-]+)\s*$", re.MULTILINE)
_BLOCK = re.compile(r"^```(?P<lang>hex|json)\n(?P<text>.*?)^```$", re.MULTILINE | re.DOTALL)


def _parse_vectors(text: str) -> dict[str, tuple[bytes, dict[str, Any]]]:
    """Map vector name to (bytes, meaning): the hex and json blocks under each heading."""
    headings = list(_HEADING.finditer(text))
    vectors: dict[str, tuple[bytes, dict[str, Any]]] = {}
    for i, heading in enumerate(headings):
        end = headings[i + 1].start() if i + 1 < len(headings) else len(text)
        section = text[heading.end() : end].split("\n## ", 1)[0]
        blocks = {m["lang"]: m["text"] for m in _BLOCK.finditer(section)}
        name = heading["name"]
        assert set(blocks) == {"hex", "json"}, f"vector {name} needs one hex and one json block"
        assert name not in vectors, f"vector {name} appears twice"
        vectors[name] = (bytes.fromhex("".join(blocks["hex"].split())), json.loads(blocks["json"]))
    return vectors


VECTORS = _parse_vectors(DOC.read_text(encoding="utf-8"))
REQUESTS = sorted(
    n for n, (_, m) in VECTORS.items() if m["kind"] == "request" and "rejected" not in m
)
REPLIES = sorted(n for n, (_, m) in VECTORS.items() if m["kind"] == "reply")
REJECTED = sorted(n for n, (_, m) in VECTORS.items() if "rejected" in m)
KEYS = sorted(n for n, (_, m) in VECTORS.items() if m["kind"] == "keys")
LANES = sorted(n for n, (_, m) in VECTORS.items() if m["kind"] == "lane")


# ---------------------------------------------------------------------------------------------
# A msgpack writer from the spec, smallest encoding first, as another language would write it.

_STRUCT = {
    "bool": "?",
    "int8": "b",
    "uint8": "B",
    "int16": "h",
    "uint16": "H",
    "int32": "i",
    "uint32": "I",
    "int64": "q",
    "uint64": "Q",
    "float16": "e",
    "float32": "f",
    "float64": "d",
}


class Raw(bytes):
    """Bytes already in msgpack form, written as they are (meta echoed verbatim)."""


def mp(value: Any) -> bytes:
    if isinstance(value, Raw):
        return bytes(value)
    if value is None:
        return b"\xc0"
    if isinstance(value, bool):
        return b"\xc3" if value else b"\xc2"
    if isinstance(value, int):
        return _mp_int(value)
    if isinstance(value, float):
        return b"\xcb" + struct.pack(">d", value)
    if isinstance(value, str):
        raw = value.encode()
        return _header(len(raw), 0xA0, 31, (b"\xd9", b"\xda", b"\xdb")) + raw
    if isinstance(value, bytes):
        return _header(len(value), None, 0, (b"\xc4", b"\xc5", b"\xc6")) + value
    if isinstance(value, list):
        head = _header(len(value), 0x90, 15, (None, b"\xdc", b"\xdd"))
        return head + b"".join(mp(v) for v in value)
    if isinstance(value, dict):
        head = _header(len(value), 0x80, 15, (None, b"\xde", b"\xdf"))
        return head + b"".join(mp(k) + mp(v) for k, v in value.items())
    raise TypeError(f"cannot write {type(value).__name__}")


def _mp_int(n: int) -> bytes:
    if 0 <= n <= 0x7F:
        return bytes([n])
    if -32 <= n < 0:
        return struct.pack(">b", n)
    if n >= 0:
        for tag, fmt in ((b"\xcc", ">B"), (b"\xcd", ">H"), (b"\xce", ">I"), (b"\xcf", ">Q")):
            if n < 1 << (8 * struct.calcsize(fmt)):
                return tag + struct.pack(fmt, n)
    for tag, fmt in ((b"\xd0", ">b"), (b"\xd1", ">h"), (b"\xd2", ">i"), (b"\xd3", ">q")):
        if n >= -(1 << (8 * struct.calcsize(fmt) - 1)):
            return tag + struct.pack(fmt, n)
    raise OverflowError(n)


def _header(n: int, fix: int | None, fix_max: int, tags: tuple[bytes | None, ...]) -> bytes:
    if fix is not None and n <= fix_max:
        return bytes([fix | n])
    for tag, fmt in zip(tags, (">B", ">H", ">I"), strict=True):
        if tag is not None and n < 1 << (8 * struct.calcsize(fmt)):
            return tag + struct.pack(fmt, n)
    raise OverflowError(n)


def hand_tensor(t: dict[str, Any]) -> dict[str, Any]:
    """A tensor's wire map from its meaning, packing elements with struct (little-endian); a
    string or bytes tensor's elements as an array of str or bin."""
    data: Any
    if t["dtype"] == "string":
        data = list(t["values"])
    elif t["dtype"] == "bytes":
        data = [bytes.fromhex(v) for v in t["values"]]
    else:
        data = struct.pack(f"<{len(t['values'])}{_STRUCT[t['dtype']]}", *t["values"])
    return {"dtype": t["dtype"], "shape": t["shape"], "data": data}


def hand_request(m: dict[str, Any]) -> bytes:
    body: dict[str, Any] = {"inputs": {k: hand_tensor(t) for k, t in m["inputs"].items()}}
    for key in ("outputs", "deadline_ms", "meta", "reply_ttl_s"):
        if key in m:
            body[key] = m[key]
    return mp(body)


def hand_reply(m: dict[str, Any]) -> bytes:
    reply: dict[str, Any] = {"rid": m["rid"], "ok": m["ok"]}
    if m["ok"]:
        reply["outputs"] = {k: hand_tensor(t) for k, t in m["outputs"].items()}
    else:
        reply["error"] = m["error"]
    reply["model"] = m["model"]
    reply["worker"] = m["worker"]
    if "batch_rows" in m:
        reply["batch_rows"] = m["batch_rows"]
    reply["timings_ms"] = m["timings_ms"]
    if "meta" in m:
        reply["meta"] = Raw(bytes.fromhex(m["meta_hex"])) if "meta_hex" in m else m["meta"]
    return mp(reply)


# ---------------------------------------------------------------------------------------------
# Values


def values_of(t: dict[str, Any]) -> list[Any]:
    """A tensor meaning's values as Python values: a bytes tensor's from hex."""
    return [bytes.fromhex(v) for v in t["values"]] if t["dtype"] == "bytes" else t["values"]


def array_of(t: dict[str, Any]) -> np.ndarray:
    if t["dtype"] in ("string", "bytes"):
        return codec.as_tensor(values_of(t)).reshape(t["shape"])
    return np.array(t["values"], dtype=codec.DTYPES[t["dtype"]]).reshape(t["shape"])


def assert_tensor_means(array: np.ndarray, t: dict[str, Any]) -> None:
    if t["dtype"] in ("string", "bytes"):
        assert array.dtype == object
        assert codec.wire_dtype(array) == t["dtype"]
    else:
        assert array.dtype == codec.DTYPES[t["dtype"]]
    assert list(array.shape) == t["shape"]
    assert array.ravel().tolist() == values_of(t)


def model_of(m: dict[str, Any]) -> codec.ModelRef:
    pipeline = m.get("pipeline")
    return codec.ModelRef(
        m["name"],
        m["version"],
        m["sha256"],
        None if pipeline is None else codec.PipelineRef(pipeline["handler"], pipeline["sha256"]),
    )


def meta_raw_of(m: dict[str, Any]) -> bytes | None:
    if "meta_hex" in m:
        return bytes.fromhex(m["meta_hex"])
    return mp(m["meta"]) if "meta" in m else None


# ---------------------------------------------------------------------------------------------
# Tests


def test_document_holds_the_required_vectors() -> None:
    assert set(VECTORS) >= REQUIRED | REQUIRED_V2
    assert REJECTED, "the document should show bodies a receiver must refuse"


def test_contract_example_vector_is_the_contract_body() -> None:
    raw, _ = VECTORS["contract-example"]
    assert raw.hex() == CONTRACT_EXAMPLE
    assert len(raw) == 50


def test_contract_example_built_from_msgpack_primitives() -> None:
    def fixstr(s: str) -> bytes:
        return bytes([0xA0 | len(s)]) + s.encode()

    data = struct.pack("<2f", 1.0, -2.5)
    tensor = (
        bytes([0x83])
        + fixstr("dtype")
        + fixstr("float32")
        + fixstr("shape")
        + bytes([0x92, 1, 2])
        + fixstr("data")
        + bytes([0xC4, len(data)])
        + data
    )
    body = bytes([0x81]) + fixstr("inputs") + bytes([0x81]) + fixstr("x") + tensor
    assert body.hex() == CONTRACT_EXAMPLE
    assert codec.encode_request({"x": np.array([[1.0, -2.5]], np.float32)}).hex() == body.hex()


@pytest.mark.parametrize("name", REQUESTS)
def test_request_vector_decodes_to_its_meaning(name: str) -> None:
    raw, m = VECTORS[name]
    body = codec.decode_request(raw, max_bytes=len(raw))
    assert set(body.inputs) == set(m["inputs"])
    for input_name, t in m["inputs"].items():
        assert_tensor_means(body.inputs[input_name], t)
    assert body.outputs == (tuple(m["outputs"]) if "outputs" in m else None)
    assert body.deadline_ms == m.get("deadline_ms")
    assert body.reply_ttl_s == m.get("reply_ttl_s")
    assert body.meta_raw == meta_raw_of(m)
    if "meta" in m:
        assert msgpack.unpackb(body.meta_raw) == m["meta"]


@pytest.mark.parametrize("name", REQUESTS)
def test_request_vector_is_what_the_encoders_write(name: str) -> None:
    raw, m = VECTORS[name]
    encoded = codec.encode_request(
        {k: array_of(t) for k, t in m["inputs"].items()},
        outputs=m.get("outputs"),
        deadline_ms=m.get("deadline_ms"),
        meta=m.get("meta"),
        reply_ttl_s=m.get("reply_ttl_s"),
    )
    assert encoded.hex() == raw.hex()
    assert hand_request(m).hex() == raw.hex()


@pytest.mark.parametrize("name", REPLIES)
def test_reply_vector_decodes_to_its_meaning(name: str) -> None:
    raw, m = VECTORS[name]
    reply = codec.decode_reply(raw)
    assert reply.rid == m["rid"]
    assert reply.ok is m["ok"]
    assert reply.model == model_of(m["model"])
    assert reply.worker == m["worker"]
    assert reply.timings_ms == m["timings_ms"]
    assert reply.batch_rows == m.get("batch_rows")
    assert reply.meta_raw == meta_raw_of(m)
    assert reply.meta == m.get("meta")
    if m["ok"]:
        assert reply.error is None
        assert reply.outputs is not None
        assert set(reply.outputs) == set(m["outputs"])
        for out_name, t in m["outputs"].items():
            assert_tensor_means(reply.outputs[out_name], t)
    else:
        assert reply.outputs is None
        assert reply.error == codec.ErrorInfo(**m["error"])


@pytest.mark.parametrize("name", REPLIES)
def test_reply_vector_is_what_the_encoders_write(name: str) -> None:
    raw, m = VECTORS[name]
    error = m.get("error")
    outputs = m.get("outputs")
    reply = codec.Reply(
        rid=m["rid"],
        ok=m["ok"],
        model=model_of(m["model"]),
        worker=m["worker"],
        timings_ms=m["timings_ms"],
        outputs=None if outputs is None else {k: array_of(t) for k, t in outputs.items()},
        error=None if error is None else codec.ErrorInfo(**error),
        batch_rows=m.get("batch_rows"),
        meta_raw=meta_raw_of(m),
    )
    assert codec.encode_reply(reply).hex() == raw.hex()
    assert hand_reply(m).hex() == raw.hex()


@pytest.mark.parametrize("name", REJECTED)
def test_rejected_vector_is_refused_with_its_code(name: str) -> None:
    raw, m = VECTORS[name]
    with pytest.raises(WireFormatError) as info:
        codec.decode_request(raw, max_bytes=1 << 20)
    assert info.value.code == m["rejected"]


def test_v2_vectors_show_text_elements_and_a_pipeline() -> None:
    # Given the v2 vectors, when read as msgpack, then elements are str and bin, in order
    text = msgpack.unpackb(VECTORS["string-tensor"][0])["inputs"]["text"]
    assert text["data"] == ["hello world", "", "caf\u00e9 \U0001f600"]
    image = msgpack.unpackb(VECTORS["bytes-tensor"][0])["inputs"]["image"]
    assert image["data"][1] == b"\x00\xffabc\x00"  # the trailing NUL is kept
    reply = msgpack.unpackb(VECTORS["reply-pipeline"][0])
    assert set(reply["model"]["pipeline"]) == {"handler", "sha256"}
    assert reply["outputs"]["label"]["data"] == ["cat", "dog"]


def test_invalid_utf8_vector_is_refused_as_not_utf8() -> None:
    raw, _ = VECTORS["rejected-string-invalid-utf8"]
    with pytest.raises(WireFormatError) as info:
        codec.decode_request(raw, max_bytes=1 << 20)
    assert "not valid UTF-8" in info.value.message
    # The same two bytes as bin, in a bytes tensor, are well formed
    as_bin = raw.replace(b"\xa6string", b"\xa5bytes").replace(b"\xa2\xc3\x28", b"\xc4\x02\xc3\x28")
    assert codec.decode_request(as_bin, max_bytes=1 << 20).inputs["text"][0] == b"\xc3\x28"


def test_vectors_section_matches_its_generator() -> None:
    spec = importlib.util.spec_from_file_location("make_vectors", ROOT / "scripts/make_vectors.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = DOC.read_text(encoding="utf-8")
    start, end = doc.index(module.BEGIN), doc.index(module.END) + len(module.END)
    assert doc[start:end] == module.section(), "run scripts/make_vectors.py --write"


# ---------------------------------------------------------------------------------------------
# (v2) Keys of a request on a shard: built here from the contract's patterns, as another
# language would, and checked against the reference and the vector.


def _crc16_xmodem(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def test_the_key_vectors_exist() -> None:
    assert {"keys-first-shard", "keys-second-shard"} <= set(KEYS)


@pytest.mark.parametrize("name", KEYS)
def test_key_vector_matches_the_contract_patterns(name: str) -> None:
    raw, m = VECTORS[name]
    p, t, r = m["prefix"], m["tag"], m["rid"]
    assert raw == f"{p}:{{{t}}}:reply:{r}".encode() == m["reply_key"].encode()
    assert m["request_stream"] == f"{p}:{{{t}}}:requests"
    assert m["cancel_key"] == f"{p}:{{{t}}}:cancel:{r}"
    assert m["dead_key"] == f"{p}:{{{t}}}:dead"
    assert m["shards_key"] == f"{p}:{{{m['model']}}}:shards"
    assert m["handle"] == (r if t == m["model"] else f"{t}/{r}")
    assert m["slot"] == _crc16_xmodem(t.encode()) % 16384
    assert keys.parse_handle(m["handle"], m["model"]) == (t, r)
    if "shards" in m:
        assert m["shards"][0] == m["model"]
        assert t in m["shards"]


def test_the_lane_vectors_exist() -> None:
    assert {"lane-default", "lane-high", "lane-tenant-low"} <= set(LANES)


@pytest.mark.parametrize("name", LANES)
def test_lane_vector_matches_the_contract_patterns(name: str) -> None:
    """Contract section 1 (v3): lane streams, the lane set, a tenant's ids, one MULTI."""
    raw, m = VECTORS[name]
    p, t, c, n = m["prefix"], m["tag"], m["class"], m["tenant"]
    base = f"{p}:{{{t}}}:requests"
    want = base if (c, n) == ("normal", None) else f"{base}:{c}" if n is None else f"{base}:{c}:{n}"
    assert raw == want.encode() == m["lane_stream"].encode()
    rid = m["rid"] if n is None else f"{n}.{m['rid']}"
    assert m["request_id"] == rid
    assert m["reply_key"] == f"{p}:{{{t}}}:reply:{rid}"
    assert m["weights_key"] == f"{p}:{{{m['model']}}}:weights"
    xadd = ["XADD", want, "*", "rid", rid, "body", "B"]
    if (c, n) == ("normal", None):
        assert m["lanes_key"] is None
        assert m["commands"] == [xadd]
    else:
        assert m["lanes_key"] == f"{p}:{{{t}}}:lanes"
        assert m["commands"] == [["MULTI"], ["SADD", m["lanes_key"], want], xadd, ["EXEC"]]
    assert m["slot"] == _crc16_xmodem(t.encode()) % 16384
    assert lanes.parse_lane(p, t, want) == lanes.Lane(t, c, n)
