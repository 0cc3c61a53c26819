"""``redbatch status`` without ``--model``: every model a Redis holds, one line each, found with
SCAN on the module's single Redis and on every master of a real 3-master Redis Cluster."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis

from producer.cli.main import main
from producer.ops import models
from producer.protocol import codec, keys
from producer.redisio.topology import tag_slot
from tools.localcluster import LocalCluster
from tools.localredis import RedisNotInstalled

P = keys.DEFAULT_PREFIX
BODY = codec.encode_request({"x": np.ones((1, 2), np.float32)})
GROUP = keys.CONSUMER_GROUP


def _status(url: str, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["--redis-url", url, "--retry-s", "0", "status", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _overview(url: str, capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    code, out, err = _status(url, capsys, "--json", *argv)
    assert code == 0, err
    doc = json.loads(out)
    assert isinstance(doc, list)
    return doc


def _queue(conn: redis.Redis, tag: str, waiting: int, held: int = 0, prefix: str = P) -> None:
    """A request stream with its group, ``waiting + held`` entries, ``held`` read by a worker."""
    stream = keys.request_stream(prefix, tag)
    conn.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for i in range(waiting + held):
        conn.xadd(stream, {"rid": f"r{i}", "body": BODY})
    if held:
        conn.xreadgroup(GROUP, "w1", {stream: ">"}, count=held)


def _worker(conn: redis.Redis, model: str, name: str) -> None:
    conn.set(keys.worker_key(P, model, name), json.dumps({"name": name, "state": "ready"}), ex=15)
    conn.sadd(keys.workers_key(P, model), name)


def _by_model(doc: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {row["model"]: row for row in doc}


# ---------------------------------------------------------------------------------------------
# One Redis


def test_status_without_model_lists_every_model_with_its_queue(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given: demo with 3 waiting, 2 held by a worker, a dead letter and two live workers;
    # minilm with three shards (the last retiring) holding 1, 2 and 4; a model known only by
    # its worker's record (no request yet), one only by its dead letters, and keys that are not
    # a model's (replies, cancels, another prefix)
    _queue(rconn, "demo", waiting=3, held=2)
    rconn.xadd(keys.dead_key(P, "demo"), {"rid": "bad", "reason": "POISONED"})
    _worker(rconn, "demo", "gpu-0")
    _worker(rconn, "demo", "gpu-1")
    rconn.rpush(keys.shards_key(P, "minilm"), "minilm", "minilm~a")
    rconn.sadd(keys.retiring_key(P, "minilm"), "minilm~b")
    for tag, waiting in (("minilm", 1), ("minilm~a", 2), ("minilm~b", 4)):
        _queue(rconn, tag, waiting)
    _worker(rconn, "fresh", "cpu-0")
    rconn.xadd(keys.dead_key(P, "old.v1"), {"rid": "r9", "reason": "POISONED"})
    rconn.rpush(keys.reply_key(P, "replies-only", "r1"), b"x")
    rconn.set(keys.cancel_key(P, "cancels-only", "r1"), 1)
    _queue(rconn, "elsewhere", waiting=5, prefix="other")

    # When status runs without --model
    doc = _overview(redis_url, capsys)
    code, text, _ = _status(redis_url, capsys)

    # Then each model has its line, summed over its shards, and nothing else is a model
    rows = _by_model(doc)
    assert sorted(rows) == ["demo", "fresh", "minilm", "old.v1"]
    assert {k: rows["demo"][k] for k in ("shards", "backlog", "pending", "workers", "dead")} == {
        "shards": 1,
        "backlog": 5,
        "pending": 2,
        "workers": 2,
        "dead": 1,
    }
    assert rows["minilm"]["shards"] == 3
    assert rows["minilm"]["retiring"] == 1
    assert rows["minilm"]["backlog"] == 7
    assert rows["minilm"]["workers"] == 0
    assert (rows["fresh"]["backlog"], rows["fresh"]["workers"]) == (0, 1)
    assert rows["old.v1"]["dead"] == 1
    assert rows["demo"]["oldest_entry_age_s"] is not None
    assert not any(row["blocked"] for row in doc)
    # And the text says the same, a row per model in name order
    assert code == 0
    lines = text.splitlines()
    assert lines[0].startswith("4 models at redis://127.0.0.1:")
    assert lines[0].endswith(", prefix 'redbatch'")
    assert lines[1].split() == [
        "MODEL",
        "SHARDS",
        "BACKLOG",
        "PENDING",
        "WORKERS",
        "DEAD",
        "OLDEST",
    ]
    assert [line.split()[0] for line in lines[2:6]] == ["demo", "fresh", "minilm", "old.v1"]
    assert lines[2].split()[:6] == ["demo", "1", "5", "2", "2", "1"]
    assert lines[4].split()[:8] == ["minilm", "3", "(1", "retiring)", "7", "0", "0", "0"]
    assert lines[-1] == "redbatch status --model NAME shows one model in full"


def test_the_overview_reads_only_the_prefix_asked_for(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # A prefix with glob characters matches itself only, not what the glob would
    _queue(rconn, "a", waiting=1, prefix="team*1")
    _queue(rconn, "b", waiting=2, prefix="teamX1")

    rows = _by_model(_overview(redis_url, capsys, "--prefix", "team*1"))

    assert list(rows) == ["a"]
    assert rows["a"]["backlog"] == 1
    assert [r["model"] for r in _overview(redis_url, capsys, "--prefix", "teamX1")] == ["b"]


def test_an_empty_redis_says_where_it_looked(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _overview(redis_url, capsys) == []
    code, text, _ = _status(redis_url, capsys)
    assert code == 0
    assert text.startswith("no models at redis://127.0.0.1:")
    assert "under redbatch:{MODEL}:" in text
    assert "--prefix" in text


def test_a_blocked_stream_makes_the_overview_exit_1(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a live worker's model whose request key holds a string, not a stream
    _worker(rconn, "demo", "gpu-0")
    rconn.set(keys.request_stream(P, "demo"), "not a stream")
    _queue(rconn, "fine", waiting=1)

    code, text, _ = _status(redis_url, capsys)

    assert code == 1
    assert (
        "!! demo: wrong_type redbatch:{demo}:requests blocks the queue; redbatch status --model "
        "demo says how to repair it"
    ) in text
    doc = _by_model(json.loads(_status(redis_url, capsys, "--json")[1]))
    assert doc["demo"]["blocked"] is True
    assert doc["fine"]["blocked"] is False


def test_a_scan_cut_short_says_the_list_may_be_incomplete(
    redis_url: str,
    rconn: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given many keys, and a bound of one SCAN call of 10 keys per pattern
    monkeypatch.setattr(models, "SCAN_COUNT", 10)
    monkeypatch.setattr(models, "MAX_SCAN_CALLS", 1)
    for i in range(300):
        rconn.set(f"{P}:{{m{i}}}:cancel:r", 1)
    _queue(rconn, "demo", waiting=1)

    code, text, _ = _status(redis_url, capsys)
    json_code, _, err = _status(redis_url, capsys, "--json")

    assert code == json_code == 0
    assert "!! the list may be incomplete: a scan stopped after 10 keys of a node" in text
    assert "the list may be incomplete" in err


def test_without_scan_permission_it_names_the_permission_and_model(
    redis_server: Any, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given an operator whose ACL lacks SCAN
    rconn.execute_command("ACL", "SETUSER", "noscan", "on", ">pw", "~*", "&*", "+@all", "-scan")
    url = redis_server.url_for("noscan", "pw")
    _queue(rconn, "demo", waiting=1)
    try:
        code, out, err = _status(url, capsys)
        by_model = _status(url, capsys, "--model", "demo")[0]
        unknown_code, unknown_out, _ = _status(url, capsys, "--model", "nosuch")
    finally:
        rconn.execute_command("ACL", "DELUSER", "noscan")
        rconn.flushall()

    # Then the list is refused in one line, and --model still works
    assert code == 2
    assert out == ""
    assert err.startswith("redbatch: error: Listing the models needs SCAN, which this Redis user")
    assert "grant it +scan (docs/security.md), or name the model with --model NAME." in err
    assert err.count("\n") == 1
    assert by_model == 0
    # and an unknown model is said to be so, without the list this user may not make
    assert unknown_code == 1
    assert unknown_out.startswith("model 'nosuch' not found under prefix 'redbatch'")
    assert "models here" not in unknown_out


def test_an_unknown_model_says_so_lists_the_models_and_exits_1(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given two models, and a name that is neither (a typo)
    _queue(rconn, "demo", waiting=1)
    _worker(rconn, "minilm", "cpu-0")

    code, out, err = _status(redis_url, capsys, "--model", "dmeo")
    json_code, json_out, json_err = _status(redis_url, capsys, "--model", "dmeo", "--json")

    # Then it says nothing here has that name, lists those that do, and exits 1
    assert code == json_code == 1
    assert out.splitlines() == [
        f"model 'dmeo' not found under prefix 'redbatch' at {redis_url}",
        "  no requests stream, shard list, dead letter or live worker has its name",
        "  models here: 'demo', 'minilm'",
        "  did you mean 'demo'?",
        "  check --model and --prefix; redbatch status without --model lists each model",
    ]
    assert err == ""
    # --json prints the report it always printed, and says so on stderr
    doc = json.loads(json_out)
    assert doc["requests"]["exists"] is False
    assert doc["workers"] == []
    assert json_err.startswith("redbatch: model 'dmeo' not found under prefix 'redbatch'")
    assert "models here: 'demo', 'minilm'" in json_err


def test_a_model_known_by_a_worker_or_dead_letters_is_no_unknown_model(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a model with a live worker but no request yet, and one with only dead letters
    _worker(rconn, "minilm", "cpu-0")
    rconn.xadd(keys.dead_key(P, "orientation"), {"rid": "r1", "body": BODY, "reason": "POISONED"})

    worker_code, worker_out, _ = _status(redis_url, capsys, "--model", "minilm")
    dead_code, dead_out, _ = _status(redis_url, capsys, "--model", "orientation")

    # Then each gets its full report with exit status 0
    assert worker_code == dead_code == 0
    assert "no requests stream yet" in worker_out
    assert "Workers: 1 live" in worker_out
    assert "Dead letters redbatch:{orientation}:dead: 1" in dead_out
    assert "not found" not in worker_out + dead_out


def test_watch_without_model_says_to_name_one(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _status(redis_url, capsys, "--watch", "--iterations", "1")
    assert code == 2
    assert "--watch shows one model live: name it with --model NAME" in err


# ---------------------------------------------------------------------------------------------
# Redis Cluster: every master is scanned


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    try:
        local = LocalCluster(masters=3, replicas=0)
    except RedisNotInstalled as exc:
        pytest.skip(f"no local Redis Cluster: {exc}")
    with local:
        yield local


def test_the_overview_scans_every_master_of_a_cluster(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given models whose keys live on each of the three masters, one with a shard on each
    assert (
        main(["--redis-url", cluster.url, "shards", "place", "--model", "big", "--count", "3"]) == 0
    )
    placed = [t.decode() for t in _on(cluster, "big").lrange(keys.shards_key(P, "big"), 0, -1)]
    for i, tag in enumerate(placed):
        _queue(_on(cluster, tag), tag, waiting=i + 1)
    spread = [f"m{i}" for i in range(40)]
    for model in spread:
        _queue(_on(cluster, model), model, waiting=1)
    masters = {cluster.node_for_slot(tag_slot(model)).port for model in spread}
    assert len(masters) == 3
    capsys.readouterr()

    rows = _by_model(_overview(cluster.url, capsys))

    assert sorted(rows) == sorted(["big", *spread])
    assert (rows["big"]["shards"], rows["big"]["backlog"]) == (3, 6)
    assert all(rows[m]["backlog"] == 1 for m in spread)


def _on(cluster: LocalCluster, tag: str) -> redis.Redis:
    return cluster.node_for_slot(tag_slot(tag)).client()
