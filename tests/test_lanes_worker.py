"""A worker reads every lane of its shard (contract section 7): the lanes its lane set lists,
learnt without a restart, junk in the set ignored, claims and dead letters per lane, empty
lanes removed, and version 2's raw XADD to ``P:{T}:requests`` served as before.

Requests here are sent as a producer of another language would: ``MULTI``, ``SADD`` of the lane
set, ``XADD`` to the lane, ``EXEC``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import redis
from eventually import eventually
from harness import PREFIX, running_worker, write_config
from prometheus_client import generate_latest

from producer.protocol import keys
from producer.protocol.codec import decode_reply, encode_request
from producer.protocol.lanes import lane_stream, lanes_key, tenant_rid
from worker.service import Worker

MODEL = "demo"
X = np.zeros((1, 16), np.float32)
LANES = lanes_key(PREFIX, MODEL)
DEAD = keys.dead_key(PREFIX, MODEL)


def _config(tmp_path: Path, rconn: redis.Redis, extra: str = "") -> Path:
    url = rconn.connection_pool.connection_kwargs
    return write_config(tmp_path, MODEL, f"redis://{url['host']}:{url['port']}/0", extra=extra)


def _send(r: redis.Redis, cls: str, tenant: str | None, name: str) -> str:
    """One request to lane (cls, tenant), registered in the same MULTI; returns its rid."""
    stream = lane_stream(PREFIX, MODEL, cls, tenant)
    rid = tenant_rid(tenant, name)
    pipe = r.pipeline(transaction=True)
    if stream != keys.request_stream(PREFIX, MODEL):
        pipe.sadd(LANES, stream)
    pipe.xadd(stream, {"rid": rid, "body": encode_request({"features": X})})
    pipe.execute()
    return rid


def _answered(r: redis.Redis, rid: str, worker: Worker | None = None) -> bool:
    """The reply is there (each poll a heartbeat too, when a worker must learn a lane)."""
    if worker is not None:
        worker.registry.beat_soon()
    return bool(r.llen(keys.reply_key(PREFIX, MODEL, rid)))


def _reply(r: redis.Redis, rid: str, worker: Worker | None = None):  # type: ignore[no-untyped-def]
    eventually(lambda: _answered(r, rid, worker), what=f"a reply to {rid}")
    key = keys.reply_key(PREFIX, MODEL, rid)
    assert r.llen(key) == 1  # answered once
    return decode_reply(r.lindex(key, 0))


def _metrics(worker: Worker) -> str:
    return generate_latest(worker.metrics.registry).decode()


def _drained(r: redis.Redis, stream: str) -> bool:
    groups = r.xinfo_groups(stream) if r.exists(stream) else []
    return r.xlen(stream) == 0 and all(g["pending"] == 0 for g in groups)


def test_every_lane_is_answered_once_with_its_class_and_tenant(tmp_path: Path, rconn) -> None:
    # Given requests on five lanes, version 2's raw XADD among them, sent before the worker
    sent = {
        ("high", None): [_send(rconn, "high", None, f"h{i}") for i in range(5)],
        ("low", None): [_send(rconn, "low", None, f"l{i}") for i in range(5)],
        ("normal", "acme"): [_send(rconn, "normal", "acme", f"a{i}") for i in range(5)],
        ("low", "beta"): [_send(rconn, "low", "beta", f"b{i}") for i in range(5)],
        ("normal", None): [_send(rconn, "normal", None, f"v2-{i}") for i in range(5)],
    }
    with running_worker(_config(tmp_path, rconn)) as worker:
        # When the worker serves them
        replies = {lane: [_reply(rconn, rid) for rid in rids] for lane, rids in sent.items()}
        streams = [lane_stream(PREFIX, MODEL, c, t) for c, t in sent]
        eventually(lambda: all(_drained(rconn, s) for s in streams), what="every lane drained")
        assert len(worker.lanes) == 5
        # and the metrics count each request's queue wait under its class, and export each
        # lane's backlog with its class and tenant
        worker.registry.beat_soon()
        eventually(
            lambda: 'tenant="beta"' in _metrics(worker), what="the lanes' gauges after a beat"
        )
        text = _metrics(worker)
    for cls, count in (("high", 5), ("normal", 10), ("low", 10)):
        assert f'redbatch_queue_wait_seconds_count{{class="{cls}"}} {count}.0' in text
    assert 'redbatch_backlog{class="low",shard="demo",tenant="beta"} ' in text
    assert 'redbatch_backlog{class="high",shard="demo",tenant=""} ' in text
    # Then each is answered once, ok, and says its lane's class and tenant
    for (cls, tenant), got in replies.items():
        assert all(r.ok for r in got)
        assert {(r.cls, r.tenant) for r in got} == {(cls, tenant)}
    assert rconn.xlen(DEAD) == 0


def test_a_lane_added_later_is_learnt_without_a_restart(tmp_path: Path, rconn) -> None:
    with running_worker(_config(tmp_path, rconn)) as worker:
        assert [lane.key for lane in worker.lanes] == [MODEL]
        # When a producer sends to a lane no one has used yet
        rid = _send(rconn, "high", "late", "x1")
        # Then the next heartbeats learn it, and its request is answered
        reply = _reply(rconn, rid, worker)
        assert (reply.ok, reply.cls, reply.tenant) == (True, "high", "late")
        assert lane_stream(PREFIX, MODEL, "high", "late") in {lane.key for lane in worker.lanes}


def test_a_new_lane_is_learnt_within_the_lane_watch_not_at_the_next_heartbeat(
    tmp_path: Path, rconn
) -> None:
    # Given a worker whose heartbeat comes every 5 s, and which has just started
    config = _config(tmp_path, rconn, "[scheduling]\nlane_watch_ms = 100")
    with running_worker(config) as worker:
        assert worker.registry.interval_s == 5.0
        # When a caller sends the first request of a new lane (no beat forced here)
        rid = _send(rconn, "high", "fresh", "f1")
        # Then it is answered well before the next heartbeat: the lane watch asked for a beat
        eventually(lambda: _answered(rconn, rid), timeout_s=3.0, what="the reply before a beat")
        assert worker.lane_watch.triggered >= 1
        # and a set of junk past 4 x max_lanes waits for the heartbeat instead
        rconn.sadd(LANES, *(f"junk:{i}" for i in range(4 * 64 + 1)))
        seen = worker.lane_watch.triggered
        eventually(
            lambda: worker.lane_watch.sizes.get(MODEL, 0) > 4 * 64, what="the watch saw the set"
        )
        assert worker.lane_watch.triggered == seen


def test_junk_in_the_lane_set_is_ignored_and_the_lanes_are_bounded(
    tmp_path: Path, rconn, caplog
) -> None:
    # Given a lane set holding another shard's lane, keys that are no lane, a malformed name,
    # a lane-named key that holds a string, and more lanes than max_lanes = 2 allows
    other = lane_stream(PREFIX, "other", "high")
    junk = [other, DEAD, f"{PREFIX}:{{{MODEL}}}:requests:urgent", "not a key at all"]
    string_lane = lane_stream(PREFIX, MODEL, "low", "str")
    rconn.sadd(LANES, *junk, string_lane)
    rconn.set(string_lane, "not a stream")
    high = _send(rconn, "high", None, "h")
    beyond = _send(rconn, "low", "zz", "z")  # sorts after high: over the bound
    v2 = _send(rconn, "normal", None, "v2")
    config = _config(tmp_path, rconn, "[scheduling]\nmax_lanes = 2")
    with running_worker(config) as worker:
        # Then the lanes within the bound are served, and the junk is left alone
        assert _reply(rconn, high).ok
        assert _reply(rconn, v2).ok
        expected = {MODEL, lane_stream(PREFIX, MODEL, "high")}
        assert {lane.key for lane in worker.lanes} == expected
        assert not rconn.exists(other)
        assert rconn.get(string_lane) == b"not a stream"
        # the lane over the bound was never joined: no group, its request waits
        assert rconn.xinfo_groups(lane_stream(PREFIX, MODEL, "low", "zz")) == []
        assert not rconn.llen(keys.reply_key(PREFIX, MODEL, beyond))
        # and the worker keeps serving
        assert _reply(rconn, _send(rconn, "high", None, "after")).ok
    assert "ignoring 4 members of the lane set" in caplog.text
    assert "reads at most 2 per shard" in caplog.text


def test_a_hundred_thousand_junk_members_change_nothing_a_worker_serves(
    tmp_path: Path, rconn
) -> None:
    # Given a worker serving a lane, when a tenant floods the lane set with 100,000 members
    # (its ACL role may SADD any name, but create only its own streams): half of them names of
    # lanes of other "tenants" whose streams do not exist, sorting before every real lane and
    # far more than max_lanes = 4 allows, half no lane name at all
    config = _config(tmp_path, rconn, "[scheduling]\nmax_lanes = 4")
    with running_worker(config) as worker:
        before = _send(rconn, "low", "real", "r0")
        assert _reply(rconn, before, worker).ok
        fakes = [lane_stream(PREFIX, MODEL, "high", f"a{i:05d}") for i in range(50_000)]
        junk = [f"junk:{i}" for i in range(50_000)]
        for start in range(0, 50_000, 10_000):
            rconn.sadd(LANES, *fakes[start : start + 10_000], *junk[start : start + 10_000])
        # Then the lane served goes on being served, and a lane first used after the flood is
        # learnt as any other, within heartbeats
        assert _reply(rconn, _send(rconn, "low", "real", "r1"), worker).ok
        late = _send(rconn, "normal", "late", "l1")
        assert _reply(rconn, late, worker).ok
        served = {lane.key for lane in worker.lanes}
        assert lane_stream(PREFIX, MODEL, "low", "real") in served
        assert lane_stream(PREFIX, MODEL, "normal", "late") in served
        assert len(served) == 3
        assert not any(rconn.exists(f) for f in fakes[:100])  # no stream made for a fake name


def test_a_crashed_workers_entries_on_a_lane_are_claimed_and_poison_dead_lettered(
    tmp_path: Path, rconn
) -> None:
    # Given three requests on the high lane held by a worker that died, one of them
    # delivered five times already
    stream = lane_stream(PREFIX, MODEL, "high")
    rids = [_send(rconn, "high", None, f"g{i}") for i in range(3)]
    rconn.xgroup_create(stream, keys.CONSUMER_GROUP, "0")
    held = rconn.xreadgroup(keys.CONSUMER_GROUP, "ghost", {stream: ">"}, count=3)[0][1]
    rconn.xclaim(stream, keys.CONSUMER_GROUP, "ghost", 0, [held[0][0]], retrycount=5)
    config = _config(tmp_path, rconn, "[delivery]\nclaim_idle_ms = 200\nmax_deliveries = 3")
    with running_worker(config):
        # When a live worker claims them
        replies = [_reply(rconn, rid) for rid in rids]
        eventually(lambda: _drained(rconn, stream), what="the lane drained")
    # Then the poison is dead-lettered with its lane, the others answered, all as class high
    assert replies[0].error is not None
    assert replies[0].error.code == "POISONED"
    assert all(r.ok for r in replies[1:])
    assert {r.cls for r in replies} == {"high"}
    [(_, letter)] = rconn.xrange(DEAD)
    assert letter[b"rid"] == rids[0].encode()
    assert letter[b"lane"] == stream.encode()


def test_an_empty_lane_is_removed_and_served_again_when_used(tmp_path: Path, rconn) -> None:
    stream = lane_stream(PREFIX, MODEL, "low", "job")
    config = _config(tmp_path, rconn, "[scheduling]\nlane_idle_s = 1")
    with running_worker(config) as worker:
        assert _reply(rconn, _send(rconn, "low", "job", "first"), worker).ok

        # When the lane stays empty past lane_idle_s
        def removed() -> bool:
            worker.registry.beat_soon()
            return not rconn.exists(stream) and not rconn.sismember(LANES, stream)

        eventually(removed, what="the empty lane removed")

        def retired() -> bool:
            worker.registry.beat_soon()
            return stream not in {lane.key for lane in worker.lanes}

        eventually(retired, what="the lane retired")
        # Then a producer's next request makes it again, and it is served
        reply = _reply(rconn, _send(rconn, "low", "job", "second"), worker)
        assert (reply.ok, reply.cls, reply.tenant) == (True, "low", "job")
        # and the default lane was never removed
        assert rconn.exists(keys.request_stream(PREFIX, MODEL))
