"""tools/localcluster.py: the throwaway Redis Cluster that the cluster tests and benchmarks use.

One real cluster (3 masters, 3 replicas, node timeout 2 s) serves the whole module; every test
leaves it ok, with three masters and three replicas, whatever order the tests run in.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import MovedError

from tools.localcluster import BUS_OFFSET, SLOTS, LocalCluster, cluster_ports, main


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"a local Redis Cluster needs {' and '.join(missing)} on PATH")
    with LocalCluster(masters=3, replicas=1) as local:
        yield local


def _tag_in(slot: int) -> str:
    """A hash tag whose keys all live in ``slot``."""
    return next(f"t{i}" for i in range(1_000_000) if key_slot(f"t{i}".encode()) == slot)


def _replica_of(cluster: LocalCluster, master_port: int) -> list[int]:
    return [
        node.port
        for node in cluster.replicas()
        if node.client().info("replication")["master_port"] == master_port
    ]


def test_ports_leave_room_for_the_bus_port() -> None:
    ports = cluster_ports(6)
    assert len(set(ports)) == 6
    assert all(p + BUS_OFFSET < 65536 for p in ports)
    assert not set(ports) & {p + BUS_OFFSET for p in ports}


def test_starts_three_masters_each_with_a_replica(cluster: LocalCluster) -> None:
    masters, replicas = cluster.masters(), cluster.replicas()
    assert len(masters) == 3
    assert len(replicas) == 3
    for master in masters:
        assert len(_replica_of(cluster, master.port)) == 1
    assert {n.url for n in cluster.nodes} == {
        f"redis://127.0.0.1:{n.port}/0" for n in cluster.nodes
    }
    assert cluster.url in {n.url for n in cluster.nodes}
    assert len({n.node_id for n in cluster.nodes}) == 6
    assert set(cluster.redis_cpu_seconds()) == {n.port for n in cluster.nodes}


def test_every_slot_is_served_and_a_cluster_client_reaches_them(cluster: LocalCluster) -> None:
    for node in cluster.nodes:
        info = node.client().execute_command("CLUSTER INFO")
        assert info["cluster_state"] == "ok"
        assert int(info["cluster_slots_assigned"]) == SLOTS
    owners = {cluster.node_for_slot(s).port for s in (0, SLOTS // 2, SLOTS - 1)}
    assert owners <= {m.port for m in cluster.masters()}

    client = RedisCluster.from_url(cluster.url)
    try:
        keys = [f"key-{i}" for i in range(60)]  # slots on every master
        for key in keys:
            client.set(key, key)
        assert [client.get(k) for k in keys] == [k.encode() for k in keys]
        assert len({cluster.node_for_slot(key_slot(k.encode())).port for k in keys}) == 3
        client.delete(*keys)
    finally:
        client.close()


def test_migrate_slot_moves_the_keys_while_traffic_continues(cluster: LocalCluster) -> None:
    slot = 1234
    tag = _tag_in(slot)
    source = cluster.node_for_slot(slot)
    dest = next(m for m in cluster.masters() if m is not source)
    keys = [f"{{{tag}}}:{i}" for i in range(250)]
    source.client().mset({k: k for k in keys})

    client = RedisCluster.from_url(cluster.url)
    seen: list[object] = []
    try:
        # Between batches the slot is half moved: a cluster client still reads every key
        # (ASK redirects) and writes a new one.
        def step() -> None:
            seen.append(client.get(keys[0]))
            client.set(f"{{{tag}}}:during-{len(seen)}", "x")

        moved = cluster.migrate_slot(slot, dest, batch=100, on_step=step)
    finally:
        client.close()

    assert moved == 250
    assert seen == [keys[0].encode()] * 3  # one step per batch of 100
    assert cluster.node_for_slot(slot) is dest
    cluster.wait_ok(30)
    plain = redis.Redis.from_url(dest.url)
    try:
        assert plain.get(keys[-1]) == keys[-1].encode()
        assert plain.execute_command("CLUSTER COUNTKEYSINSLOT", slot) == 250 + len(seen)
        plain.delete(*keys)
    finally:
        plain.close()
    with pytest.raises(MovedError) as redirect:
        source.client().get(keys[0])
    assert (redirect.value.slot_id, redirect.value.port) == (slot, dest.port)
    assert cluster.migrate_slot(slot, dest) == 0  # already there


def test_killing_a_master_promotes_its_replica(cluster: LocalCluster) -> None:
    victim = cluster.node_for_slot(0)
    (heir_port,) = _replica_of(cluster, victim.port)
    key = f"{{{_tag_in(0)}}}:survivor"
    victim.client().set(key, "kept")
    victim.client().execute_command("WAIT", 1, 5000)  # on the replica before the kill

    cluster.kill(victim)
    assert not victim.alive
    # Nothing can be promoted before the node timeout (2 s) passes: wait_ok says why it waits.
    with pytest.raises(TimeoutError, match=rf"dead nodes \[{victim.port}\][\s\S]*node logs"):
        cluster.wait_ok(0.2)
    cluster.wait_ok(30)

    heir = cluster.node_for_slot(0)
    assert heir.port == heir_port
    assert heir.role() == "master"
    assert heir.client().get(key) == b"kept"
    assert len(cluster.masters()) == 3

    cluster.restart(victim)  # back as the replica of the node that replaced it
    cluster.wait_ok(30, replicas_up=True)
    assert victim.role() == "slave"
    assert _replica_of(cluster, heir.port) == [victim.port]
    heir.client().delete(key)


def test_cli_help_names_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for option in ("--masters", "--replicas", "--base-port"):
        assert option in out
