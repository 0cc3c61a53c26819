"""Submit, poll, wait, infer, wait_many and cancel, run against both clients (``shell``: see
``tests/shells.py``), on a real Redis with a fake replier standing in for the worker.

The fake replier reads the request stream as the worker would (group ``workers``), answers
``y = x * 2``, and answers INVALID_INPUT for any request holding a negative value.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import redis
from fakes import (
    FAKE_MODEL,
    MODEL,
    PREFIX,
    STREAM,
    FakeReplier,
    answer,
    ensure_group,
    reply_to_entries,
    xs,
)

from producer.client import submission
from producer.protocol import codec, keys
from producer.protocol.errors import ConnectionFailed, InvalidInput, WaitTimeout
from producer.redisio import resp
from tools.localredis import free_port

if TYPE_CHECKING:
    from shells import Shell

pytest_plugins = ["shells"]


def test_submit_then_wait_returns_outputs_and_echoes_meta(
    client: Any, replier: FakeReplier
) -> None:
    meta = {"trace": "abc", "n": [1, 2.5, None]}

    rid = client.submit({"x": xs(2)}, meta=meta, deadline_s=30)
    result = client.wait(rid, timeout_s=10)

    assert result.rid == rid
    assert result.ok
    assert result.error is None
    assert result.outputs is not None
    np.testing.assert_array_equal(result.outputs["y"], xs(2) * 2)
    assert result.meta == meta
    assert result.model == FAKE_MODEL
    assert result.worker == "fake-1"
    assert result.batch_rows == 2
    assert result.timings_ms == {"queued": 0.1, "inference": 0.2}
    result.raise_for_error()  # ok: does nothing


def test_submit_writes_contract_entry(client: Any, rconn: redis.Redis) -> None:
    before_ms = int(time.time() * 1000)

    rid = client.submit({"x": xs(1)}, rid="my-id:1", deadline_s=5, reply_ttl_s=60, outputs=["y"])

    [(_entry_id, fields)] = rconn.xrange(STREAM)
    assert list(fields) == [b"rid", b"body"]
    assert rid == "my-id:1"
    assert fields[b"rid"] == b"my-id:1"
    body = codec.decode_request(fields[b"body"], max_bytes=1 << 20)
    assert body.outputs == ("y",)
    assert body.reply_ttl_s == 60
    assert body.deadline_ms is not None
    assert before_ms + 5000 <= body.deadline_ms <= int(time.time() * 1000) + 5000
    np.testing.assert_array_equal(body.inputs["x"], xs(1))


class BlockedReader:
    """One ``XREADGROUP ... BLOCK`` of the group, on its own thread, as a waiting worker's."""

    def __init__(self, url: str) -> None:
        self._conn = redis.Redis.from_url(url)
        ensure_group(self._conn)
        self.got: list[bytes] = []
        self._thread = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> BlockedReader:
        self._thread.start()
        deadline = time.monotonic() + 10
        while int(self._conn.info("clients")["blocked_clients"]) < 1:  # its read is waiting
            assert time.monotonic() < deadline, "the reader never blocked"
            time.sleep(0.005)
        return self

    def _read(self) -> None:
        got = self._conn.xreadgroup(
            keys.CONSUMER_GROUP, "w", {STREAM: ">"}, count=100, block=10_000
        )
        self.got = [fields[b"rid"] for _stream, entries in got for _id, fields in entries]

    def __exit__(self, *_: object) -> None:
        self._thread.join(timeout=10)
        self._conn.close()


def test_a_batch_of_submits_reaches_a_waiting_worker_in_one_read(
    client: Any, redis_url: str
) -> None:
    # Redis wakes a blocked reader after each command, so a plain pipeline of XADDs would be
    # read as its first entry, then the rest; the client sends a batch as one transaction.
    with BlockedReader(redis_url) as reader:
        rids = client.submit_many([{"x": xs(1)} for _ in range(32)])
    assert reader.got == [rid.encode() for rid in rids]


