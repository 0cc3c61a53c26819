"""Lanes on a Redis Cluster (contract section 7): every lane of every shard served, through a
master failover of a shard other than the model's first.

A private loopback cluster (``tools/localcluster.py``: 3 masters, 1 replica each) holds the
chaos model's 3 shards, one per master; requests go to lanes drawn from ``chaos.MIX`` (raw
version 2 XADDs, classes high and low, all three classes for two tenants) on every shard, and
the master of the second shard is SIGKILLed while they flow, its replica promoted. The oracle
requires every request answered exactly once, each reply naming its lane.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import chaos
import pytest

from tools.localcluster import LocalCluster

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(masters=3, replicas=1) as started:
        yield started


def test_lanes_of_a_failed_over_second_shard_answer_every_request_once(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    # Given three shards with lanes in use on each, and the second shard's master SIGKILLed
    # (lost for good) while paced requests flow to all and a tight loop sends to its lanes
    res = chaos.master_failover(
        tmp_path,
        requests=300,
        probe=1000,
        probe_s=1.0,
        duration_s=2.0,
        drain_s=20,
        lanes=True,
        victim_shard=1,
        cluster=cluster,
    )
    print(f"\n{res.name}: {res.notes}\n{res.lanes}")
    # Then every request of every lane was answered exactly once, its reply naming its lane
    assert res.passed, chaos.describe(res)
    assert len(res.lanes) == len(set(chaos.MIX)), res.lanes
    assert all(row["sent"] == row["answered"] > 0 for row in res.lanes.values()), res.lanes
    # And the lanes were registered on every shard, the failed-over one included
    sizes = res.notes["lane_set_sizes"]
    assert len(sizes) == 3
    assert all(n == len(set(chaos.MIX)) - 1 for n in sizes.values()), sizes
    assert res.notes["victim_shard"] != chaos.MODEL
    assert res.notes["acked_by_killed"] > 0, "the killed master acknowledged nothing"
