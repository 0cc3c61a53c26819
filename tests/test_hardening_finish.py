"""A finish step Redis refuses for a reason that will not pass (contract v3, section 4).

A reply key, or the dead-letter key, that holds another type (an operator or another program
wrote it) must neither stop the worker (and, at each restart, again) nor lose the request
without a word: the request is dead-lettered with the reason, acknowledged and logged, and its
batch-mates are answered. A hostile entry's dead letter copies no more than the request limit.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from eventually import eventually
from harness import send, serve_in_thread, wait_reply, write_config

from producer.protocol.keys import dead_key, reply_key, request_stream
from tools.localredis import LocalRedis
from worker.answer.finisher import Finisher
from worker.config import load_config
from worker.intake.leases import Leases
from worker.intake.shardmap import ShardMap
from worker.redisio.stream import INLINE_MAX_BYTES, Finish, RequestStream
from worker.service import Worker, prepare

STREAM = request_stream("redbatch", "demo")
DEAD = dead_key("redbatch", "demo")
SMALL, BIG = b"r" * 16, b"R" * INLINE_MAX_BYTES  # a reply inside the script, a staged one


def _reply(rid: str) -> str:
    return reply_key("redbatch", "demo", rid)


def _stream(conn: redis.Redis, **kw: int) -> RequestStream:
    stream = RequestStream(conn, "redbatch", "demo", "me", **kw)
    stream.ensure_group()
    return stream


def _read(
    conn: redis.Redis, entries: list[dict[str, bytes | str]], producer: redis.Redis | None = None
) -> list[bytes]:
    """Add the entries (as ``producer``, else ``conn``) and read them all as consumer ``me``;
    their ids."""
    for fields in entries:
        (producer or conn).xadd(STREAM, fields)  # type: ignore[arg-type]
    got = conn.xreadgroup("workers", "me", {STREAM: ">"}, count=len(entries))
    return [entry_id for entry_id, _ in got[0][1]]


def _dead_letters(conn: redis.Redis) -> list[dict[bytes, bytes]]:
    return [fields for _, fields in conn.xrange(DEAD)]


def _pre_create(conn: redis.Redis, key: str, kind: str) -> None:
    if kind == "string":
        conn.set(key, "not a reply")
    else:
        conn.hset(key, "written", "by another program")


# -- a reply key of another type ---------------------------------------------------------------


@pytest.mark.parametrize("reply", [SMALL, BIG], ids=["inline", "staged"])
@pytest.mark.parametrize("kind", ["string", "hash"])
def test_a_reply_key_of_another_type_dead_letters_its_request_alone(
    rconn: redis.Redis, kind: str, reply: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a batch of four, the second request's reply key written by another program
    stream = _stream(rconn)
    finisher = _finisher(stream)
    rids = ["a", "victim", "b", "c"]
    ids = _read(rconn, [{"rid": rid, "body": b"body-" + rid.encode()} for rid in rids])
    _pre_create(rconn, _reply("victim"), kind)
    finishes = [Finish(eid, rid, reply + rid.encode()) for eid, rid in zip(ids, rids, strict=True)]
    # When it is finished
    with caplog.at_level(logging.WARNING, "worker.redisio.stream"):
        assert finisher.finish_each(finishes) == [True] * 4
    # Then the honest three are answered, the victim dead-lettered with the reason
    for rid in ("a", "b", "c"):
        assert rconn.lrange(_reply(rid), 0, -1) == [reply + rid.encode()]
    [letter] = _dead_letters(rconn)
    assert letter[b"rid"] == b"victim"
    assert letter[b"body"] == b"body-victim"
    reason = letter[b"reason"].decode()
    assert f"reply key {_reply('victim')} holds a {kind}, not a list" in reason
    assert "another program" in reason
    # And every entry is acknowledged and deleted, the other program's key left as it was
    assert rconn.xlen(STREAM) == 0
    assert rconn.xpending(STREAM, "workers")["pending"] == 0
    assert rconn.type(_reply("victim")) == kind.encode()
    assert not any(key.startswith(b"redbatch:{demo}:staging") for key in rconn.scan_iter())
    # And the writer can tell it apart: logged, listed, counted as a dead letter
    assert [(finish.rid, why) for finish, why in finisher.refusals] == [("victim", reason)]
    assert finisher.outcomes(finishes, [True] * 4) == ["OK", "DEAD_LETTER", "OK", "OK"]
    [record] = [r for r in caplog.records if "victim" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "holds a " + kind in record.getMessage()
    # And a later request is answered as usual
    [later] = _read(rconn, [{"rid": "later", "body": b"b"}])
    assert finisher.finish_each([Finish(later, "later", reply)]) == [True]
    assert rconn.lrange(_reply("later"), 0, -1) == [reply]
    assert finisher.refusals == []


@pytest.mark.parametrize("reply", [SMALL, BIG], ids=["inline", "staged"])
def test_a_reply_already_standing_is_kept_and_is_no_refusal(
    rconn: redis.Redis, reply: bytes
) -> None:
    stream = _stream(rconn)
    [entry_id] = _read(rconn, [{"rid": "twice", "body": b"b"}])
    rconn.rpush(_reply("twice"), b"first")
    assert stream.finish_each([Finish(entry_id, "twice", reply)]) == [True]
    assert rconn.lrange(_reply("twice"), 0, -1) == [b"first"]
    assert stream.refusals == []
    assert _dead_letters(rconn) == []


def _finisher(stream: RequestStream) -> Finisher:
    shards = ShardMap(stream.tag)
    shards.add(stream.tag, stream, Leases())
    return Finisher(shards)


def test_a_poisoned_request_whose_reply_key_is_a_string_keeps_both_reasons(
    rconn: redis.Redis,
) -> None:
    stream = _stream(rconn)
    [entry_id] = _read(rconn, [{"rid": "p", "body": b"b"}])
    rconn.set(_reply("p"), "x")
    poisoned = Finish(entry_id, "p", BIG, dead_reason="delivered 3 times", code="POISONED")
    assert stream.finish_each([poisoned]) == [True]
    [letter] = _dead_letters(rconn)
    assert letter[b"reason"].startswith(b"delivered 3 times; reply key ")


# -- a dead-letter key of another type ---------------------------------------------------------


def test_a_dead_letter_key_of_another_type_loses_the_copy_but_answers_and_acks(
    rconn: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a dead-letter key written as a string, and a batch with two dead letters
    stream = _stream(rconn)
    rconn.set(DEAD, "not a stream")
    ids = _read(
        rconn, [{"body": b"no rid"}, {"rid": "p", "body": b"b"}, {"rid": "ok", "body": b"b"}]
    )
    finishes = [
        Finish(ids[0], None, None, dead_reason="entry has no 'rid' field", code="DEAD_LETTER"),
        Finish(ids[1], "p", b"poisoned", dead_reason="delivered 3 times", code="POISONED"),
        Finish(ids[2], "ok", b"ok"),
    ]
    # When it is finished, then nothing raises and every entry is finished here
    with caplog.at_level(logging.ERROR, "worker.redisio.stream"):
        assert stream.finish_each(finishes) == [True, True, True]
    # And the poisoned request still has its error reply, the honest one its reply
    assert rconn.lrange(_reply("p"), 0, -1) == [b"poisoned"]
    assert rconn.lrange(_reply("ok"), 0, -1) == [b"ok"]
    assert rconn.xlen(STREAM) == 0
    assert rconn.get(DEAD) == b"not a stream"
    # And one error says which key, what was lost, and the repair
    [record] = caplog.records
    message = record.getMessage()
    assert record.levelno == logging.ERROR
    for words in (DEAD, "holds a string", "2 requests", "rid p", "no 'rid' field"):
        assert words in message
    assert "DEL or RENAME that key" in message


TINY = "tiny"
X = np.ones((1, 128), np.float32)


def _tiny_reply(rid: str) -> str:
    return reply_key("redbatch", TINY, rid)


def _config(tmp_path: Path, url: str) -> Path:
    return write_config(tmp_path, TINY, url, batching="max_batch_size = 16\nmax_wait_ms = 50")


@contextlib.contextmanager
def _serving(config: Path, name: str = "w1") -> Iterator[Worker]:
    """A real worker on a thread; on exit, stopped, and checked to have stopped only then."""
    worker = Worker(
        prepare(load_config(config), name), redis.Redis.from_url(load_config(config).redis.url)
    )
    thread, failure = serve_in_thread(worker, name)
    try:
        assert worker.ready.wait(60), f"the worker did not start: {failure}"
        yield worker
        assert thread.is_alive(), f"the worker stopped: {failure}"
    finally:
        worker.request_stop()
        thread.join(30)
    assert not failure, failure


def test_a_worker_answers_around_a_reply_key_of_another_type(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    # Given reply keys written as a string and a hash by another program, for one request
    # answered inline (one row) and one staged (eight rows: a reply over INLINE_MAX_BYTES)
    config = _config(tmp_path, redis_url)
    rconn.set(_tiny_reply("v-inline"), "x")
    rconn.hset(_tiny_reply("v-staged"), "k", "v")
    with _serving(config):
        # When they arrive in one read with honest requests
        pipe = rconn.pipeline(transaction=True)
        for rid, rows in [("h0", 1), ("v-inline", 1), ("h1", 8), ("v-staged", 8), ("h2", 1)]:
            send(pipe, TINY, rid, {"x": np.ones((rows, 128), np.float32)})
        pipe.execute()
        # Then the honest ones are answered, the two victims dead-lettered with the reason
        assert all(wait_reply(rconn, rid, 10).ok for rid in ("h0", "h1", "h2"))
        letters = eventually_dead_letters(rconn, 2)
        # And a later request is answered as usual
        assert wait_reply(rconn, send(rconn, TINY, "later", {"x": X}), 10).ok
    reasons = {f[b"rid"]: f[b"reason"].decode() for f in letters}
    assert "holds a string, not a list" in reasons[b"v-inline"]
    assert "holds a hash, not a list" in reasons[b"v-staged"]
    assert rconn.xlen(request_stream("redbatch", TINY)) == 0


def eventually_dead_letters(conn: redis.Redis, count: int) -> list[dict[bytes, bytes]]:
    """The tiny model's dead letters, once there are ``count``."""
    key = dead_key("redbatch", TINY)
    eventually(lambda: conn.xlen(key) >= count, timeout_s=10, what=f"{count} dead letters")
    return [fields for _, fields in conn.xrange(key)]


