"""Hostile producers and a refusing Redis on a real six-node Redis Cluster (3 masters + 3 replicas).

The hardening scenarios of tests/test_hardening_*.py and tests/test_stream_damage.py, where they
touch a shard: a model with three shards on three masters, and the damage done on a shard other
than the model's first, so that each fix is seen to follow the shard's own node and keys.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import chaos
import numpy as np
import pytest
import redis
from eventually import eventually
from harness import PREFIX, running_worker, write_config
from test_hardening_replies import WIDTH
from test_hardening_replies import _config as tile_config

from producer.client.blocking import Client
from producer.protocol.codec import decode_reply, encode_request
from producer.protocol.errors import TooLarge
from producer.protocol.keys import CONSUMER_GROUP, dead_key, reply_key, request_stream
from producer.redisio.topology import Topology, tag_slot
from tools.localcluster import LocalCluster
from worker.events import Events
from worker.redisio.group import StreamGroup

MODEL = "tiny"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(masters=3, replicas=1) as started:
        yield started


@pytest.fixture
def topology(cluster: LocalCluster) -> Iterator[Topology]:
    """A fresh cluster, seen from a master other than the model's first shard's."""
    chaos.flush_cluster(cluster)
    home = cluster.node_for_slot(tag_slot(MODEL))
    seed = next(node for node in cluster.masters() if node is not home)
    found = Topology(redis.Redis.from_url(seed.url, socket_timeout=30))
    found.refresh()
    yield found
    found.close()


def _shards(cluster: LocalCluster, topology: Topology) -> list[str]:
    tags = chaos.place_shards(cluster, topology.client(MODEL), MODEL, 3, PREFIX)
    assert len({cluster.node_for_slot(tag_slot(tag)).port for tag in tags}) == 3
    return tags


def _body(rows: int = 1) -> bytes:
    return encode_request({"x": np.ones((rows, 128), dtype=np.float32)})


def _reply(topology: Topology, tag: str, rid: str) -> Any:
    key = reply_key(PREFIX, tag, rid)
    eventually(lambda: topology.client(tag).exists(key), what=f"a reply to {rid}")
    return decode_reply(topology.client(tag).lindex(key, 0))  # type: ignore[arg-type]


class Damage(Events):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int]] = []

    def stream_damaged(self, shard: str, kind: str, lost: int) -> None:
        self.seen.append((shard, kind, lost))


def test_hostile_entries_on_a_second_shard_fail_alone(
    cluster: LocalCluster, topology: Topology, tmp_path: Path
) -> None:
    # Given three shards, and on the second one a reply key someone set to a string
    tags = _shards(cluster, topology)
    victim = tags[1]
    shard = topology.client(victim)
    shard.set(reply_key(PREFIX, victim, "wrongtype"), "someone else's")
    config = write_config(tmp_path, MODEL, cluster.url, batching="max_batch_size = 8")
    with running_worker(config, name="hostile"):
        # When that shard gets the request whose reply key is taken, one with an extra field
        # and honest ones, in one transaction (one read), and each other shard an honest one
        pipe = shard.pipeline(transaction=True)
        stream = request_stream(PREFIX, victim)
        pipe.xadd(stream, {"rid": "wrongtype", "body": _body()})
        pipe.xadd(stream, {"rid": "extra", "body": _body(), "tenant": "x" * 1000})
        for i in range(3):
            pipe.xadd(stream, {"rid": f"honest{i}", "body": _body()})
        pipe.execute()
        for tag in (tags[0], tags[2]):
            other = {"rid": "other", "body": _body()}
            topology.client(tag).xadd(request_stream(PREFIX, tag), other)

        # Then the honest ones are answered, the extra field is MALFORMED, and the request
        # whose reply key is taken is dead-lettered on its own shard with the reason
        for i in range(3):
            assert _reply(topology, victim, f"honest{i}").ok
        for tag in (tags[0], tags[2]):
            assert _reply(topology, tag, "other").ok
        extra = _reply(topology, victim, "extra")
        assert extra.error.code == "MALFORMED"
        assert "tenant" in extra.error.message
        eventually(lambda: shard.xlen(dead_key(PREFIX, victim)), what="the dead letter")
        [(_, dead)] = shard.xrange(dead_key(PREFIX, victim))
        assert dead[b"rid"] == b"wrongtype"
        assert b"holds a string, not a list" in dead[b"reason"]
        assert shard.get(reply_key(PREFIX, victim, "wrongtype")) == b"someone else's"
        eventually(lambda: shard.xlen(stream) == 0)


def test_a_trim_on_a_second_shard_is_reported_for_that_shard(
    cluster: LocalCluster, topology: Topology
) -> None:
    # Given the second shard's stream with its group and 50 entries no worker has read
    tags = _shards(cluster, topology)
    victim = tags[1]
    shard = topology.client(victim)
    stream = request_stream(PREFIX, victim)
    shard.xgroup_create(stream, CONSUMER_GROUP, "0", mkstream=True)
    shard.xadd(stream, {"rid": "seen", "body": b"x"})
    shard.xreadgroup(CONSUMER_GROUP, "c", {stream: ">"}, count=1)
    for i in range(50):
        shard.xadd(stream, {"rid": f"r{i}", "body": b"x"})
    events = Damage()
    group = StreamGroup(shard, stream, dead_key(PREFIX, victim), victim, events)
    group.stats()  # the sample before the damage
    # When a producer trims it to nothing with XADD MAXLEN 0
    shard.execute_command("XADD", stream, "MAXLEN", "0", "*", "rid", "x", "body", "x")
    group.stats()
    # Then the damage is told once, for that shard, with what was lost
    assert [(s, k) for s, k, _ in events.seen] == [(victim, "trimmed")]
    assert events.seen[0][2] >= 50
    assert group.damage[-1]["stream"] == stream


def test_an_oversized_body_is_refused_before_sending_on_a_cluster(
    cluster: LocalCluster, topology: Topology, tmp_path: Path
) -> None:
    # Given every master refusing bulk strings over 1 MiB and a worker serving the model
    _shards(cluster, topology)
    for node in cluster.masters():
        node.client().config_set("proto-max-bulk-len", 1024 * 1024)
    try:
        config = write_config(tmp_path, MODEL, cluster.url, batching="max_batch_size = 4096")
        with running_worker(config, name="bulk"), Client(MODEL, cluster.url) as client:
            # When a caller submits a body over that limit
            big = {"x": np.ones((4096, 128), dtype=np.float32)}  # 2 MiB of data
            started = time.monotonic()
            with pytest.raises(TooLarge, match="proto-max-bulk-len"):
                client.submit(big)
            # Then it is refused at once, and the client still serves honest calls
            assert time.monotonic() - started < 2.0
            out = client.infer({"x": np.ones((2, 128), dtype=np.float32)}, timeout_s=30)
            assert next(iter(out.values())).shape[0] == 2
    finally:
        for node in cluster.masters():
            node.client().config_set("proto-max-bulk-len", 512 * 1024 * 1024)


def test_a_reply_over_a_shards_bulk_limit_is_too_large_there_alone(
    cluster: LocalCluster, topology: Topology, tmp_path: Path
) -> None:
    # Given every master refusing bulk strings over 1 MiB, a model whose reply grows with its
    # rows (tests/test_hardening_replies.py), three shards, and on the second one a request
    # whose reply would be 1.3 MiB queued with two small ones
    model = "demo"
    tags = chaos.place_shards(cluster, topology.client(model), model, 3, PREFIX)
    victim = tags[1]
    shard = topology.client(victim)
    stream = request_stream(PREFIX, victim)
    rows = {"big": 5, "small-0": 1, "small-1": 1}
    for rid, n in rows.items():
        shard.xadd(stream, {"rid": rid, "body": encode_request({"x": np.ones((n, WIDTH), "f4")})})
    for node in cluster.masters():
        node.client().config_set("proto-max-bulk-len", 1024 * 1024)
    try:
        config = tile_config(tmp_path, cluster.url)
        with running_worker(config, name="bulk"):
            # Then the big one is TOO_LARGE, naming the shard's limit, and the others served
            big = _reply(topology, victim, "big")
            assert big.error.code == "TOO_LARGE"
            assert "(Redis proto-max-bulk-len)" in big.error.message
            for rid in ("small-0", "small-1"):
                assert _reply(topology, victim, rid).ok
            eventually(lambda: shard.xlen(stream) == 0, what="the shard's stream drained")
    finally:
        for node in cluster.masters():
            node.client().config_set("proto-max-bulk-len", 512 * 1024 * 1024)