def test_big_batches_of_submits_go_in_several_capped_transactions(
    client: Any, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(submission, "_TXN_ENTRIES", 4)
    monkeypatch.setattr(submission, "_TXN_BYTES", 1000)
    small = [submission.Submission(f"s{i}", b"x" * 10) for i in range(9)]
    big = [submission.Submission(f"b{i}", b"x" * 600) for i in range(3)]
    assert submission.pack_xadds(STREAM, small).blocks == ((4, True), (4, True), (1, False))
    assert submission.pack_xadds(STREAM, big).blocks == ((2, True), (1, False))
    rids = client.submit_many([{"x": xs(1)} for _ in range(10)])
    assert [f[b"rid"] for _, f in rconn.xrange(STREAM)] == [rid.encode() for rid in rids]
    xadds = submission.pack_xadds(STREAM, small + big)
    submission.check_xadds(xadds, resp.round_trip(rconn, xadds.packer))
    assert rconn.xlen(STREAM) == 10 + 12


def test_default_rids_are_uuid4_hex(client: Any) -> None:
    rids = client.submit_many([{"x": xs(1)}, {"x": xs(1)}])
    assert len(set(rids)) == 2
    assert all(len(rid) == 32 and int(rid, 16) >= 0 for rid in rids)


def test_poll_is_none_until_the_reply_arrives_and_does_not_consume(
    client: Any, rconn: redis.Redis
) -> None:
    rid = client.submit({"x": xs(1)})
    assert client.poll(rid) is None

    ensure_group(rconn)
    entries = rconn.xreadgroup(keys.CONSUMER_GROUP, "t", {STREAM: ">"})[0][1]
    reply_to_entries(rconn, entries)

    first = client.poll(rid)
    assert first is not None
    assert first.ok
    second = client.poll(rid)
    assert second is not None  # still there: poll does not consume
    assert second.rid == first.rid == rid
    assert client.wait(rid, timeout_s=1).ok
    assert client.poll(rid) is None  # wait consumed it


def test_wait_times_out_with_wait_timeout(client: Any) -> None:
    rid = client.submit({"x": xs(1)})
    started = time.monotonic()

    with pytest.raises(WaitTimeout, match=rid):
        client.wait(rid, timeout_s=0.2)

    assert time.monotonic() - started < 2
    assert issubclass(WaitTimeout, TimeoutError)


def test_wait_with_zero_timeout_still_finds_a_reply_that_is_there(
    client: Any, rconn: redis.Redis
) -> None:
    rid = client.submit({"x": xs(1)})
    [(_entry_id, fields)] = rconn.xrange(STREAM)
    rconn.rpush(keys.reply_key(PREFIX, MODEL, rid), answer(fields)[1])

    assert client.wait(rid, timeout_s=0).ok


def test_infer_returns_outputs(client: Any, replier: FakeReplier) -> None:
    outputs = client.infer({"x": xs(3)}, timeout_s=10)
    np.testing.assert_array_equal(outputs["y"], xs(3) * 2)


def test_infer_raises_the_typed_error(client: Any, replier: FakeReplier) -> None:
    with pytest.raises(InvalidInput) as info:
        client.infer({"x": -xs(2) - 1}, timeout_s=10, rid="bad-one")

    assert info.value.code == "INVALID_INPUT"
    assert info.value.message == "input 'x' holds a negative value."
    assert info.value.rid == "bad-one"
    assert info.value.retryable is False


def test_wait_many_yields_every_reply(client: Any, replier: FakeReplier) -> None:
    requests = [{"x": xs(1) + i} for i in range(200)]
    rids = client.submit_many(requests, meta="batch-7")

    results = list(client.wait_many(rids, timeout_s=10))

    assert sorted(r.rid for r in results) == sorted(rids)
    by_rid = {r.rid: r for r in results}
    for rid, request in zip(rids, requests, strict=True):
        outputs = by_rid[rid].outputs
        assert outputs is not None
        np.testing.assert_array_equal(outputs["y"], request["x"] * 2)
        assert by_rid[rid].meta == "batch-7"


def test_wait_many_raises_for_leftovers_at_the_deadline(client: Any, rconn: redis.Redis) -> None:
    # Given two requests of which only the first gets an answer
    rids = client.submit_many([{"x": xs(1)}, {"x": xs(1)}])
    ensure_group(rconn)
    entries = rconn.xreadgroup(keys.CONSUMER_GROUP, "t", {STREAM: ">"}, count=1)[0][1]
    reply_to_entries(rconn, entries)

    # When waiting for both, the answered one is yielded, then the other times out
    seen = []
    with pytest.raises(WaitTimeout, match=rids[1]):
        seen.extend(r.rid for r in client.wait_many(rids, timeout_s=0.3))
    assert seen == [rids[0]]


def test_cancel_sets_the_key_with_a_ttl(client: Any, rconn: redis.Redis) -> None:
    client.cancel("job-1", ttl_s=120)

    key = keys.cancel_key(PREFIX, MODEL, "job-1")
    assert rconn.get(key) == b"1"
    assert 0 < rconn.ttl(key) <= 120


# ---------------------------------------------------------------------------------------------
# Connections


@pytest.mark.parametrize(("auth", "shown"), [("user:s3cret@", "user@"), (":s3cret@", "")])
def test_unreachable_redis_raises_connection_failed_without_the_password(
    shell: Shell, auth: str, shown: str
) -> None:
    port = free_port()
    with shell.Client(MODEL, f"redis://{auth}127.0.0.1:{port}/0", retry_s=0) as c:
        started = time.monotonic()
        with pytest.raises(ConnectionFailed) as info:
            c.backlog()
        assert time.monotonic() - started < 10
        with pytest.raises(ConnectionFailed):
            c.submit({"x": xs(1)})

    message = str(info.value)
    assert f"redis://{shown}127.0.0.1:{port}/0" in message
    assert "s3cret" not in message
    assert isinstance(info.value.__cause__, redis.ConnectionError)


def test_a_rejected_command_raises_connection_failed(client: Any, rconn: redis.Redis) -> None:
    rconn.set(STREAM, "not a stream")
    with pytest.raises(ConnectionFailed, match="WRONGTYPE"):
        client.backlog()


def test_a_rejected_submit_raises_connection_failed(client: Any, rconn: redis.Redis) -> None:
    # Given a request stream key that is not a stream: every XADD of a batch is refused
    rconn.set(STREAM, "not a stream")
    with pytest.raises(ConnectionFailed, match="WRONGTYPE"):
        client.submit_many([{"x": xs(1)}, {"x": xs(1)}])
    # And the connections went back clean: the next commands read their own replies
    rconn.delete(STREAM)
    rid = client.submit({"x": xs(1)})
    assert rconn.xrange(STREAM)[0][1][b"rid"] == rid.encode()


def test_client_accepts_a_redis_client_and_leaves_it_open(
    shell: Shell, redis_url: str, replier: FakeReplier
) -> None:
    conn = shell.redis_from_url(redis_url)
    with shell.Client(MODEL, redis_client=conn) as c:
        assert "127.0.0.1" in repr(c)
        assert repr(c).startswith(f"{shell.cls.__name__}(model='demo', url='redis://")
        np.testing.assert_array_equal(c.infer({"x": xs(1)}, timeout_s=10)["y"], xs(1) * 2)
    assert shell.run(conn.ping())
    shell.run(conn.aclose() if shell.name == "async" else conn.close())

    text = shell.redis_from_url(redis_url, decode_responses=True)
    with pytest.raises(ValueError, match="decode_responses"):
        shell.Client(MODEL, redis_client=text)
    shell.run(text.aclose() if shell.name == "async" else text.close())
