"""Every error code in scope: its exact code, a message naming the input, and no harm done."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from harness import running_worker, send, stream_is_empty, wait_reply, write_config

INPUT_RANGE = """
[limits]
max_request_bytes = 4096
[inputs.a]
min = -100.0
max = 100.0
"""


@pytest.fixture
def multi_io(tmp_path: Path, redis_url: str) -> Path:
    return write_config(tmp_path, "multi_io", redis_url, extra=INPUT_RANGE)


def _ok_inputs(rows: int = 1) -> dict[str, np.ndarray]:
    return {
        "a": np.ones((rows, 3), np.float32),
        "b": np.arange(rows * 2, dtype=np.int64).reshape(rows, 2),
    }


def _tensor(dtype: str, shape: list[int], data: bytes) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data": data}


def _raw(body: object) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


A_OK = _tensor("float32", [1, 3], np.ones(3, np.float32).tobytes())
B_OK = _tensor("int64", [1, 2], np.zeros(2, np.int64).tobytes())

# (request id, raw body, expected code, words the message must contain)
CASES = [
    ("not-msgpack", b"\xc1\x00", "MALFORMED", ["msgpack"]),
    ("not-a-map", _raw([1, 2]), "MALFORMED", ["map"]),
    ("no-inputs", _raw({"outputs": ["twice"]}), "MALFORMED", ["inputs"]),
    (
        "no-dtype",
        _raw({"inputs": {"a": {"shape": [1, 3], "data": b"x" * 12}, "b": B_OK}}),
        "MALFORMED",
        ["'a'", "dtype"],
    ),
    (
        "bad-dtype",
        _raw({"inputs": {"a": _tensor("complex64", [1, 3], b"x" * 24), "b": B_OK}}),
        "MALFORMED",
        ["'a'", "complex64"],
    ),
    (
        "short-data",
        _raw({"inputs": {"a": _tensor("float32", [1, 3], b"x" * 8), "b": B_OK}}),
        "MALFORMED",
        ["'a'", "8 bytes", "12"],
    ),
    (
        "unknown-input",
        _raw({"inputs": {"a": A_OK, "b": B_OK, "c": A_OK}}),
        "INVALID_INPUT",
        ["'c'", "a (float32 [-1, 3])"],
    ),
    ("missing-input", _raw({"inputs": {"a": A_OK}}), "INVALID_INPUT", ["'b'", "int64 [-1, 2]"]),
    (
        "wrong-dtype",
        _raw({"inputs": {"a": _tensor("float64", [1, 3], b"\0" * 24), "b": B_OK}}),
        "INVALID_INPUT",
        ["'a'", "float32", "float64"],
    ),
    (
        "wrong-rank",
        _raw({"inputs": {"a": _tensor("float32", [1, 3, 1], b"\0" * 12), "b": B_OK}}),
        "INVALID_INPUT",
        ["'a'", "[-1, 3]", "[1, 3, 1]"],
    ),
    (
        "wrong-dim",
        _raw({"inputs": {"a": _tensor("float32", [1, 4], b"\0" * 16), "b": B_OK}}),
        "INVALID_INPUT",
        ["'a'", "[-1, 3]", "[1, 4]"],
    ),
    (
        "unequal-rows",
        _raw({"inputs": {"a": _tensor("float32", [2, 3], b"\0" * 24), "b": B_OK}}),
        "INVALID_INPUT",
        ["unequal", "a has 2", "b has 1"],
    ),
    (
        "out-of-range",
        _raw(
            {
                "inputs": {
                    "a": _tensor("float32", [1, 3], np.array([0, 500, 0], "<f4").tobytes()),
                    "b": B_OK,
                }
            }
        ),
        "INVALID_INPUT",
        ["'a'", "500", "[0, 1]", "maximum 100"],
    ),
    (
        "nan",
        _raw(
            {
                "inputs": {
                    "a": _tensor("float32", [1, 3], np.array([0, 0, np.nan], "<f4").tobytes()),
                    "b": B_OK,
                }
            }
        ),
        "INVALID_INPUT",
        ["'a'", "nan", "not finite"],
    ),
    (
        "unknown-output",
        _raw({"inputs": {"a": A_OK, "b": B_OK}, "outputs": ["nope"]}),
        "INVALID_INPUT",
        ["'nope'", "twice"],
    ),
    (
        "too-many-bytes",
        _raw({"inputs": {"a": A_OK, "b": B_OK, "pad": "x" * 5000}}),
        "TOO_LARGE",
        ["4096"],
    ),
    (
        "too-many-rows",
        _raw(
            {
                "inputs": {
                    "a": _tensor("float32", [33, 3], b"\0" * 33 * 12),
                    "b": _tensor("int64", [33, 2], b"\0" * 33 * 16),
                }
            }
        ),
        "TOO_LARGE",
        ["33 rows", "max_batch_size is 32"],
    ),
    (
        "expired",
        _raw({"inputs": {"a": A_OK, "b": B_OK}, "deadline_ms": 1_000}),
        "DEADLINE_EXCEEDED",
        ["deadline"],
    ),
]


def test_each_bad_request_gets_its_code_and_neighbours_are_untouched(multi_io, rconn) -> None:
    # Given every kind of bad request, each sent between two good ones
    with running_worker(multi_io):
        for rid, body, _, _ in CASES:
            send(rconn, "multi_io", f"{rid}-before", _ok_inputs())
            send(rconn, "multi_io", rid, body=body)
            send(rconn, "multi_io", f"{rid}-after", _ok_inputs())
        replies = {rid: wait_reply(rconn, rid) for rid, *_ in CASES}
        neighbours = [
            wait_reply(rconn, f"{rid}-{where}")
            for rid, *_ in CASES
            for where in ("before", "after")
        ]
        # Then the worker still serves a fresh request
        send(rconn, "multi_io", "still-alive", _ok_inputs())
        alive = wait_reply(rconn, "still-alive")

    for rid, _, code, words in CASES:
        reply = replies[rid]
        assert not reply.ok, rid
        assert reply.error is not None
        assert reply.error.code == code, (rid, reply.error)
        for word in words:
            assert word in reply.error.message, (rid, word, reply.error.message)
        assert reply.error.retryable is False
    for reply in neighbours:
        assert reply.ok, reply.error
        np.testing.assert_array_equal(reply.outputs["twice"], np.full((1, 3), 2.0, np.float32))
    assert alive.ok
    assert stream_is_empty(rconn, "multi_io")


def test_missing_body_field_is_malformed_and_bad_rid_is_dead_lettered(multi_io, rconn) -> None:
    stream = "redbatch:{multi_io}:requests"
    with running_worker(multi_io):
        rconn.xadd(stream, {"rid": "no-body"})
        rconn.xadd(stream, {"rid": "../../etc", "body": b"\x80"})
        rconn.xadd(stream, {"body": b"\x80"})
        send(rconn, "multi_io", "marker", _ok_inputs())
        reply = wait_reply(rconn, "no-body", model="multi_io")
        wait_reply(rconn, "marker")

    assert reply.error is not None
    assert reply.error.code == "MALFORMED"
    assert "body" in reply.error.message
    dead = rconn.xrange("redbatch:{multi_io}:dead")
    assert [fields.get(b"rid") for _, fields in dead] == [b"../../etc", None]
    assert all(b"reason" in fields for _, fields in dead)
    assert not rconn.exists("redbatch:{multi_io}:reply:../../etc")
    assert stream_is_empty(rconn, "multi_io")


def test_deadline_in_the_future_runs_and_meta_is_echoed_on_errors_too(multi_io, rconn) -> None:
    future_ms = int(time.time() * 1000) + 60_000
    with running_worker(multi_io):
        send(rconn, "multi_io", "soon", _ok_inputs(), deadline_ms=future_ms, meta={"k": [1, "v"]})
        bad = _ok_inputs()
        bad["a"] = np.full((1, 3), 1e6, np.float32)
        send(rconn, "multi_io", "bad-meta", bad, meta=b"\x01\x02")
        ok = wait_reply(rconn, "soon")
        err = wait_reply(rconn, "bad-meta")
    assert ok.ok
    assert ok.meta == {"k": [1, "v"]}
    assert not err.ok
    assert err.meta == b"\x01\x02"


def test_a_malformed_map_keeps_its_meta_and_reply_ttl_in_its_error_reply(multi_io, rconn) -> None:
    # Given bodies that are maps with meta (a timestamp, as JS and Go encoders write dates)
    # and reply_ttl_s, but a fault elsewhere: an unknown key, an unknown dtype
    stamp = msgpack.packb(msgpack.Timestamp(1_700_000_000, 0))
    meta_then = b"\xa4meta" + stamp + b"\xabreply_ttl_s\x05"
    typo = b"\x84" + _raw("inputs") + _raw({"a": A_OK, "b": B_OK}) + meta_then
    typo += _raw("inptus") + _raw(1)
    dtype = b"\x83" + _raw("inputs") + _raw({"a": _tensor("complex64", [1], b"")}) + meta_then
    with running_worker(multi_io):
        send(rconn, "multi_io", "typo", body=typo)
        send(rconn, "multi_io", "dtype", body=dtype)
        ttls = {rid: rconn.ttl(f"redbatch:{{multi_io}}:reply:{rid}") for rid in ("typo", "dtype")}
        while -2 in ttls.values():  # polls Redis for the replies; not yet written
            time.sleep(0.005)
            ttls = {rid: rconn.ttl(f"redbatch:{{multi_io}}:reply:{rid}") for rid in ttls}
        replies = [wait_reply(rconn, rid, model="multi_io") for rid in ("typo", "dtype")]
    for reply in replies:
        assert reply.error is not None
        assert reply.error.code == "MALFORMED"
        assert reply.meta_raw == stamp  # echoed byte for byte
    # Then each reply lives for the 5 s it asked for, not the worker's hour
    assert all(0 < ttl <= 5 for ttl in ttls.values()), ttls


def test_cancelled_request_is_answered_without_running(multi_io, rconn) -> None:
    rconn.set("redbatch:{multi_io}:cancel:changed-mind", 1, ex=60)
    with running_worker(multi_io):
        send(rconn, "multi_io", "changed-mind", _ok_inputs(), meta="m")
        send(rconn, "multi_io", "kept", _ok_inputs())
        cancelled = wait_reply(rconn, "changed-mind")
        kept = wait_reply(rconn, "kept")
    assert cancelled.error is not None
    assert cancelled.error.code == "CANCELLED"
    assert cancelled.meta == "m"
    assert kept.ok
    assert stream_is_empty(rconn, "multi_io")


def test_entry_with_thousands_of_fields_and_no_rid_is_dead_lettered(multi_io, rconn) -> None:
    fields = {f"f{i}": b"x" for i in range(4000)}
    with running_worker(multi_io):
        rconn.xadd("redbatch:{multi_io}:requests", fields)
        send(rconn, "multi_io", "after-odd", _ok_inputs())
        assert wait_reply(rconn, "after-odd").ok
    [(_, dead)] = rconn.xrange("redbatch:{multi_io}:dead")
    # no rid and no body: only the reason, which names some of the fields it did not copy, and
    # the lane it was read from
    assert set(dead) == {b"reason", b"lane"}
    assert dead[b"lane"] == b"redbatch:{multi_io}:requests"
    assert dead[b"reason"].startswith(b"entry has no 'rid' field; also had fields f0, f1")
    assert dead[b"reason"].endswith(b"and 3992 more")
    assert stream_is_empty(rconn, "multi_io")


def test_a_decoder_bug_fails_only_its_request(
    tmp_path: Path, redis_url: str, rconn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a schema check that raises something no rule anticipated, for one request only
    config = write_config(tmp_path, "demo", redis_url)
    x = np.zeros((1, 16), np.float32)
    with running_worker(config) as worker:
        real = worker.schema.validate

        def buggy(decoded):
            if decoded.meta_raw is not None:
                raise RecursionError("a bug")
            return real(decoded)

        monkeypatch.setattr(worker.schema, "validate", buggy)
        send(rconn, "demo", "before", {"features": x})
        send(rconn, "demo", "buggy", {"features": x}, meta="trigger")
        send(rconn, "demo", "after", {"features": x})
        replies = {rid: wait_reply(rconn, rid) for rid in ("before", "buggy", "after")}
        assert worker.reader.is_alive()
    assert replies["before"].ok
    assert replies["after"].ok
    assert replies["buggy"].error is not None
    assert replies["buggy"].error.code == "INTERNAL"
