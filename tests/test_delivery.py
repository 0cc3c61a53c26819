"""Entries that change hands: leases, reclaiming a dead consumer's work, dead-lettering poison.

A "ghost" consumer stands in for a worker that read entries and died: it reads with raw
XREADGROUP and never answers, which is exactly what a SIGKILLed worker leaves in Redis.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from eventually import eventually
from harness import running_worker, send, stream_is_empty, wait_reply, write_config

from tools import synthetic
from worker.ops.metrics import Metrics
from worker.redisio.claims import Claims
from worker.redisio.stream import RequestStream

STREAM = "redbatch:{demo}:requests"
DEAD = "redbatch:{demo}:dead"
GROUP = "workers"


def _features(value: float = 0.5) -> dict[str, np.ndarray]:
    return {"features": np.full((1, 16), value, dtype=np.float32)}


def _ghost_reads(rconn: redis.Redis, name: str, count: int) -> list[bytes]:
    """A consumer reads ``count`` entries and never answers them (a crashed worker)."""
    rconn.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    got = rconn.xreadgroup(GROUP, name, {STREAM: ">"}, count=count)
    return [entry_id for entry_id, _ in got[0][1]]


def _consumers(rconn: redis.Redis) -> set[str]:
    return {c["name"].decode() for c in rconn.xinfo_consumers(STREAM, GROUP)}


def _config(tmp_path: Path, redis_url: str, delivery: str, model: str = "demo", **kw) -> Path:
    return write_config(tmp_path, model, redis_url, extra=f"[delivery]\n{delivery}", **kw)


def test_entries_of_a_dead_consumer_are_claimed_and_each_runs_alone(
    tmp_path: Path, redis_url: str, rconn, caplog: pytest.LogCaptureFixture
) -> None:
    # Given five requests read by a consumer that then died
    rids = [send(rconn, "demo", f"orphan-{i}", _features()) for i in range(5)]
    _ghost_reads(rconn, "ghost", 5)
    config = _config(tmp_path, redis_url, "claim_idle_ms = 300")
    metrics = Metrics()
    # When a live worker runs past claim_idle_ms
    with (
        caplog.at_level(logging.INFO, logger="worker.intake.reclaim"),
        running_worker(config, name="live", metrics=metrics),
    ):
        replies = [wait_reply(rconn, rid) for rid in rids]
        eventually(lambda: stream_is_empty(rconn, "demo"))
        # Then the ghost, with nothing pending and idle, is removed from the group
        eventually(lambda: "ghost" not in _consumers(rconn))
    assert all(r.ok for r in replies), [r.error for r in replies]
    assert {r.worker for r in replies} == {"live"}
    assert [r.batch_rows for r in replies] == [1] * 5  # redelivered: batches of one
    assert metrics.claims.labels(kind="reclaimed")._value.get() == 5
    said = [r.getMessage() for r in caplog.records if "redelivering entries" in r.getMessage()]
    assert len(said) == 1  # one line for the dead consumer, not one per entry
    assert "'ghost'" in said[0]
    assert metrics.consumers_removed._value.get() >= 1
    assert "live" not in _consumers(rconn)  # a clean exit leaves the group


def test_an_entry_delivered_max_deliveries_times_is_dead_lettered_and_answered_poisoned(
    tmp_path: Path, redis_url: str, rconn
) -> None:
    # Given a request that three consumers read and died on (delivery count 3)
    send(rconn, "demo", "pill", _features(), meta={"who": "pill"})
    healthy = send(rconn, "demo", "healthy", _features())
    _ghost_reads(rconn, "ghost", 1)
    for name in ("ghost2", "ghost3"):
        rconn.xclaim(STREAM, GROUP, name, 0, [rconn.xrange(STREAM, count=1)[0][0]])
    config = _config(tmp_path, redis_url, "claim_idle_ms = 200\nmax_deliveries = 3")
    metrics = Metrics()
    with running_worker(config, name="live", metrics=metrics):
        poisoned = wait_reply(rconn, "pill")
        ok = wait_reply(rconn, healthy)
        eventually(lambda: stream_is_empty(rconn, "demo"))
    assert ok.ok
    assert poisoned.error is not None
    assert poisoned.error.code == "POISONED"
    assert "delivered 3 times" in poisoned.error.message
    assert poisoned.meta is None  # the body of a poison pill is not decoded again
    dead = rconn.xrange(DEAD)
    assert len(dead) == 1
    fields = dead[0][1]
    assert fields[b"rid"] == b"pill"
    assert b"body" in fields
    assert b"max_deliveries 3" in fields[b"reason"]
    assert b"ghost3" in fields[b"reason"]
    assert metrics.claims.labels(kind="poisoned")._value.get() == 1


def test_a_restarted_worker_takes_its_own_pending_entries_first(
    tmp_path: Path, redis_url: str, rconn
) -> None:
    # Given entries pending on the name "w1" from an earlier process, and a long claim_idle_ms
    rids = [send(rconn, "demo", f"mine-{i}", _features()) for i in range(3)]
    _ghost_reads(rconn, "w1", 3)
    config = _config(tmp_path, redis_url, "claim_idle_ms = 600000")
    metrics = Metrics()
    # When w1 starts again, it answers them at once rather than after claim_idle_ms
    with running_worker(config, name="w1", metrics=metrics):
        replies = [wait_reply(rconn, rid, timeout_s=10) for rid in rids]
        eventually(lambda: stream_is_empty(rconn, "demo"))
    assert all(r.ok and r.batch_rows == 1 for r in replies)
    assert metrics.claims.labels(kind="own")._value.get() == 3


def test_an_entry_deleted_while_pending_is_dropped_from_the_group(
    tmp_path: Path, redis_url: str, rconn
) -> None:
    send(rconn, "demo", "gone", _features())
    kept = send(rconn, "demo", "kept", _features())
    ids = _ghost_reads(rconn, "ghost", 2)
    rconn.xdel(STREAM, ids[0])
    config = _config(tmp_path, redis_url, "claim_idle_ms = 200")
    metrics = Metrics()
    with running_worker(config, name="live", metrics=metrics):
        assert wait_reply(rconn, kept).ok
        eventually(lambda: stream_is_empty(rconn, "demo"))
    assert metrics.claims.labels(kind="deleted")._value.get() == 1
    assert not rconn.exists("redbatch:{demo}:reply:gone")


def test_a_batch_slower_than_claim_idle_ms_keeps_its_lease_and_runs_once(
    tmp_path: Path, redis_url: str, rconn
) -> None:
    # Given a model run (2,048 rows through a stack of layers) that takes about twice
    # claim_idle_ms (300 ms). At 100 ms a renewal (every claim_idle_ms / 3) late by a few tens
    # of ms on a busy 2-core machine let the other worker claim a held entry, so the run is
    # made long rather than claim_idle_ms short: a depth-24 run takes 100 to 600 ms here with
    # the machine's load, so the model gets as many layers as make one take about 700 ms now.
    claim_idle_ms = 300
    x = np.random.default_rng(0).normal(size=(2048, 512)).astype(np.float32)
    config = write_config(
        tmp_path,
        "slow",
        redis_url,
        batching="max_batch_size = 2048\nmax_wait_ms = 1",
        extra=f"[delivery]\nclaim_idle_ms = {claim_idle_ms}",
    )
    model = tmp_path / "slow.onnx"
    depth = min(240, max(24, round(24 * 700 / _run_ms(model, x))))
    model.write_bytes(synthetic.slow(depth=depth).SerializeToString())
    first, second = Metrics(), Metrics()
    with (
        running_worker(config, name="a", metrics=first),
        running_worker(config, name="b", metrics=second),
    ):
        rids = [send(rconn, "slow", f"long-{i}", {"x": x}) for i in range(4)]
        replies = [wait_reply(rconn, rid, timeout_s=60) for rid in rids]
        eventually(lambda: stream_is_empty(rconn, "slow"))
    assert all(r.ok for r in replies)
    runs = [r.timings_ms["inference"] for r in replies]
    assert max(runs) > claim_idle_ms, runs  # the premise: a run outlasted claim_idle_ms
    workers = (first, second)
    assert sum(m.lease_renewals._value.get() for m in workers) > 0
    # Every execution is counted where it ran; a claimed duplicate would add to these.
    assert sum(m.claims.labels(kind="reclaimed")._value.get() for m in workers) == 0
    assert sum(m.requests.labels(code="OK")._value.get() for m in workers) == 4
    assert sum(m.batch_rows.sum for m in workers) == 4 * 2048


def _run_ms(model: Path, x: np.ndarray) -> float:
    """The fastest of three direct runs of ``model`` on ``x``, in ms."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        session.run(None, {name: x})
        best = min(best, (time.perf_counter() - started) * 1000.0)
    return best


