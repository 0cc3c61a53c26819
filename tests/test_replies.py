"""The reply encoder writes exactly msgpack's own packing of the reply map, and the worker's
encoder and ``producer.protocol.codec.encode_reply`` write the same bytes."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_strategies import RID, a_reply, arrays, meta_values, names

from producer.protocol import codec
from producer.protocol.errors import ERROR_CODES, WireFormatError
from producer.protocol.replies import ReplyEncoder

MODEL = codec.ModelRef("demo", "1", "ab" * 32)

replies = st.builds(
    lambda ok, rid, outputs, error, rows, timings, meta: a_reply(
        rid=rid,
        ok=ok,
        model=MODEL,
        outputs={k: a for k, (_, a) in outputs.items()} if ok else None,
        error=None if ok else error,
        batch_rows=rows,
        timings_ms=timings,
        meta_raw=meta,
    ),
    st.booleans(),
    st.from_regex(RID, fullmatch=True) | st.text(max_size=40),
    st.dictionaries(names, arrays(min_dims=0), max_size=20),
    st.builds(codec.ErrorInfo, st.sampled_from(ERROR_CODES), st.text(), st.booleans()),
    st.none() | st.integers(0, 2**32),
    st.dictionaries(
        st.sampled_from(["queued", "inference"]) | st.text(max_size=8),
        st.floats() | st.integers(0, 2**40),
        max_size=3,
    ),
    st.none() | meta_values.map(codec.pack_meta),
)


def packed_by_msgpack(reply: codec.Reply) -> bytes:
    """The reply map as msgpack packs it, built field by field in contract order; the meta
    bytes follow as they came."""
    doc: dict[str, object] = {"rid": reply.rid, "ok": bool(reply.ok)}
    if reply.ok:
        doc["outputs"] = {name: codec.encode_tensor(a) for name, a in (reply.outputs or {}).items()}
    else:
        error = reply.error or codec.ErrorInfo("INTERNAL", "no detail", True)
        doc["error"] = {"code": error.code, "message": error.message, "retryable": error.retryable}
    doc["model"] = reply.model.as_map()
    doc["worker"] = reply.worker
    if reply.ok and reply.batch_rows is not None:
        doc["batch_rows"] = reply.batch_rows
    doc["timings_ms"] = dict(reply.timings_ms)
    if reply.meta_raw is None:
        return msgpack.packb(doc, use_bin_type=True)
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    packer.pack_map_header(len(doc) + 1)
    for key, value in doc.items():
        packer.pack(key)
        packer.pack(value)
    packer.pack("meta")
    return packer.bytes() + reply.meta_raw


@settings(max_examples=150, deadline=None)
@given(batch=st.lists(replies, min_size=1, max_size=4))
def test_encoded_replies_are_the_bytes_of_encode_reply(batch: list[codec.Reply]) -> None:
    # One encoder for all, as a worker has: its cached tensor headers must not leak across
    encoder = ReplyEncoder(MODEL, "host-1")
    for reply in batch:
        got = encoder.encode(
            reply.rid,
            outputs=reply.outputs,
            error=reply.error,
            batch_rows=reply.batch_rows,
            timings_ms=reply.timings_ms,
            meta_raw=reply.meta_raw,
        )
        assert got == codec.encode_reply(reply)
        assert got == packed_by_msgpack(reply)


def test_a_failed_reply_without_detail_is_the_bytes_of_encode_reply() -> None:
    reply = a_reply(ok=False, outputs=None, error=None, batch_rows=None)
    internal = codec.ErrorInfo("INTERNAL", "no detail", True)
    got = ReplyEncoder(reply.model, reply.worker).encode(
        reply.rid, error=internal, timings_ms=reply.timings_ms
    )
    assert got == codec.encode_reply(reply) == packed_by_msgpack(reply)


def test_text_outputs_given_as_lists_are_the_bytes_msgpack_packs() -> None:
    reply = a_reply(outputs={"labels": ["cat", "dog"], "crops": [b"\x00", b""], "n": [1, 2]})
    assert codec.encode_reply(reply) == packed_by_msgpack(reply)


@pytest.mark.parametrize(
    "reply",
    [
        a_reply(rid="r\ud800"),
        a_reply(worker="w\udfff"),
        a_reply(outputs={"y\ud800": np.zeros(1, np.float32)}),
        a_reply(ok=False, error=codec.ErrorInfo("INTERNAL", "bad \ud800", False)),
        a_reply(timings_ms={"\ud800": 1.0}),
    ],
    ids=["rid", "worker", "output-name", "error-message", "timing-name"],
)
def test_a_str_utf8_cannot_encode_is_invalid_input_wherever_it_is(reply: codec.Reply) -> None:
    with pytest.raises(WireFormatError, match="UTF-8 cannot encode") as info:
        codec.encode_reply(reply)
    assert info.value.code == "INVALID_INPUT"


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(
        st.tuples(
            st.from_regex(RID, fullmatch=True),
            st.dictionaries(names, arrays(), max_size=2),
            st.floats(0, 1e6),
            st.none() | meta_values.map(codec.pack_meta),
        ),
        max_size=5,
    ),
    batch_rows=st.integers(1, 4096),
    inference_ms=st.floats(0, 1e6),
)
def test_a_runs_replies_encoded_together_are_the_bytes_encoded_one_by_one(
    requests: list[tuple[str, dict[str, tuple[str, np.ndarray]], float, bytes | None]],
    batch_rows: int,
    inference_ms: float,
) -> None:
    encoder = ReplyEncoder(codec.ModelRef("m", "1", "0" * 64), "w")
    together = encoder.encode_run(
        [(rid, {k: a for k, (_, a) in outs.items()}, q, meta) for rid, outs, q, meta in requests],
        batch_rows=batch_rows,
        inference_ms=inference_ms,
    )
    assert together == [
        encoder.encode(
            rid,
            outputs={k: a for k, (_, a) in outs.items()},
            batch_rows=batch_rows,
            timings_ms={"queued": q, "inference": inference_ms},
            meta_raw=meta,
        )
        for rid, outs, q, meta in requests
    ]
