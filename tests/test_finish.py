"""The per-batch finish step against a real Redis: replies, fencing, one ack per batch, and a
full Redis.

Each test reads entries as consumer ``me`` with raw XREADGROUP (as the worker's intake does),
then finishes some of them with ``RequestStream.finish`` and checks what Redis holds after.
"""

from __future__ import annotations

import pytest
import redis

from worker.redisio import stream as stream_module
from worker.redisio.stream import INLINE_MAX_BYTES, Finish, RequestStream

STREAM = "redbatch:{demo}:requests"
DEAD = "redbatch:{demo}:dead"
GROUP = "workers"


def _read(rconn: redis.Redis, consumer: str, count: int) -> list[bytes]:
    """Add ``count`` entries (rids r0, r1, ...) and read them all as ``consumer``."""
    start = rconn.xlen(STREAM)
    for i in range(count):
        rconn.xadd(STREAM, {"rid": f"r{start + i}", "body": b"b"})
    got = rconn.xreadgroup(GROUP, consumer, {STREAM: ">"}, count=count)
    return [entry_id for entry_id, _ in got[0][1]]


def _stream(rconn: redis.Redis, consumer: str = "me") -> RequestStream:
    stream = RequestStream(rconn, "redbatch", "demo", consumer)
    stream.ensure_group()
    return stream


def _reply(rid: str, entry_id: bytes, payload: bytes | None = None, **kw) -> Finish:
    return Finish(entry_id, rid, payload if payload is not None else rid.encode(), **kw)


BIG = b"x" * INLINE_MAX_BYTES  # a reply long enough to be staged before the script


def _keys(rconn: redis.Redis) -> set[bytes]:
    """Every key but the stream and the dead letters: what a finish left behind."""
    return set(rconn.scan_iter()) - {STREAM.encode(), DEAD.encode()}


def test_replies_are_written_with_their_ttl_and_the_entries_acked_and_deleted(rconn) -> None:
    # Given 32 entries read by this consumer
    stream = _stream(rconn)
    ids = _read(rconn, "me", 32)
    # When the batch is finished, each with a reply of its own size and TTL
    items = [
        _reply(f"r{i}", eid, bytes([i]) * (64 << (i % 8)), reply_ttl_s=100 + i)
        for i, eid in enumerate(ids)
    ]
    assert stream.finish(items) == 32
    # Then every reply key holds exactly its reply, with its TTL
    for i, item in enumerate(items):
        assert rconn.lrange(f"redbatch:{{demo}}:reply:r{i}", 0, -1) == [item.reply]
        assert 90 + i < rconn.ttl(f"redbatch:{{demo}}:reply:r{i}") <= 100 + i
    # And nothing is left pending or in the stream, and no other key was written
    assert rconn.xpending(STREAM, GROUP)["pending"] == 0
    assert rconn.xlen(STREAM) == 0
    assert _keys(rconn) == {f"redbatch:{{demo}}:reply:r{i}".encode() for i in range(32)}


def test_entries_claimed_by_another_consumer_are_left_to_it(rconn) -> None:
    # Given four entries of this consumer and two read by another
    stream = _stream(rconn)
    mine = _read(rconn, "me", 4)
    theirs = _read(rconn, "other", 2)
    # When this consumer finishes all six (a late finish after a claim)
    items = [_reply(f"r{i}", eid) for i, eid in enumerate(mine + theirs)]
    assert stream.finish(items) == 4
    # Then only its own are answered and acked; the other's stay pending, unanswered
    assert [rconn.exists(f"redbatch:{{demo}}:reply:r{i}") for i in range(6)] == [1, 1, 1, 1, 0, 0]
    pending = rconn.xpending_range(STREAM, GROUP, "-", "+", 10)
    assert [(p["message_id"], p["consumer"]) for p in pending] == [(e, b"other") for e in theirs]
    assert rconn.xlen(STREAM) == 2
    assert _keys(rconn) == {f"redbatch:{{demo}}:reply:r{i}".encode() for i in range(4)}


@pytest.mark.parametrize("payload", [None, BIG], ids=["in-the-script", "staged"])
def test_a_reply_already_there_stands_and_a_key_of_another_type_is_left_alone(
    rconn, payload: bytes | None
) -> None:
    # Given a reply already written for r0 (a redelivery) and a string under r1's reply key
    stream = _stream(rconn)
    ids = _read(rconn, "me", 3)
    rconn.rpush("redbatch:{demo}:reply:r0", b"first")
    rconn.set("redbatch:{demo}:reply:r1", b"not a list")
    # When the three are finished
    assert stream.finish([_reply(f"r{i}", eid, payload) for i, eid in enumerate(ids)]) == 3
    # Then the first reply and the string stand, the third is written, and all are acked
    assert rconn.lrange("redbatch:{demo}:reply:r0", 0, -1) == [b"first"]
    assert rconn.get("redbatch:{demo}:reply:r1") == b"not a list"
    assert rconn.lrange("redbatch:{demo}:reply:r2", 0, -1) == [payload or b"r2"]
    assert _keys(rconn) == {
        b"redbatch:{demo}:reply:r0",
        b"redbatch:{demo}:reply:r1",
        b"redbatch:{demo}:reply:r2",
    }
    assert rconn.ttl("redbatch:{demo}:reply:r0") == -1  # its TTL untouched too
    assert rconn.xpending(STREAM, GROUP)["pending"] == 0