def test_forgetting_consumers_keeps_any_with_pending_entries(redis_url: str, rconn) -> None:
    # Given 50 consumers with nothing pending and one holding an entry
    send(rconn, "demo", "held", _features())
    _ghost_reads(rconn, "holder", 1)
    for i in range(50):
        rconn.xgroup_createconsumer(STREAM, GROUP, f"empty-{i}")
    stream = RequestStream(rconn, "redbatch", "demo", "me")
    # When a worker forgets idle consumers (any idle time)
    gone = Claims(stream).forget_consumers(0)
    # Then every empty one is gone and the holder is kept, with its entry still pending
    assert sorted(gone) == sorted(f"empty-{i}" for i in range(50))
    assert _consumers(rconn) == {"holder"}
    assert rconn.xpending(STREAM, GROUP)["pending"] == 1


def test_consumers_left_by_hundreds_of_restarts_are_removed(
    tmp_path: Path, redis_url: str, rconn
) -> None:
    # Given the names of 300 workers that died with nothing pending
    rconn.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    for i in range(300):
        rconn.xgroup_createconsumer(STREAM, GROUP, f"host-{i}")
    config = _config(tmp_path, redis_url, "claim_idle_ms = 100")
    metrics = Metrics()
    # When a worker runs for a little over its forget interval (2 x claim_idle_ms, at least 1 s)
    with running_worker(config, name="live", metrics=metrics):
        eventually(lambda: len(_consumers(rconn)) <= 1)
    assert metrics.consumers_removed._value.get() == 300


