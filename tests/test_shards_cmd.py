"""``redbatch shards`` show, place and retire: on the module's single Redis, and on a real
3-master Redis Cluster started on loopback (skipped only where redis-server is missing)."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from producer.cli.main import main
from producer.ops import shards as shardops
from producer.ops.shards import DrainState, plan_placement, retire
from producer.ops.status import ShardAccess
from producer.protocol import keys
from producer.redisio import shards
from producer.redisio.topology import Node, tag_slot
from tools.localcluster import LocalCluster
from tools.localredis import RedisNotInstalled

MODEL = "demo"
P = keys.DEFAULT_PREFIX
SHARDS = keys.shards_key(P, MODEL)
RETIRING = keys.retiring_key(P, MODEL)
GROUP = keys.CONSUMER_GROUP


@pytest.fixture(autouse=True)
def _fast_retire(monkeypatch: pytest.MonkeyPatch) -> None:
    """No 5 s grace period: producers here are the test itself."""
    monkeypatch.setattr(shards, "REFRESH_S", 0.05)
    monkeypatch.setattr(shardops, "MARGIN_S", 0.0)
    monkeypatch.setattr(shardops, "POLL_S", 0.01)


def _run(url: str, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["--redis-url", url, "--retry-s", "0", "shards", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _json(url: str, capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out, err = _run(url, capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def _listed(conn: redis.Redis) -> list[str]:
    return [t.decode() for t in conn.lrange(SHARDS, 0, -1)]


def _retiring(conn: redis.Redis) -> set[str]:
    return {t.decode() for t in conn.smembers(RETIRING)}


# ---------------------------------------------------------------------------------------------
# One Redis


def test_show_of_a_model_with_one_shard(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(redis_url, capsys, "show", "--model", MODEL)
    assert doc["list"] is None
    assert doc["cluster"] is False
    assert doc["send"] == [MODEL]
    assert [s["tag"] for s in doc["shards"]] == [MODEL]

    code, out, _ = _run(redis_url, capsys, "show", "--model", MODEL)
    assert code == 0
    assert f"shard list {SHARDS}: absent (one shard, {MODEL})" in out
    assert "1 shard on one Redis" in out


def test_place_appends_is_idempotent_and_warns_on_one_redis(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # When the model gets three shards on a single Redis
    doc = _json(redis_url, capsys, "place", "--model", MODEL, "--count", "3")

    # Then the list is M first and two more, with a warning that only a cluster spreads them
    assert doc["added"] == ["demo~1", "demo~2"]
    assert _listed(rconn) == ["demo", "demo~1", "demo~2"]
    assert any("not a cluster" in note for note in doc["notes"])

    # Running it again changes nothing; a larger count appends; a smaller one removes nothing
    again = _json(redis_url, capsys, "place", "--model", MODEL, "--count", "3")
    assert again["changed"] is False
    assert _listed(rconn) == ["demo", "demo~1", "demo~2"]
    more = _json(redis_url, capsys, "place", "--model", MODEL, "--count", "5")
    assert more["added"] == ["demo~3", "demo~4"]
    assert _listed(rconn) == ["demo", "demo~1", "demo~2", "demo~3", "demo~4"]
    fewer = _json(redis_url, capsys, "place", "--model", MODEL, "--count", "2")
    assert fewer["changed"] is False
    assert any("only adds shards" in note for note in fewer["notes"])
    assert len(_listed(rconn)) == 5


def test_place_never_reuses_a_retiring_tag(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    rconn.sadd(RETIRING, "demo~1")  # still draining
    doc = _json(redis_url, capsys, "place", "--model", MODEL, "--count", "2")
    assert doc["added"] == ["demo~2"]
    assert _listed(rconn) == ["demo", "demo~2"]


def test_retire_without_wait_moves_the_shard_in_one_step(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    rconn.rpush(SHARDS, "demo", "demo~1", "demo~2")

    doc = _json(redis_url, capsys, "retire", "--model", MODEL, "--shard", "demo~1", "--no-wait")

    assert doc["moved"] is True
    assert doc["retired"] is False
    assert _listed(rconn) == ["demo", "demo~2"]
    assert _retiring(rconn) == {"demo~1"}
    view = _json(redis_url, capsys, "show", "--model", MODEL)
    assert view["send"] == ["demo", "demo~2"]
    assert view["retiring"] == ["demo~1"]


def test_retire_deletes_the_list_when_only_the_first_shard_is_left(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    rconn.rpush(SHARDS, "demo", "demo~1")

    doc = _json(redis_url, capsys, "retire", "--model", MODEL, "--shard", "demo~1")

    # Then the list is gone (absent: one shard), and the drained shard left the retiring set
    assert doc["list_deleted"] is True
    assert doc["retired"] is True
    assert rconn.exists(SHARDS) == 0
    assert _retiring(rconn) == set()


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        ("demo", "is the model's first shard and is never retired"),
        ("other~1", "belongs to model 'other', not 'demo'"),
        ("demo~9", "'demo~9' is not a shard of 'demo' (shards: demo, demo~1)"),
    ],
)
def test_retire_refuses_what_it_cannot_retire(
    redis_url: str,
    rconn: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    shard: str,
    message: str,
) -> None:
    rconn.rpush(SHARDS, "demo", "demo~1")
    code, out, err = _run(redis_url, capsys, "retire", "--model", MODEL, "--shard", shard)
    assert code == 2
    assert message in err
    assert out == ""  # nothing said to be retiring
    assert _listed(rconn) == ["demo", "demo~1"]
    assert _retiring(rconn) == set()


@pytest.mark.parametrize(
    "argv",
    [
        ["retire", "--model", MODEL, "--shard", "demo~UPPER"],
        ["show", "--model", "bad model"],
        ["place", "--model", MODEL, "--count", "0"],
    ],
)
def test_bad_arguments_are_usage_errors(
    redis_url: str, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, _, err = _run(redis_url, capsys, *argv)
    assert code == 2
    assert "error" in err


def test_an_unreachable_redis_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run("redis://127.0.0.1:1/0", capsys, "show", "--model", MODEL)
    assert code == 2
    assert "Could not talk to Redis at redis://127.0.0.1:1/0" in err


def test_retire_waits_until_the_shard_is_drained(rconn: redis.Redis) -> None:
    # Given a shard with two requests waiting
    rconn.rpush(SHARDS, "demo", "demo~1")
    stream = keys.request_stream(P, "demo~1")
    rconn.xgroup_create(stream, GROUP, id="0", mkstream=True)
    ids = [rconn.xadd(stream, {"rid": f"r{i}", "body": b""}) for i in range(2)]
    seen: list[DrainState] = []

    def worker_step(state: DrainState) -> None:
        """A worker acting between the command's looks: read, then ack and delete."""
        seen.append(state)
        assert _retiring(rconn) == {"demo~1"}  # never dropped while anything is left
        if len(seen) == 1:
            rconn.xreadgroup(GROUP, "w", {stream: ">"})
        elif state.pending and state.grace_left_s == 0:
            rconn.xack(stream, GROUP, *ids)
            rconn.xdel(stream, *ids)

    access = ShardAccess(rconn)
    done = retire(access, P, MODEL, "demo~1", progress=worker_step, poll_s=0.0)

    assert done.retired
    assert [(s.backlog, s.pending) for s in seen][-1] == (0, 0)
    assert any(s.backlog == 2 and s.pending == 2 for s in seen)
    assert _retiring(rconn) == set()
    assert rconn.exists(SHARDS) == 0


