"""(v2) Both clients send ``string`` and ``bytes`` inputs in every form a caller holds them, and
hand back ``string`` outputs as object arrays of ``str`` (``shell``: see ``tests/shells.py``),
on a real Redis with a fake worker that echoes what it was sent."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
from fakes import FAKE_MODEL, STREAM, ensure_group

from producer.protocol import codec, keys
from producer.protocol.errors import WireFormatError

pytest_plugins = ["shells"]

JPEG = bytes.fromhex("ffd8ffe000104a46494600010100000100010000ffdb0043000806060706") + b"\x00"
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00"


def text_answer(fields: dict[bytes, bytes]) -> tuple[str, bytes]:
    """The echo worker's reply: each input back as ``NAME``, plus for a string input ``NAME_upper``
    (its elements upper-cased) and for a bytes input ``NAME_sizes`` (int64 lengths)."""
    rid = fields[b"rid"].decode()
    body = codec.decode_request(fields[b"body"], max_bytes=1 << 24, max_element_bytes=1 << 20)
    outputs: dict[str, np.ndarray] = {}
    for name, array in body.inputs.items():
        outputs[name] = array
        if codec.wire_dtype(array) == "string":
            outputs[f"{name}_upper"] = np.vectorize(str.upper, otypes=[object])(array)
        elif codec.wire_dtype(array) == "bytes":
            outputs[f"{name}_sizes"] = np.vectorize(len, otypes=[np.int64])(array)
    reply = codec.Reply(
        rid=rid,
        ok=True,
        model=FAKE_MODEL,
        worker="echo-1",
        timings_ms={"queued": 0.1, "inference": 0.2},
        outputs=outputs,
        batch_rows=1,
    )
    return rid, codec.encode_reply(reply)


class EchoReplier:
    """A thread that answers each request as ``text_answer`` says, until stopped."""

    def __init__(self, url: str) -> None:
        self._conn = redis.Redis.from_url(url)
        ensure_group(self._conn)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="echo-replier", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                got: Any = self._conn.xreadgroup(
                    keys.CONSUMER_GROUP, "echo-1", {STREAM: ">"}, count=64, block=1000
                )
                for _stream, entries in got or []:
                    pipe = self._conn.pipeline(transaction=False)
                    for entry_id, fields in entries:
                        if b"stop" in fields:
                            continue
                        rid, reply = text_answer(fields)
                        pipe.rpush(keys.reply_key(keys.DEFAULT_PREFIX, FAKE_MODEL.name, rid), reply)
                        pipe.xack(STREAM, keys.CONSUMER_GROUP, entry_id)
                        pipe.xdel(STREAM, entry_id)
                    pipe.execute()
        except BaseException as exc:  # reported by stop(), so a test fails loudly
            self.error = exc

    def start(self) -> EchoReplier:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._conn.xadd(STREAM, {"stop": "1"})  # wakes the blocked read at once
        self._thread.join(timeout=10)
        self._conn.close()
        if self.error is not None:
            raise self.error


@pytest.fixture
def echo(redis_url: str) -> Iterator[EchoReplier]:
    replier = EchoReplier(redis_url).start()
    yield replier
    replier.stop()


def assert_strs(array: np.ndarray, expected: Any) -> None:
    """An object array of exactly ``str`` elements, ``string`` on the wire, as expected."""
    assert array.dtype == object
    assert codec.wire_dtype(array) == "string"
    assert all(type(e) is str for e in array.ravel())
    assert array.tolist() == expected


def assert_bytes(array: np.ndarray, expected: Any) -> None:
    assert array.dtype == object
    assert codec.wire_dtype(array) == "bytes"
    assert all(type(e) is bytes for e in array.ravel())
    assert array.tolist() == expected


def sent_bodies(rconn: redis.Redis) -> list[dict[str, Any]]:
    """The request bodies on the stream, as msgpack reads them (str and bin kept apart)."""
    entries: Any = rconn.xrange(STREAM)
    return [msgpack.unpackb(fields[b"body"]) for _, fields in entries if b"body" in fields]


# ---------------------------------------------------------------------------------------------
# What goes on the stream


def test_lists_of_bytes_and_str_go_out_as_bytes_and_string_tensors(
    client: Any, rconn: redis.Redis
) -> None:
    client.submit({"image": [JPEG, PNG], "text": ["a", "b\x00"]})
    (body,) = sent_bodies(rconn)
    image, text = body["inputs"]["image"], body["inputs"]["text"]
    assert image == {"dtype": "bytes", "shape": [2], "data": [JPEG, PNG]}  # trailing NUL kept
    assert text == {"dtype": "string", "shape": [2], "data": ["a", "b\x00"]}


def test_numpy_unicode_byte_string_and_object_arrays_go_out_by_their_elements(
    client: Any, rconn: redis.Redis
) -> None:
    client.submit_many(
        [
            {"u": np.array([["x", "\U0001f600"]]), "s": np.array([b"\x00a", b"b"])},
            {"o": np.array(["p", "q"], dtype=object), "b": np.array([JPEG], dtype=object)},
        ]
    )
    first, second = sent_bodies(rconn)
    assert first["inputs"]["u"] == {"dtype": "string", "shape": [1, 2], "data": ["x", "\U0001f600"]}
    assert first["inputs"]["s"] == {"dtype": "bytes", "shape": [2], "data": [b"\x00a", b"b"]}
    assert second["inputs"]["o"]["data"] == ["p", "q"]
    assert second["inputs"]["b"] == {"dtype": "bytes", "shape": [1], "data": [JPEG]}


def test_mixed_str_and_bytes_are_refused_before_anything_is_sent(
    client: Any, rconn: redis.Redis
) -> None:
    with pytest.raises(WireFormatError) as info:
        client.submit({"x": ["a", b"b"]})
    assert info.value.code == "INVALID_INPUT"
    with pytest.raises(WireFormatError):
        client.submit_many([{"x": ["fine"]}, {"x": [b"a", "b"]}])
    with pytest.raises(WireFormatError):
        client.infer({"x": [1, "one"]}, timeout_s=5)
    assert rconn.xlen(STREAM) == 0


# ---------------------------------------------------------------------------------------------
# Round trips through a worker


def test_infer_sends_jpeg_bytes_and_text_and_gets_str_outputs(
    client: Any, echo: EchoReplier
) -> None:
    outputs = client.infer({"image": [JPEG], "text": ["a", "b"]}, timeout_s=30)
    assert_bytes(outputs["image"], [JPEG])
    assert outputs["image_sizes"].tolist() == [len(JPEG)]
    assert_strs(outputs["text"], ["a", "b"])
    assert_strs(outputs["text_upper"], ["A", "B"])


def test_infer_takes_a_bare_str_or_bytes_as_a_0_d_tensor(client: Any, echo: EchoReplier) -> None:
    outputs = client.infer({"prompt": "caf\u00e9", "key": b"\x00k\x00"}, timeout_s=30)
    assert outputs["prompt"].shape == ()
    assert_strs(outputs["prompt_upper"], "CAF\u00c9")
    assert_bytes(outputs["key"], b"\x00k\x00")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (np.array(["x", "\U0001f600", ""]), ["x", "\U0001f600", ""]),
        (np.array([b"\x00a", b"b"]), [b"\x00a", b"b"]),
        (np.array([["p"], ["q"]], dtype=object), [["p"], ["q"]]),
        (codec.as_tensor([b"\x00", b"a\x00"]), [b"\x00", b"a\x00"]),
        ([[bytearray(b"r\x00")], [memoryview(b"s")]], [[b"r\x00"], [b"s"]]),
    ],
    ids=["unicode-array", "byte-string-array", "object-array", "wire-dtype", "bytearray"],
)
def test_submit_and_wait_round_trip_every_text_form(
    client: Any, echo: EchoReplier, value: Any, expected: Any
) -> None:
    rid = client.submit({"v": value})
    result = client.wait(rid, timeout_s=30)
    assert result.ok
    out = result.outputs["v"]
    if isinstance(np.ravel(expected)[0], str):
        assert_strs(out, expected)
    else:
        assert_bytes(out, expected)


def test_submit_many_and_wait_many_carry_text_per_request(client: Any, echo: EchoReplier) -> None:
    requests = [{"text": [f"row {i}", "\u00e9" * i]} for i in range(20)]
    rids = client.submit_many(requests)
    results = {r.rid: r for r in client.wait_many(rids, timeout_s=30)}
    assert set(results) == set(rids)
    for rid, request in zip(rids, requests, strict=True):
        assert_strs(results[rid].outputs["text_upper"], [s.upper() for s in request["text"]])


def test_poll_hands_back_string_outputs_as_str(client: Any, rconn: redis.Redis) -> None:
    body = codec.encode_request({"text": [["poll", "me"]]})
    rid, reply = text_answer({b"rid": b"r-poll", b"body": body})
    rconn.rpush(keys.reply_key(keys.DEFAULT_PREFIX, FAKE_MODEL.name, rid), reply)
    polled = client.poll(rid)
    assert polled is not None
    assert_strs(polled.outputs["text_upper"], [["POLL", "ME"]])


def test_map_splits_text_arrays_by_rows(client: Any, echo: EchoReplier) -> None:
    text = np.array([f"t{i}" for i in range(10)], dtype=object)
    chunks = list(client.map({"text": text}, rows_per_request=3, timeout_s=30))
    assert [(c.start, c.stop) for c in chunks] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    for chunk in chunks:
        assert_strs(
            chunk.outputs["text_upper"], [s.upper() for s in text[chunk.start : chunk.stop]]
        )


def test_map_keeps_the_trailing_nul_bytes_of_a_list_of_bytes(
    client: Any, echo: EchoReplier
) -> None:
    # np.asarray would make a fixed-width 'S' array, which drops them (codec.as_tensor does not)
    chunks = list(client.map({"blob": [b"a\x00", b"b"]}, rows_per_request=1, timeout_s=30))
    assert [c.outputs["blob"].tolist() for c in chunks] == [[b"a\x00"], [b"b"]]