def test_a_hung_batch_lets_its_leases_lapse_and_another_worker_answers(
    tmp_path: Path, redis_url: str, rconn, monkeypatch
) -> None:
    config = _config(tmp_path, redis_url, "claim_idle_ms = 200\nmax_run_s = 0.5")
    running, release = threading.Event(), threading.Event()
    with running_worker(config, name="hung") as hung:
        real_run = hung.model.run

        def hanging_run(feeds, names):
            running.set()
            assert release.wait(60)
            return real_run(feeds, names)

        monkeypatch.setattr(hung.model, "run", hanging_run)
        # Given a worker whose model run hangs on the request it read
        rid = send(rconn, "demo", "stuck", _features())
        assert running.wait(30)
        with running_worker(config, name="rescuer"):
            # Then past max_run_s it reports itself unhealthy and stops renewing, so the other
            # worker claims the request and answers it
            eventually(lambda: rconn.exists(f"redbatch:{{demo}}:reply:{rid}") == 1)
            assert not hung.healthy()
            # and its ready gauge says what /readyz says (the dashboard counts ready workers)
            assert hung.metrics.registry.get_sample_value("redbatch_ready") == 0
            release.set()
            eventually(lambda: hung.metrics.reply_write.count >= 1)  # its late write
            assert hung.served["requests"] == 0  # which finished nothing: not counted as served
        assert hung.healthy()
        assert hung.metrics.registry.get_sample_value("redbatch_ready") == 1
    assert hung.metrics.registry.get_sample_value("redbatch_ready") == 0  # stopped
    assert rconn.llen(f"redbatch:{{demo}}:reply:{rid}") == 1  # the late finish was fenced off
    assert wait_reply(rconn, rid).worker == "rescuer"


def test_pending_unheld_counts_others_entries_and_own_ones_no_longer_in_hand(rconn) -> None:
    # What a burst worker waits for before it calls the stream drained: entries of other
    # consumers, and its own beyond those it is working on (a finish step can leave one pending)
    stream = RequestStream(rconn, "redbatch", "demo", "me")
    stream.ensure_group()
    for i in range(5):
        rconn.xadd(STREAM, {"rid": f"r{i}", "body": b"b"})
    rconn.xreadgroup("workers", "me", {STREAM: ">"}, count=3)
    rconn.xreadgroup("workers", "ghost", {STREAM: ">"}, count=1)
    claims = Claims(stream)
    assert claims.pending_unheld(held=3) == 1  # the ghost's
    assert claims.pending_unheld(held=2) == 2  # and one of its own it no longer holds
    rconn.delete(STREAM)
    assert claims.pending_unheld(held=0) == 0  # no group: nothing to wait for