def test_a_dead_letter_key_of_another_type_stops_no_worker_even_at_a_restart(
    tmp_path: Path, redis_url: str, rconn: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a dead-letter key written as a string
    config = _config(tmp_path, redis_url)
    rconn.set(dead_key("redbatch", TINY), "not a stream")
    stream = request_stream("redbatch", TINY)
    for life in range(2):  # the second life: a restart meets the same key
        with caplog.at_level(logging.ERROR, "worker.redisio.stream"), _serving(config):
            # When an entry without a rid (a dead letter) arrives, then an honest request
            rconn.xadd(stream, {"body": b"no rid"})
            rid = send(rconn, TINY, f"honest-{life}", {"x": X})
            # Then the honest request is answered, the worker still serving
            assert wait_reply(rconn, rid, 10).ok
            eventually(lambda: rconn.xlen(stream) == 0, timeout_s=10, what="the stream drained")
        lost = [r for r in caplog.records if "DEL or RENAME" in r.getMessage()]
        assert len(lost) == life + 1
        assert "no 'rid' field" in lost[-1].getMessage()
    assert rconn.get(dead_key("redbatch", TINY)) == b"not a stream"


def test_a_mixed_shard_batch_lists_the_refusals_of_every_shard(rconn: redis.Redis) -> None:
    shards = ShardMap("demo")
    finishes = []
    for tag in ("demo", "demo~b"):
        stream = RequestStream(rconn, "redbatch", tag, "me")
        stream.ensure_group()
        shards.add(tag, stream, Leases())
        for rid in ("ok", "victim"):
            rconn.xadd(request_stream("redbatch", tag), {"rid": rid, "body": b"b"})
            rconn.set(reply_key("redbatch", tag, "victim"), "x")
        for entry in stream.read(8, 0):
            rid = entry.fields[b"rid"].decode()
            finishes.append(Finish(entry.entry_id, rid, SMALL, shard=tag))
    finisher = Finisher(shards)
    assert finisher.finish_each(finishes) == [True] * 4
    assert sorted((f.shard, f.rid) for f, _ in finisher.refusals) == [
        ("demo", "victim"),
        ("demo~b", "victim"),
    ]
    assert finisher.outcomes(finishes, [True] * 4) == ["OK", "DEAD_LETTER"] * 2


# -- a hostile entry's dead letter ---------------------------------------------------------------


def test_a_dead_letter_copies_no_value_over_the_request_limit(rconn: redis.Redis) -> None:
    # Given an entry with no rid, a body over the limit and 20 MB of other fields
    stream = _stream(rconn, max_request_bytes=4096)
    fields: dict[str, bytes | str] = {"body": b"B" * 10_000}
    fields.update({f"extra{i}": b"x" * (1 << 20) for i in range(20)})
    [entry_id] = _read(rconn, [fields])
    # When it is dead-lettered
    dead = Finish(entry_id, None, None, dead_reason="entry has no 'rid' field", code="DEAD_LETTER")
    assert stream.finish_each([dead]) == [True]
    # Then its copy holds the body's size in its place, and names a few other fields
    [letter] = _dead_letters(rconn)
    assert set(letter) == {b"body", b"reason", b"lane"}
    assert letter[b"body"] == b"<dropped: 10000 bytes, over max_request_bytes>"
    reason = letter[b"reason"].decode()
    assert reason.startswith("entry has no 'rid' field; also had fields extra0, extra1")
    assert reason.endswith(" and 12 more")
    assert max(len(value) for value in letter.values()) <= 4096
    assert rconn.xlen(STREAM) == 0


def test_a_dead_letter_keeps_a_rid_and_body_within_the_limit(rconn: redis.Redis) -> None:
    stream = _stream(rconn, max_request_bytes=4096)
    [entry_id] = _read(rconn, [{"rid": "bad rid!", "body": b"b" * 4096}])
    dead = Finish(entry_id, None, None, dead_reason="rid does not match", code="DEAD_LETTER")
    assert stream.finish_each([dead]) == [True]
    [letter] = _dead_letters(rconn)
    assert letter == {
        b"rid": b"bad rid!",
        b"body": b"b" * 4096,
        b"reason": b"rid does not match",
        b"lane": b"redbatch:{demo}:requests",
    }


def test_a_worker_dead_letters_a_hostile_entry_without_its_extra_fields(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    # Given an entry with no rid and 20 MB in other fields, then an honest request
    stream = request_stream("redbatch", TINY)
    with _serving(_config(tmp_path, redis_url)):
        fields = {f"x{i}": b"x" * (1 << 20) for i in range(20)} | {"body": b"b"}
        rconn.xadd(stream, fields)  # type: ignore[arg-type]
        assert wait_reply(rconn, send(rconn, TINY, "honest", {"x": X}), 10).ok
        [letter] = eventually_dead_letters(rconn, 1)
    # Then its dead letter holds the body and the reason, which names some of the others
    assert set(letter) == {b"body", b"reason", b"lane"}
    assert b"also had fields x0, x1" in letter[b"reason"]
    assert len(letter[b"reason"]) < 1000
    assert rconn.xlen(stream) == 0


# -- under the documented worker ACL -------------------------------------------------------------

DOC = Path(__file__).resolve().parents[1] / "docs" / "security.md"
MARKER = "<!-- aclfile: tests/test_security.py reads the next code block verbatim -->"


@pytest.fixture(scope="module")
def acl_server() -> Iterator[LocalRedis]:
    """A redis-server with the doc's users, plus an administrator for the test itself."""
    acl = DOC.read_text(encoding="utf-8").split(MARKER, 1)[1].split("```", 2)[1].strip("\n")
    acl += "\nuser admin on >admin-password ~* &* +@all"
    with LocalRedis(acl=acl, username="admin", password="admin-password") as server:
        yield server


def test_under_the_worker_acl_refusals_are_reported_not_raised(acl_server: LocalRedis) -> None:
    # The worker's user may not read reply keys (nor TYPE the dead-letter key): the script
    # still tells a list from the rest, and says "another type" where it cannot name it
    admin = acl_server.client()
    password = re.search(r"^user redbatch-worker on >(\S+)", acl_server.acl or "", re.M)
    assert password is not None
    worker = redis.Redis.from_url(acl_server.url_for("redbatch-worker", password[1]))
    try:
        stream = _stream(worker)
        admin.set(_reply("staged"), "x")
        admin.rpush(_reply("stands"), "first")
        admin.set(DEAD, "not a stream")
        rids = ("staged", "stands", "ok")
        ids = _read(worker, [{"rid": rid, "body": b"b"} for rid in rids], admin)
        finishes = [Finish(eid, rid, BIG) for eid, rid in zip(ids, rids, strict=True)]
        assert stream.finish_each(finishes) == [True, True, True]
        [(refused, why)] = stream.refusals
        assert refused.rid == "staged"
        assert f"reply key {_reply('staged')} holds another type, not a list" in why
        assert admin.lrange(_reply("stands"), 0, -1) == [b"first"]
        assert admin.lrange(_reply("ok"), 0, -1) == [BIG]
        assert admin.xlen(STREAM) == 0
    finally:
        admin.flushall()
        admin.close()
        worker.close()