def test_retire_times_out_and_leaves_the_shard_retiring(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    rconn.rpush(SHARDS, "demo", "demo~1", "demo~2")
    rconn.xadd(keys.request_stream(P, "demo~1"), {"rid": "r", "body": b""})

    code, out, _ = _run(
        redis_url, capsys, "retire", "--model", MODEL, "--shard", "demo~1", "--timeout-s", "0.05"
    )

    assert code == 1
    assert "demo~1: backlog 1, pending 0" in out
    assert "stays in" in out
    assert _retiring(rconn) == {"demo~1"}
    # Run again, after the entry is gone: it resumes and finishes
    rconn.delete(keys.request_stream(P, "demo~1"))
    code, out, _ = _run(redis_url, capsys, "retire", "--model", MODEL, "--shard", "demo~1")
    assert code == 0
    assert "retired demo~1" in out
    assert _retiring(rconn) == set()
    assert _listed(rconn) == ["demo", "demo~2"]


def test_placement_spreads_round_robin_over_masters() -> None:
    # Three masters, each owning a third of the slots
    masters = [Node("h", 1), Node("h", 2), Node("h", 3)]

    def node_of(tag: str) -> Node:
        return masters[tag_slot(tag) * 3 // 16384]

    added = plan_placement(MODEL, [MODEL], 7, node_of, masters, set())

    per_master = [sum(node_of(t) == m for t in [MODEL, *added]) for m in masters]
    assert sorted(per_master) == [2, 2, 3]
    assert len(set(added)) == 6
    assert node_of(added[0]) != node_of(MODEL)
    assert node_of(added[1]) not in (node_of(MODEL), node_of(added[0]))


def test_an_uneven_spread_is_pointed_out() -> None:
    masters = ["a:1", "b:2", "c:3"]
    assert shardops.spread_notes({"demo": "a:1", "demo~1": "b:2"}, masters) == []
    (note,) = shardops.spread_notes({"demo": "a:1", "demo~1": "a:1"}, masters)
    assert "demo, demo~1 on a:1" in note
    assert shardops.spread_notes({"demo": None, "demo~1": None}, []) == []


# ---------------------------------------------------------------------------------------------
# A real cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    try:
        local = LocalCluster(masters=3, replicas=1)
    except RedisNotInstalled as exc:
        pytest.skip(f"no local Redis Cluster: {exc}")
    with local:
        yield local


@pytest.fixture
def cluster_url(cluster: LocalCluster) -> Iterator[str]:
    yield cluster.url
    for node in cluster.masters():
        node.client().flushall()


def _on(cluster: LocalCluster, tag: str) -> redis.Redis:
    """A plain client of the master that owns ``tag``'s slot now."""
    return cluster.node_for_slot(tag_slot(tag)).client()


def test_place_puts_three_shards_on_three_masters(
    cluster: LocalCluster, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _json(cluster_url, capsys, "place", "--model", MODEL, "--count", "3")

    tags = doc["after"]
    assert tags[0] == MODEL
    assert len(tags) == 3
    ports = {cluster.node_for_slot(tag_slot(t)).port for t in tags}
    assert len(ports) == 3  # what CLUSTER SLOTS says, asked independently
    assert {s["master"] for s in doc["shards"]} == {f"127.0.0.1:{p}" for p in ports}
    assert doc["notes"] == []
    assert [t.decode() for t in _on(cluster, MODEL).lrange(SHARDS, 0, -1)] == tags

    # Again: nothing changes; six: two per master, the first three kept in order
    assert _json(cluster_url, capsys, "place", "--model", MODEL, "--count", "3")["changed"] is False
    six = _json(cluster_url, capsys, "place", "--model", MODEL, "--count", "6")
    assert six["after"][:3] == tags
    per_port: dict[int, int] = {}
    for tag in six["after"]:
        port = cluster.node_for_slot(tag_slot(tag)).port
        per_port[port] = per_port.get(port, 0) + 1
    assert sorted(per_port.values()) == [2, 2, 2]

    code, out, _ = _run(cluster_url, capsys, "show", "--model", MODEL)
    assert code == 0
    assert "6 shards on a Redis Cluster of 3 masters" in out
    assert "MASTER" in out


def test_retire_on_a_cluster_waits_for_the_drain(
    cluster: LocalCluster, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    placed = _json(cluster_url, capsys, "place", "--model", MODEL, "--count", "3")
    tag = placed["added"][0]
    # Given requests in the shard's stream, on its own master
    node = _on(cluster, tag)
    stream = keys.request_stream(P, tag)
    node.xgroup_create(stream, GROUP, id="0", mkstream=True)
    ids = [node.xadd(stream, {"rid": f"r{i}", "body": b""}) for i in range(3)]
    states: queue.Queue[DrainState] = queue.Queue()
    result: list[Any] = []
    seed = redis.Redis.from_url(cluster_url)
    access = ShardAccess(seed)
    access.refresh()

    def run() -> None:
        result.append(retire(access, P, MODEL, tag, progress=states.put))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def next_state(want: Any) -> DrainState:
        while True:
            state = states.get(timeout=20)
            if want(state):
                return state

    try:
        # When the command has looked past its grace period: the shard is still retiring
        next_state(lambda s: s.grace_left_s == 0 and s.backlog == 3)
        assert tag in _retiring(_on(cluster, MODEL))
        assert tag not in [t.decode() for t in _on(cluster, MODEL).lrange(SHARDS, 0, -1)]
        # A worker reads them: still retiring while they are pending
        node.xreadgroup(GROUP, "w", {stream: ">"})
        next_state(lambda s: s.pending == 3)
        assert tag in _retiring(_on(cluster, MODEL))
        # It answers them (ack, then delete): the command finishes and drops the shard
        node.xack(stream, GROUP, *ids)
        node.xdel(stream, *ids)
        thread.join(timeout=20)
        assert not thread.is_alive()
    finally:
        access.close()
        seed.close()
    assert result[0].retired
    assert tag not in _retiring(_on(cluster, MODEL))


def test_status_and_replay_go_to_each_shards_master(
    cluster: LocalCluster, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    tags = _json(cluster_url, capsys, "place", "--model", MODEL, "--count", "3")["after"]
    # Given a request waiting on one shard and a dead letter on each of the others
    _on(cluster, tags[0]).xadd(keys.request_stream(P, tags[0]), {"rid": "r0", "body": b"b"})
    rids = {tag: f"dead-{i}" for i, tag in enumerate(tags)}
    for tag in tags[1:]:
        _on(cluster, tag).xadd(keys.dead_key(P, tag), {"rid": rids[tag], "body": b"b"})

    assert main(["--redis-url", cluster_url, "status", "--model", MODEL, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cluster"] is True
    assert [(s["tag"], s["requests"]["backlog"], s["dead"]["count"]) for s in report["shards"]] == [
        (tags[0], 1, 0),
        (tags[1], 0, 1),
        (tags[2], 0, 1),
    ]
    assert report["requests"]["backlog"] == 1
    assert report["dead"]["count"] == 2
    assert len({s["node"] for s in report["shards"]}) == 3
    watch_argv = ["--redis-url", cluster_url, "status", "--model", MODEL, "--watch"]
    assert main([*watch_argv, "--iterations", "1"]) == 0
    frame = capsys.readouterr().out
    assert "backlog 1 (waiting 1, held 0)" in frame
    assert "2 dead letters" in frame
    assert all(s["node"] in frame for s in report["shards"])  # the MASTER column

    argv = ["--redis-url", cluster_url, "replay", "--model", MODEL, "--from-dead", "--same-ids"]
    assert main([*argv, "--delete", "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert sorted((r["shard"], r["rid"]) for r in replayed["resent"]) == [
        (tag, rids[tag]) for tag in sorted(tags[1:])
    ]
    for tag in tags[1:]:  # each back on its own shard's stream, on its own master
        conn = _on(cluster, tag)
        assert conn.xlen(keys.dead_key(P, tag)) == 0
        ((_, fields),) = conn.xrange(keys.request_stream(P, tag))
        assert fields[b"rid"] == rids[tag].encode()