def test_entries_pending_on_its_own_name_are_never_called_another_workers(
    rconn, caplog: pytest.LogCaptureFixture
) -> None:
    # A read whose answer a Redis stall lost leaves entries pending on this worker's own name;
    # found in the sweep of other consumers' idle entries, the log must not blame a dead worker
    from worker.intake.leases import Leases
    from worker.intake.reclaim import Reclaimer

    claims = Claims(RequestStream(rconn, "redbatch", "demo", "me"))
    reclaimer = Reclaimer(claims, Leases(), claim_idle_ms=1000, max_deliveries=3)
    reclaimer._own = False  # the sweep of every consumer's idle entries
    caplog.set_level(logging.INFO, logger="worker.intake.reclaim")
    reclaimer._announce("me")
    reclaimer._announce("dead-one")
    assert "adopting entries pending on this worker's name" in caplog.records[0].getMessage()
    assert "redelivering entries of consumer 'dead-one'" in caplog.records[1].getMessage()


def test_leases_claims_and_clean_up_run_on_a_full_redis(rconn) -> None:
    # Given entries read by a dead consumer and by this one, and an idle empty consumer, on a
    # Redis past its memory limit under noeviction (a plain write is refused there)
    stream = RequestStream(rconn, "redbatch", "demo", "me")
    stream.ensure_group()
    for i in range(3):
        rconn.xadd(STREAM, {"rid": f"r{i}", "body": b"b"})
    [[_, dead_ones]] = rconn.xreadgroup("workers", "dead-one", {STREAM: ">"}, count=2)
    [[_, mine]] = rconn.xreadgroup("workers", "me", {STREAM: ">"}, count=1)
    rconn.xgroup_createconsumer(STREAM, GROUP, "empty")
    claims = Claims(stream)
    rconn.config_set("maxmemory-policy", "noeviction")
    rconn.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            rconn.xadd(STREAM, {"rid": "more", "body": b"b"})
        # When this worker renews its lease, claims the dead one's entries and cleans up
        renewed = claims.renew([mine[0][0]])
        claimed = claims.claim([eid for eid, _ in dead_ones], min_idle_ms=0)
        gone = claims.forget_consumers(0)
    finally:
        rconn.config_set("maxmemory", 0)
    # Then each step ran: every entry is this worker's, and the empty consumers are gone
    assert renewed == 1
    assert [c.entry_id for c in claimed] == [eid for eid, _ in dead_ones]
    assert sorted(gone) == ["dead-one", "empty"]
    assert rconn.xpending(STREAM, GROUP)["pending"] == 3


class _DownRedis:
    """Claims whose every call fails while ``up`` is False, as during a Redis outage."""

    def __init__(self) -> None:
        self.up = False
        self.renewals = 0
        self.renewed = threading.Event()  # set on every renewal tried
        self.swept = threading.Event()  # set on every sweep of idle consumers tried

    def renew(self, entry_ids: list[bytes]) -> int:
        self.renewals += 1
        self.renewed.set()
        if not self.up:
            raise redis.ConnectionError("Connection refused (test)")
        return len(entry_ids)

    def forget_consumers(self, min_idle_ms: int) -> list[str]:
        self.swept.set()
        if not self.up:
            raise redis.ConnectionError("Connection refused (test)")
        return []


class _FirstTick(random.Random):
    def randrange(self, *args: object, **kwargs: object) -> int:  # type: ignore[override]
        return 0  # the sweep comes every 100th turn, the first at turn 100


def test_lease_renewal_says_redis_is_back_only_once_a_renewal_reached_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from worker.intake.leases import LeaseKeeper, Leases, Stuck

    # Given a keeper (a turn every 10 ms) whose renewal found Redis down
    caplog.set_level(logging.WARNING, logger="worker.intake.leases")
    claims, leases = _DownRedis(), Leases()
    leases.hold([b"1-0"])
    keeper = LeaseKeeper(claims, leases, 30, Stuck(), rng=_FirstTick())  # type: ignore[arg-type]
    keeper.start()
    try:
        assert claims.renewed.wait(10)
        # When it holds nothing, so that its turns send nothing, until its sweep (turn 100)
        # finds Redis still down
        leases.release([b"1-0"])
        claims.swept.clear()
        assert claims.swept.wait(10)
        lines = [r.getMessage() for r in caplog.records if r.name == "worker.intake.leases"]
        # Then it said Redis was down, and never that it was back
        assert any("cannot reach Redis" in line for line in lines), lines
        assert not any("reached Redis again" in line for line in lines), lines
        # And once Redis is up and a renewal reaches it, it says so, once
        claims.up = True
        leases.hold([b"2-0"])
        claims.renewed.clear()
        renewals = claims.renewals
        while claims.renewals < renewals + 2:  # the second: the first one's turn has ended
            assert claims.renewed.wait(10)
            claims.renewed.clear()
    finally:
        keeper.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "worker.intake.leases"]
    assert sum("reached Redis again" in line for line in lines) == 1, lines
