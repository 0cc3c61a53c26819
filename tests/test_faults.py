"""The fault-injection fast tier: workers, connections and Redis killed under load, black box.

Each test runs one scenario of ``tests/chaos/`` at a small size, in its own redis-server and
worker subprocesses, and fails with every problem the oracle found (exactly one correct reply per
request, an empty stream, nothing pending, only the injected poison dead-lettered, a bounded
consumer list). ``scripts/reliability.py`` runs the same scenarios at full size. Run this tier
alone with ``pytest tests/test_faults.py``.
"""

from __future__ import annotations

from pathlib import Path

import chaos
import numpy as np
import pytest

from producer.protocol.codec import ErrorInfo, ModelRef, Reply, encode_reply
from producer.protocol.keys import reply_key

pytestmark = pytest.mark.timeout(120)


def _passes(result: chaos.Result) -> None:
    assert result.passed, chaos.describe(result)


def test_oracle_sees_lost_doubled_and_wrong_replies(tmp_path: Path) -> None:
    # Given requests answered by hand: one right, one twice, one wrong, one with the wrong error,
    # one naming another lane than the one it was sent to
    with chaos.Run("oracle", tmp_path, seed=9) as run:
        rids = run.requests.make(6, "o")
        model = ModelRef(chaos.MODEL, "1", "0" * 64)

        def answer(
            rid: str, y: np.ndarray | None = None, code: str | None = None, cls: str = "normal"
        ) -> bytes:
            err = ErrorInfo(code, "by hand") if code else None
            outputs = None if y is None else {"y": y}
            reply = Reply(rid, err is None, model, "hand", {}, outputs, err, 1, cls=cls)
            return encode_reply(reply)

        good = [np.asarray(run.requests.expected[rid].y) for rid in rids]
        run.r.rpush(reply_key(chaos.PREFIX, chaos.MODEL, rids[0]), answer(rids[0], good[0]))
        run.r.rpush(reply_key(chaos.PREFIX, chaos.MODEL, rids[1]), answer(rids[1], good[1]))
        run.r.rpush(reply_key(chaos.PREFIX, chaos.MODEL, rids[1]), answer(rids[1], good[1]))
        run.r.rpush(reply_key(chaos.PREFIX, chaos.MODEL, rids[2]), answer(rids[2], good[2] + 1))
        run.r.rpush(reply_key(chaos.PREFIX, chaos.MODEL, rids[3]), answer(rids[3], code="INTERNAL"))
        run.r.rpush(
            reply_key(chaos.PREFIX, chaos.MODEL, rids[5]), answer(rids[5], good[5], cls="low")
        )
        # When the oracle judges them (the fifth has no reply)
        result = run.check(rids, timeout_s=1)
    # Then it names each fault
    text = "\n".join(result.problems)
    assert result.lost == 1
    assert f"requests got no reply, e.g. ['{rids[4]}']" in text
    assert f"more than one reply: ['{rids[1]}']" in text
    assert f"{rids[2]}: outputs differ" in text
    assert f"{rids[3]}: expected outputs" in text
    assert f"{rids[5]}: sent to lane (normal, None), its reply says ('low', None)" in text


@pytest.mark.parametrize("point", chaos.POINTS)
def test_a_worker_killed_at_each_phase_loses_nothing(tmp_path: Path, point: str) -> None:
    result = chaos.phase_kills(tmp_path, point, requests=300, workers=2, kills=1)
    _passes(result)
    assert result.kills == 1


def test_workers_killed_at_random_moments_lose_nothing_across_lanes(tmp_path: Path) -> None:
    # Given requests spread over lanes: raw version 2 XADDs to P:{T}:requests, classes high and
    # low, and all three classes for two tenants (MULTI; SADD; XADD), and workers SIGKILLed at
    # random moments
    result = chaos.random_kills(
        tmp_path, requests=1000, workers=2, kills=3, duration_s=8.0, lanes=True
    )
    # Then every request of every lane is answered exactly once, its reply naming its lane
    _passes(result)
    assert result.kills >= 3
    assert len(result.lanes) == len(set(chaos.MIX)), result.lanes
    assert all(row["sent"] == row["answered"] > 0 for row in result.lanes.values()), result.lanes


def test_workers_killed_at_random_fault_points_lose_nothing(tmp_path: Path) -> None:
    result = chaos.fault_storm(tmp_path, requests=800, kills=3, duration_s=6.0)
    _passes(result)
    assert result.kills >= 3


@pytest.mark.parametrize("appendfsync", ["always", "everysec"])
def test_redis_killed_and_restarted_with_aof_loses_nothing(
    tmp_path: Path, appendfsync: str
) -> None:
    # everysec: a killed process loses nothing it wrote, so cut the AOF tail as a power cut would
    lose_tail_kb = 16 if appendfsync == "everysec" else 0
    result = chaos.redis_restart(
        tmp_path, appendfsync, requests=800, duration_s=5.0, lose_tail_kb=lose_tail_kb
    )
    _passes(result)
    assert result.redis_restarts == 1


def test_connections_killed_every_second_lose_nothing(tmp_path: Path) -> None:
    result = chaos.client_kills(tmp_path, requests=800, duration_s=6.0, interval_s=1.0)
    _passes(result)
    assert result.notes["connections_killed"] > 0


def test_flushall_mid_run_leaves_workers_serving(tmp_path: Path) -> None:
    _passes(chaos.flushall(tmp_path, before=1000, after=200))


def test_crash_pill_is_dead_lettered_and_its_batch_succeeds(tmp_path: Path) -> None:
    result = chaos.crash_pill(tmp_path, healthy=31, max_deliveries=3, claim_idle_ms=600)
    _passes(result)
    assert result.notes["pill_executions"] <= 3


def test_batch_slower_than_claim_idle_runs_once(tmp_path: Path) -> None:
    result = chaos.slow_batch(tmp_path, requests=96, claim_idle_ms=300)
    _passes(result)
    assert result.duplicates == 0


def test_sigterm_mid_batch_exits_zero_and_duplicates_nothing(tmp_path: Path) -> None:
    result = chaos.sigterm_mid_batch(tmp_path, requests=128)
    _passes(result)
    assert result.duplicates == 0