def test_entries_of_this_consumer_beyond_one_page_are_still_found(rconn) -> None:
    # Given 200 entries of this consumer, and a batch of every fifth one: the batch's id range
    # holds more of its pending entries than one XPENDING page of the script asks for
    stream = _stream(rconn)
    ids = _read(rconn, "me", 200)
    batch = ids[::5]
    # When the batch is finished
    assert stream.finish([_reply(f"r{5 * i}", eid) for i, eid in enumerate(batch)]) == 40
    # Then exactly its entries are answered and acked; the other 160 stay pending
    assert all(rconn.exists(f"redbatch:{{demo}}:reply:r{5 * i}") for i in range(40))
    assert not rconn.exists("redbatch:{demo}:reply:r1")
    pending = {p["message_id"] for p in rconn.xpending_range(STREAM, GROUP, "-", "+", 500)}
    assert pending == set(ids) - set(batch)


def test_dead_letters_are_copied_with_their_reason_and_answered_when_asked(rconn) -> None:
    # Given two entries of this consumer
    stream = _stream(rconn)
    ids = _read(rconn, "me", 2)
    # When one is dead-lettered with a reply and the other without one
    items = [
        Finish(ids[0], "r0", b"poisoned", dead_reason="delivered 3 times"),
        Finish(ids[1], None, None, dead_reason="bad rid"),
    ]
    assert stream.finish(items) == 2
    # Then both are in the dead-letter stream with their fields and reason
    dead = [fields for _, fields in rconn.xrange(DEAD)]
    assert dead == [
        {b"rid": b"r0", b"body": b"b", b"reason": b"delivered 3 times", b"lane": STREAM.encode()},
        {b"rid": b"r1", b"body": b"b", b"reason": b"bad rid", b"lane": STREAM.encode()},
    ]
    assert rconn.lrange("redbatch:{demo}:reply:r0", 0, -1) == [b"poisoned"]
    assert rconn.xlen(STREAM) == 0


def test_a_staged_reply_that_is_gone_is_written_inside_the_script(rconn, monkeypatch) -> None:
    # Given two entries with long replies, and a Redis that loses the first staged reply before
    # the script runs (as a full Redis refusing the push, or eviction, would)
    stream = _stream(rconn)
    ids = _read(rconn, "me", 2)
    real_stage = stream_module._stage
    calls = []

    def stage_first_elsewhere(packer, key: bytes, reply: bytes, ttl: bytes) -> None:
        calls.append(key)
        real_stage(packer, key + (b"-lost" if len(calls) == 1 else b""), reply, ttl)

    monkeypatch.setattr(stream_module, "_stage", stage_first_elsewhere)
    # When both are finished
    assert stream.finish([_reply(f"r{i}", eid, BIG + b"%d" % i) for i, eid in enumerate(ids)]) == 2
    # Then both are answered, the first through the script itself, and nothing is pending
    assert rconn.lrange("redbatch:{demo}:reply:r0", 0, -1) == [BIG + b"0"]
    assert rconn.lrange("redbatch:{demo}:reply:r1", 0, -1) == [BIG + b"1"]
    assert rconn.ttl("redbatch:{demo}:reply:r0") > 0
    assert rconn.xpending(STREAM, GROUP)["pending"] == 0


def test_staging_keys_differ_between_two_lives_of_one_worker_name(rconn) -> None:
    # Given a staged reply left by a worker "me" that died between staging and its script
    first = _stream(rconn)
    ids = _read(rconn, "me", 1)
    leftover = first._staging + b".0"
    assert leftover.startswith(b"redbatch:{demo}:staging:me:")
    rconn.rpush(leftover, b"an old reply")
    # When the worker, restarted under the same name, finishes a request with a long reply
    again = _stream(rconn)
    assert again.finish([_reply("r0", ids[0], BIG)]) == 1
    # Then its reply is its own alone, and the leftover is untouched (its TTL ends it)
    assert rconn.lrange("redbatch:{demo}:reply:r0", 0, -1) == [BIG]
    assert rconn.lrange(leftover, 0, -1) == [b"an old reply"]


