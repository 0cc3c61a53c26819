"""Hostile stream entries (issue 26, point 4): fields other than ``rid`` and ``body`` are refused
``MALFORMED`` and not kept, whatever their size, and honest requests go on being served."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from eventually import eventually
from fuzzing import FuzzTarget, schema_for
from harness import PREFIX, running_worker, send, wait_reply, write_config

from producer.protocol.codec import encode_request
from producer.protocol.keys import request_stream
from worker.intake.admit import FIELDS_ALLOWANCE, admit
from worker.items import Admitted, DeadLetter, Refused
from worker.redisio.stream import RawEntry

ROOT = Path(__file__).resolve().parents[1]
SMALL_LIMIT = """
[limits]
max_request_bytes = 65536
"""
MULTI = schema_for(FuzzTarget("multi_io"))
FEATURES = {"features": np.ones((1, 16), np.float32)}


def _multi_body() -> bytes:
    return encode_request({"a": np.ones((1, 3), np.float32), "b": np.zeros((1, 2), np.int64)})


def _refused(item: object) -> Refused:
    assert isinstance(item, Refused), item
    return item


def test_an_extra_field_is_malformed_and_its_bytes_are_not_kept() -> None:
    entry = RawEntry(b"1-0", {b"rid": b"r1", b"body": _multi_body(), b"lane": b"x" * 1000}, "s")
    item = _refused(admit(entry, MULTI, 1 << 20))
    assert item.error.code == "MALFORMED"
    assert "'lane' (1,000 bytes)" in item.error.message
    assert "'rid' and 'body'" in item.error.message
    # The refused item keeps what answering it needs, and none of the entry's fields
    assert (item.entry.entry_id, item.entry.shard, item.entry.fields) == (b"1-0", "s", {})


@pytest.mark.parametrize("limit", [1 << 20, 64], ids=["extra-field", "body-too-large"])
def test_nothing_refused_keeps_a_reference_to_the_entrys_bytes(limit: int) -> None:
    # Not the item's entry, nor its error's traceback or cause (whose frames hold the entry)
    junk, body = bytes(1000), _multi_body()
    fields = (
        {b"rid": b"r1", b"body": body, b"x": junk} if limit > 64 else {b"rid": b"r1", b"body": body}
    )
    item = _refused(admit(RawEntry(b"1-0", fields), MULTI, limit))
    del fields
    assert sys.getrefcount(junk) == 2  # this frame's name, and the call's argument
    assert sys.getrefcount(body) == 2
    assert item.error.__traceback__ is None


def test_fields_over_the_limit_are_named_with_the_limit() -> None:
    fields = {b"rid": b"r1", b"body": _multi_body(), b"junk": b"\0" * 70_000, b"k" * 100: b"v"}
    item = _refused(admit(RawEntry(b"1-0", fields), MULTI, 65_536))
    message = item.error.message
    assert item.error.code == "MALFORMED"
    assert "'junk' (70,000 bytes)" in message
    assert "'" + "k" * 64 + "'... (1 bytes)" in message  # a long name is cut short
    assert f"over the limit of {65_536 + FIELDS_ALLOWANCE:,}" in message
    assert "max_request_bytes 65,536" in message
    assert item.entry.fields == {}


def test_a_body_alone_over_the_limit_stays_too_large_and_is_not_kept() -> None:
    body = encode_request({"a": np.ones((1000, 3), np.float32), "b": np.zeros((1000, 2), np.int64)})
    item = _refused(admit(RawEntry(b"1-0", {b"rid": b"r1", b"body": body}), MULTI, 1024))
    assert item.error.code == "TOO_LARGE"
    assert item.entry.fields == {}


def test_a_dead_letter_keeps_no_fields_and_an_honest_entry_keeps_its_own() -> None:
    dead = admit(RawEntry(b"1-0", {b"rid": b"bad rid", b"junk": b"x" * 1000}), MULTI, 1 << 20)
    assert isinstance(dead, DeadLetter)
    assert dead.entry.fields == {}
    fields = {b"rid": b"r1", b"body": _multi_body()}
    ok = admit(RawEntry(b"1-0", fields), MULTI, 1 << 20)
    assert isinstance(ok, Admitted)
    assert ok.entry.fields is fields


def test_no_body_but_another_field_names_the_field() -> None:
    item = _refused(admit(RawEntry(b"1-0", {b"rid": b"r1", b"data": b"x"}), MULTI, 1 << 20))
    assert item.error.code == "MALFORMED"
    assert "'data' (1 bytes)" in item.error.message


def test_a_worker_refuses_extra_fields_and_serves_their_batch_mates(
    tmp_path: Path, redis_url: str, rconn
) -> None:
    config = write_config(tmp_path, "demo", redis_url, extra=SMALL_LIMIT)
    stream = request_stream(PREFIX, "demo")
    body = encode_request(FEATURES)
    with running_worker(config):
        pipe = rconn.pipeline(transaction=False)
        pipe.xadd(stream, {"rid": "honest-0", "body": body})
        pipe.xadd(stream, {"rid": "tenant", "body": body, "tenant": "acme"})
        pipe.xadd(stream, {"rid": "huge", "body": body, "junk": b"\0" * (1 << 20)})
        # a field named twice, which a dict of the fields would hide: 1 MiB under one "body"
        big = b"\0" * (1 << 20)
        pipe.execute_command("XADD", stream, "*", "rid", "twice", "body", big, "body", body)
        pipe.xadd(stream, {"rid": "honest-1", "body": body})
        pipe.execute()
        tenant = wait_reply(rconn, "tenant", model="demo")
        huge = wait_reply(rconn, "huge", model="demo")
        twice = wait_reply(rconn, "twice", model="demo")
        honest = [wait_reply(rconn, f"honest-{i}", model="demo") for i in range(2)]
        send(rconn, "demo", "later", FEATURES)
        later = wait_reply(rconn, "later")
    assert tenant.error is not None
    assert tenant.error.code == "MALFORMED"
    assert "'tenant' (4 bytes)" in tenant.error.message
    assert huge.error is not None
    assert huge.error.code == "MALFORMED"
    assert "'junk' (1,048,576 bytes)" in huge.error.message
    assert "over the limit of 69,632" in huge.error.message
    assert twice.error is not None
    assert twice.error.code == "MALFORMED", twice.error
    assert "a field name repeated" in twice.error.message
    assert all(reply.ok for reply in [*honest, later])
    eventually(lambda: rconn.xlen(stream) == 0, what="the refused entries deleted")


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_flood_of_big_extra_fields_leaves_the_worker_rss_where_it_was(
    tmp_path: Path, redis_url: str, rconn
) -> None:
    config = write_config(tmp_path, "demo", redis_url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker", "--config", str(config), "--name", "rss"],
        cwd=ROOT,
        stderr=subprocess.DEVNULL,
    )
    try:
        send(rconn, "demo", "warm", FEATURES)
        assert wait_reply(rconn, "warm", timeout_s=60).ok
        before = _rss_mib(proc.pid)
        junk = os.urandom(20 << 20)
        body = encode_request(FEATURES)
        for flood in range(2):
            pipe = rconn.pipeline(transaction=False)
            for i in range(4):
                fields = {"rid": f"b{flood}-{i}", "body": body, "x": junk}
                pipe.xadd(request_stream(PREFIX, "demo"), fields)
            pipe.execute()
            for i in range(4):
                reply = wait_reply(rconn, f"b{flood}-{i}", model="demo")
                assert reply.error is not None
                assert reply.error.code == "MALFORMED"
        del junk, pipe
        # The entries' bytes are freed once their read is admitted and given back to the system
        # after the next reads (every block_ms while idle): within 50 MiB of where it was
        eventually(
            lambda: _rss_mib(proc.pid) < before + 50,
            timeout_s=10,
            what=f"the worker's RSS back near {before:.0f} MiB",
        )
        print(
            f"\nFIGURE rss_before_mib={before:.0f}\nFIGURE rss_after_mib={_rss_mib(proc.pid):.0f}"
        )
    finally:
        proc.terminate()
        proc.wait(30)
