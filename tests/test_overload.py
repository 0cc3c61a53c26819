"""A full Redis (``maxmemory``, ``noeviction``) never wedges the queue, black box, fast tier.

Each test runs one scenario of ``tests/chaos/overload_scenarios.py`` at a small size, in its own
redis-server and worker subprocesses: producers (``producer.Client``) are refused with
``RedisFull`` at the memory high watermark and with nothing else, and workers, a fresh one too,
drain a Redis past ``maxmemory``; every accepted request is answered exactly once with the
right output and nothing is left pending. ``scripts/reliability.py`` runs the same scenarios at
full size (``--only stopped_workers_fill full_speed_small_maxmemory``).
"""

from __future__ import annotations

from pathlib import Path

import chaos
import pytest

pytestmark = pytest.mark.timeout(90)


def _passes(result: chaos.Result) -> None:
    assert result.passed, chaos.describe(result)


def test_workers_drain_a_full_redis_and_producers_get_only_redis_full(tmp_path: Path) -> None:
    # Given stopped workers and producers that submit until refused, then raw XADDs up to OOM
    result = chaos.stopped_workers_fill(
        tmp_path, workers=2, producers=2, maxmemory_mib=4, timeout_s=20
    )
    # Then the oracle found nothing: all answered once, right, nothing pending, no other error
    _passes(result)
    notes = result.notes
    assert notes["other_errors"] == 0
    assert notes["accepted"] > 0
    # each producer was refused at the watermark; past maxmemory a client with the watermark
    # off was refused by Redis itself, as RedisFull too
    assert notes["refused_by"]["watermark"] >= 2
    assert notes["refused_by"]["oom"] >= 1
    # the watermark left room: Redis took more requests before it refused for memory
    assert notes["raw_xadds_past_watermark"] > 0
    # a worker started on the full Redis became ready and served
    assert "fresh_ready_s" in notes
    assert notes["answered_by_fresh"] > 0
    assert notes["answered"] == notes["accepted"] + notes["raw_xadds_past_watermark"]
    # and once the replies were read, the producers could submit again
    assert notes["resubmitted_and_answered"] == 2 * 64


def test_producers_at_full_speed_are_refused_and_every_accepted_request_answered(
    tmp_path: Path,
) -> None:
    # Given producers faster than the workers, two that back off on RedisFull and one that waits
    # (2 MiB and a deeper model: at 3 MiB and depth 8 the workers kept up on a fast hour, the
    # producers peaked at 71% of maxmemory and the scenario tested nothing)
    result = chaos.full_speed_small_maxmemory(
        tmp_path,
        duration_s=3.0,
        maxmemory_mib=2,
        work_depth=16,
        refusing=2,
        waiting=1,
        timeout_s=20,
    )
    # Then every accepted request was read once with the right output, and nothing is pending
    _passes(result)
    notes = result.notes
    assert notes["other_errors"] == 0
    assert notes["answered"] == notes["accepted"] > 0
    # the producers did reach the watermark, again and again
    assert notes["refused_calls"] > 0
    assert notes["drain_s"] is not None
