"""``redbatch status`` with lanes (issue 28, contract section 7): backlog per lane, per class
and per tenant in the report, its JSON and the ``--watch`` view, the models overview counting
every lane into its model, and lane sets holding junk, too many lanes, or refused to the user.
The lanes are made here as a producer makes them (``MULTI; SADD P:{T}:lanes KEY; XADD KEY``),
with the group a worker creates, on the module's real redis-server."""

from __future__ import annotations

import io
import json
from argparse import Namespace
from typing import Any

import pytest
import redis

from producer.cli import status as status_command
from producer.cli.main import main
from producer.ops import watch
from producer.ops.lanes import MAX_LANES, pick_lanes
from producer.ops.watchstats import flow_per_s, take_snapshot
from producer.protocol import keys
from producer.protocol.lanes import Lane, lane_stream, lanes_key

P = keys.DEFAULT_PREFIX
GROUP = keys.CONSUMER_GROUP


def _lane(
    conn: redis.Redis,
    tag: str,
    cls: str = "normal",
    tenant: str | None = None,
    waiting: int = 0,
    held: int = 0,
) -> str:
    """A lane with ``waiting + held`` entries, ``held`` read by a worker; registered in the
    shard's lane set as a producer does (the default lane never is)."""
    key = lane_stream(P, tag, cls, tenant)
    if not conn.exists(key):
        conn.xgroup_create(key, GROUP, id="0", mkstream=True)
    for i in range(waiting + held):
        pipe = conn.pipeline(transaction=True)
        if key != keys.request_stream(P, tag):
            pipe.sadd(lanes_key(P, tag), key)
        pipe.xadd(key, {"rid": f"r{i}", "body": b"\x80"})
        pipe.execute()
    if held:
        conn.xreadgroup(GROUP, "w1", {key: ">"}, count=held)
    return key