def test_a_script_redis_lost_is_loaded_again_and_run(rconn) -> None:
    # Given a worker that ran the script once, then a Redis that forgot it (restart, flush)
    stream = _stream(rconn)
    first = _read(rconn, "me", 1)
    assert stream.finish([_reply("r0", first[0])]) == 1
    rconn.script_flush()
    ids = _read(rconn, "me", 3)
    # When it finishes the next batch, one reply staged
    items = [_reply(f"r{i + 1}", eid, BIG if i == 0 else None) for i, eid in enumerate(ids)]
    assert stream.finish(items) == 3
    # Then every reply is written once and nothing is left pending or staged
    assert [rconn.llen(f"redbatch:{{demo}}:reply:r{i}") for i in range(4)] == [1, 1, 1, 1]
    assert rconn.xpending(STREAM, GROUP)["pending"] == 0
    assert _keys(rconn) == {f"redbatch:{{demo}}:reply:r{i}".encode() for i in range(4)}


def test_a_full_redis_still_finishes_a_batch_and_frees_its_requests(rconn) -> None:
    # Given entries read by this consumer, a long reply and a dead letter among them, on a
    # Redis past its memory limit under noeviction: a plain write (a staged reply) is refused
    stream = _stream(rconn)
    ids = _read(rconn, "me", 3)
    items = [_reply("r0", ids[0]), _reply("r1", ids[1], BIG)]
    items.append(Finish(ids[2], "r2", b"poisoned", dead_reason="delivered 3 times"))
    rconn.config_set("maxmemory-policy", "noeviction")
    rconn.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            rconn.rpush("redbatch:{demo}:reply:other", b"x")
        # When the batch is finished
        assert stream.finish(items) == 3
    finally:
        rconn.config_set("maxmemory", 0)
    # Then every reply is written with its TTL, the dead letter copied, and the stream emptied
    assert [rconn.lrange(f"redbatch:{{demo}}:reply:r{i}", 0, -1) for i in range(3)] == [
        [b"r0"],
        [BIG],
        [b"poisoned"],
    ]
    assert _keys(rconn) == {f"redbatch:{{demo}}:reply:r{i}".encode() for i in range(3)}
    assert all(rconn.ttl(f"redbatch:{{demo}}:reply:r{i}") > 0 for i in range(3))
    assert rconn.xlen(DEAD) == 1
    assert rconn.xpending(STREAM, GROUP)["pending"] == 0
    assert rconn.xlen(STREAM) == 0


def test_the_group_is_made_on_a_full_redis_and_an_existing_one_is_kept(rconn) -> None:
    # Given a stream that producers filled before any worker existed, on a full Redis
    rconn.xadd(STREAM, {"rid": "r0", "body": b"b"})
    rconn.config_set("maxmemory-policy", "noeviction")
    rconn.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            rconn.xgroup_create(STREAM, GROUP, id="0")
        # When a worker makes sure of its group, twice (a restart)
        stream = RequestStream(rconn, "redbatch", "demo", "me")
        stream.ensure_group()
        stream.ensure_group()
        # Then the group exists from 0, so the request sent before it is read
        got = rconn.xreadgroup(GROUP, "me", {STREAM: ">"}, count=10)
    finally:
        rconn.config_set("maxmemory", 0)
    assert [fields[b"rid"] for _, fields in got[0][1]] == [b"r0"]


def test_an_entry_twice_in_one_batch_is_finished_once(rconn) -> None:
    # Given one entry of this consumer, listed twice in a batch, dead-lettered both times
    stream = _stream(rconn)
    [eid] = _read(rconn, "me", 1)
    items = [_reply("r0", eid, dead_reason="twice") for _ in range(2)]
    # When the batch is finished, it counts once, with one reply and one dead letter
    assert stream.finish(items) == 1
    assert rconn.lrange("redbatch:{demo}:reply:r0", 0, -1) == [b"r0"]
    assert rconn.xlen(DEAD) == 1


def test_a_group_gone_finishes_nothing_and_writes_no_reply(rconn) -> None:
    # Given entries read, then a FLUSHALL (or a restart without persistence) took the group
    stream = _stream(rconn)
    ids = _read(rconn, "me", 2)
    rconn.flushall()
    # When they are finished, none is, and no reply is written or left staged
    assert stream.finish([_reply(f"r{i}", eid, BIG) for i, eid in enumerate(ids)]) == 0
    assert set(rconn.scan_iter()) == set()


def test_a_request_stream_of_the_wrong_type_is_raised(rconn) -> None:
    # Given a key of another type where the request stream should be
    stream = _stream(rconn)
    ids = _read(rconn, "me", 1)
    rconn.delete(STREAM)
    rconn.set(STREAM, "not a stream")
    # When a batch is finished, the error reaches the worker instead of reading as "not ours"
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        stream.finish([_reply("r0", ids[0])])