def _run(url: str, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["--redis-url", url, "--retry-s", "0", "status", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out


def _json(url: str, capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out = _run(url, capsys, *argv, "--json")
    assert code == 0, out
    return json.loads(out)


def _demo(conn: redis.Redis) -> None:
    """demo: 3 normal (1 held), 2 high, 40 low (10 held), 7 low of tenant teamA, 1 high of
    teamB; and junk in the lane set: another shard's lane, a malformed name, the default
    stream spelt as a lane, bytes that are not UTF-8."""
    _lane(conn, "demo", waiting=2, held=1)
    _lane(conn, "demo", "high", waiting=2)
    _lane(conn, "demo", "low", waiting=30, held=10)
    _lane(conn, "demo", "low", "teamA", waiting=7)
    _lane(conn, "demo", "high", "teamB", waiting=1)
    conn.sadd(
        lanes_key(P, "demo"),
        lane_stream(P, "other", "high"),
        f"{P}:{{demo}}:requests:urgent",
        f"{P}:{{demo}}:requests:normal",
        b"\xff\xfe",
    )


# ---------------------------------------------------------------------------------------------
# One model


def test_status_json_has_every_lane_and_the_classes_and_tenants(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    _demo(rconn)
    doc = _json(redis_url, capsys, "--model", "demo")

    (shard,) = doc["shards"]
    lanes = {(ln["class"], ln["tenant"]): ln for ln in shard["lanes"]}
    # The default lane first, then high before normal before low, tenants after their class
    assert [ln["key"] for ln in shard["lanes"]] == [
        f"{P}:{{demo}}:requests",
        f"{P}:{{demo}}:requests:high",
        f"{P}:{{demo}}:requests:high:teamB",
        f"{P}:{{demo}}:requests:low",
        f"{P}:{{demo}}:requests:low:teamA",
    ]
    assert (lanes[("low", None)]["backlog"], lanes[("low", None)]["pending"]) == (40, 10)
    assert (lanes[("normal", None)]["backlog"], lanes[("normal", None)]["pending"]) == (3, 1)
    assert lanes[("low", "teamA")]["backlog"] == 7
    assert all(ln["oldest_entry_age_s"] >= 0 for ln in shard["lanes"])
    assert shard["lanes_ignored"] == 4  # the junk, and nothing of it among the lanes
    assert (shard["lanes_over_bound"], shard["lanes_refused"]) == (0, False)

    classes = doc["classes"]
    assert list(classes) == ["high", "normal", "low"]
    assert {c: (v["lanes"], v["backlog"], v["pending"]) for c, v in classes.items()} == {
        "high": (2, 3, 0),
        "normal": (1, 3, 1),
        "low": (2, 47, 10),
    }
    assert classes["low"]["oldest_entry_age_s"] is not None
    assert doc["tenants"] == [
        {"tenant": "teamB", "class": "high", "backlog": 1, "pending": 0}
        | {"oldest_entry_age_s": doc["tenants"][0]["oldest_entry_age_s"]},
        {"tenant": "teamA", "class": "low", "backlog": 7, "pending": 0}
        | {"oldest_entry_age_s": doc["tenants"][1]["oldest_entry_age_s"]},
    ]
    # requests stays the default lane's: what read it before reads the same
    assert (doc["requests"]["backlog"], doc["requests"]["key"]) == (3, f"{P}:{{demo}}:requests")


def test_status_text_shows_classes_and_a_lane_table_within_80_columns(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    _demo(rconn)
    code, out = _run(redis_url, capsys, "--model", "demo")
    assert code == 0, out
    lines = out.splitlines()
    assert [line for line in lines if len(line) > 80] == []
    (summary,) = [line for line in lines if line.startswith("Backlog by class:")]
    assert "high 3 (oldest " in summary
    assert "normal 3 (oldest " in summary
    assert "low 47 (oldest" in out  # the line may fold before it
    rows = {
        line.split()[0]: line.split()[1:3]
        for line in lines
        if line.startswith("  redbatch:{demo}:requests")
    }
    assert rows == {
        f"{P}:{{demo}}:requests": ["normal", "3"],
        f"{P}:{{demo}}:requests:high": ["high", "2"],
        f"{P}:{{demo}}:requests:high:teamB": ["high", "1"],
        f"{P}:{{demo}}:requests:low": ["low", "40"],
        f"{P}:{{demo}}:requests:low:teamA": ["low", "7"],
    }
    assert "4 members ignored" in out
    assert "urgent" not in out
    assert "{other}" not in out


def test_status_with_the_default_lane_only_has_a_class_line_and_no_lane_table(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    _lane(rconn, "demo", waiting=4)
    code, out = _run(redis_url, capsys, "--model", "demo")
    assert code == 0
    assert "Backlog by class: high 0, normal 4 (oldest " in out
    assert "Lanes" not in out
    assert "LANE" not in out
    doc = _json(redis_url, capsys, "--model", "demo")
    assert [ln["key"] for ln in doc["shards"][0]["lanes"]] == [f"{P}:{{demo}}:requests"]
    assert doc["tenants"] == []


def test_a_model_with_only_a_low_lane_is_known_and_reported(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # A batch job (redbatch run defaults to low) on a model no worker has served yet
    _lane(rconn, "batchonly", "low", waiting=5)
    code, out = _run(redis_url, capsys, "--model", "batchonly")
    assert code == 0, out
    assert "requests went to the other lanes below" in out
    assert "low 5 (oldest" in out


def test_sharded_model_sums_classes_and_tenants_over_its_shards(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    rconn.rpush(keys.shards_key(P, "m"), "m", "m~a")
    for tag, n in (("m", 2), ("m~a", 5)):
        _lane(rconn, tag, waiting=1)
        _lane(rconn, tag, "low", "teamA", waiting=n)
    doc = _json(redis_url, capsys, "--model", "m")
    assert doc["classes"]["low"]["backlog"] == 7
    assert doc["classes"]["low"]["lanes"] == 2
    assert [(t["tenant"], t["backlog"]) for t in doc["tenants"]] == [("teamA", 7)]
    code, out = _run(redis_url, capsys, "--model", "m")
    assert code == 0
    assert [line for line in out.splitlines() if len(line) > 80] == []
    (tenant_row,) = [line for line in out.splitlines() if line.startswith("  teamA")]
    assert tenant_row.split()[:3] == ["teamA", "low", "7"]


def test_lanes_past_the_bound_are_counted_not_read(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    for i in range(MAX_LANES + 6):
        rconn.sadd(lanes_key(P, "demo"), lane_stream(P, "demo", "low", f"t{i:03d}"))
    rconn.sadd(lanes_key(P, "demo"), lane_stream(P, "demo", "high"))
    _lane(rconn, "demo", waiting=1)
    doc = _json(redis_url, capsys, "--model", "demo")
    (shard,) = doc["shards"]
    assert len(shard["lanes"]) == MAX_LANES  # the default lane counts, as for workers
    assert shard["lanes"][1]["class"] == "high"  # high first, whatever the names
    assert shard["lanes_over_bound"] == 8
    assert all(not ln["exists"] for ln in shard["lanes"][1:])  # listed, never sent to


def test_pick_lanes_keeps_the_shards_lanes_by_class_and_skips_junk() -> None:
    members = [
        lane_stream(P, "t", "low", "b"),
        lane_stream(P, "t", "low"),
        lane_stream(P, "t", "high", "z"),
        lane_stream(P, "t"),  # the default lane: always read, never from the set
        lane_stream(P, "t~x", "high"),
        b"\xff",
        "junk",
    ]
    lanes, junk, over = pick_lanes(P, "t", members, limit=3)  # the default and two more
    assert lanes == [Lane("t", "high", "z"), Lane("t", "low")]
    assert (junk, over) == (3, 1)


def test_a_user_who_may_not_read_lane_sets_still_gets_the_report(
    redis_url: str, redis_server: Any, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # An operator role from before lanes: request streams and dead letters, no lane set
    _demo(rconn)
    rconn.execute_command(
        "ACL",
        "SETUSER",
        "oldop",
        "on",
        ">pw",
        "+@all",
        f"~{P}:{{*}}:requests",
        f"~{P}:{{*}}:dead",
        f"~{P}:{{*}}:shards",
        f"~{P}:{{*}}:retiring",
        f"~{P}:{{*}}:workers",
    )
    try:
        url = redis_server.url_for("oldop", "pw")
        doc = _json(url, capsys, "--model", "demo")
        (shard,) = doc["shards"]
        assert shard["lanes_refused"] is True
        assert len(shard["lanes"]) == 1
        code, out = _run(url, capsys, "--model", "demo")
        assert code == 0
        assert "lanes of demo unknown: this user may not read" in out
    finally:
        rconn.execute_command("ACL", "DELUSER", "oldop")


# ---------------------------------------------------------------------------------------------
# The models overview


def test_overview_counts_every_lane_into_its_model_and_lists_no_lane_as_a_model(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    _demo(rconn)
    _lane(rconn, "batchonly", "low", waiting=5)
    # A stream that only looks like a lane: not counted, not a model
    rconn.xadd(f"{P}:{{ghost}}:requests:urgent", {"rid": "x", "body": b""})
    code, out = _run(redis_url, capsys, "--json")
    assert code == 0
    rows = {row["model"]: row for row in json.loads(out)}
    assert set(rows) == {"demo", "batchonly"}
    demo = rows["demo"]
    assert (demo["backlog"], demo["pending"]) == (53, 11)
    assert demo["classes"] == {"high": 3, "normal": 3, "low": 47}
    assert rows["batchonly"]["classes"] == {"high": 0, "normal": 0, "low": 5}
    _, text = _run(redis_url, capsys)
    (row,) = [line for line in text.splitlines() if line.startswith("  demo ")]
    assert row.split()[1:4] == ["1", "53", "11"]


# ---------------------------------------------------------------------------------------------
# --watch


def test_watch_shows_the_whole_queue_by_class_and_its_flow_over_lanes(
    redis_url: str, rconn: redis.Redis
) -> None:
    _demo(rconn)
    clock = iter([100.0, 102.0])  # the snapshots' monotonic times: 2 s apart
    first = take_snapshot(rconn, "demo", P, clock=lambda: next(clock))
    _lane(rconn, "demo", "low", waiting=10)  # 10 more in an existing lane
    second = take_snapshot(rconn, "demo", P, clock=lambda: next(clock))
    flow = flow_per_s(first, second)
    assert flow is not None
    assert flow[0] == pytest.approx(5.0)  # 10 added over 2 s, counted in the low lane

    frame = watch.render(first, second, redis_url=redis_url)
    lines = frame.splitlines()
    assert [line for line in lines if len(line) > 80] == []
    assert "queue    backlog 63 (waiting 52, held 11)" in frame
    assert any(line.startswith("classes  high 3 (oldest ") for line in lines)
    assert "lanes    5 lanes" in frame
    assert "in 5/s" in frame


def test_watch_command_draws_lane_frames(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    _demo(rconn)
    args = Namespace(
        redis_url=redis_url,
        prefix=P,
        model="demo",
        json=False,
        watch=True,
        interval_s=0.05,
        iterations=2,
        metrics_url=[],
        retry_s=0.0,
    )
    out = io.StringIO()
    assert status_command.run_watch(args, out) == 0
    frames = out.getvalue()
    assert frames.count("classes  high 3") == 2
    assert [line for line in frames.splitlines() if len(line) > 80] == []
