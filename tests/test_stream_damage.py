"""A stream trimmed, deleted, exhausted or with its group destroyed under the workers: each is
logged once by the worker that sees it, counted, kept for its record and shown by ``redbatch
status``, and the repair docs/operations.md gives for an exhausted stream works (issue 26)."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from eventually import eventually
from harness import PREFIX, running_worker, write_config

from producer import Client
from producer.cli.main import main
from producer.ops.watch import render
from producer.ops.watchstats import take_snapshot
from producer.protocol import keys
from producer.protocol.errors import RedbatchError
from producer.redisio.streaminfo import MAX_ID
from worker.events import Events
from worker.ops.metrics import Metrics
from worker.redisio.group import StreamGroup

MODEL = "demo"
STREAM = keys.request_stream(PREFIX, MODEL)
DEAD = keys.dead_key(PREFIX, MODEL)
DOCS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"


class Recorder(Events):
    """The damage events a stream group reports."""

    def __init__(self) -> None:
        self.damaged: list[tuple[str, str, int]] = []

    def stream_damaged(self, shard: str, kind: str, lost: int) -> None:
        self.damaged.append((shard, kind, lost))


def _group(r: redis.Redis, events: Events) -> StreamGroup:
    group = StreamGroup(r, STREAM, DEAD, MODEL, events)
    group.ensure()
    return group


def _queue(r: redis.Redis, undelivered: int, held: int) -> list[bytes]:
    """``held`` entries read by a consumer and not acknowledged, then ``undelivered`` more."""
    for _ in range(held):
        r.xadd(STREAM, {"rid": "x", "body": b"x"})
    got = r.xreadgroup(keys.CONSUMER_GROUP, "w1", {STREAM: ">"}, count=held) if held else []
    for _ in range(undelivered):
        r.xadd(STREAM, {"rid": "x", "body": b"x"})
    return [entry_id for entry_id, _ in got[0][1]] if got else []


def _kinds(group: StreamGroup) -> list[str]:
    return [note["kind"] for note in group.damage]


def test_a_trim_of_undelivered_entries_is_reported_once_with_what_was_lost(
    rconn: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    events = Recorder()
    group = _group(rconn, events)
    _queue(rconn, undelivered=500, held=10)
    group.stats()
    assert group.damage == []
    rconn.execute_command("XADD", STREAM, "MAXLEN", "0", "*", "rid", "x", "body", "x")
    with caplog.at_level(logging.WARNING, logger="worker.redisio.group"):
        group.stats()
        group.stats()  # the same loss, sampled again: not a second incident
    assert _kinds(group) == ["trimmed"]
    assert group.damage[0]["lost"] >= 500
    assert group.damage[0]["stream"] == STREAM
    assert [(s, k) for s, k, _ in events.damaged] == [(MODEL, "trimmed")]
    assert events.damaged[0][2] >= 500
    line = " ".join(r.getMessage() for r in caplog.records)
    assert "trimmed" in line
    assert STREAM in line
    assert 'A damaged stream"' in line


def test_a_trim_is_not_told_again_as_held_entries_are_read_and_acknowledged(
    rconn: redis.Redis,
) -> None:
    # Given 10 held entries and 20 undelivered ones, trimmed up to the 3rd undelivered one
    events = Recorder()
    group = _group(rconn, events)
    held = _queue(rconn, undelivered=20, held=10)
    group.stats()
    first_kept = rconn.xrange(STREAM, count=14)[-1][0]
    rconn.execute_command("XTRIM", STREAM, "MINID", first_kept)
    group.stats()
    assert [k for _, k, _ in events.damaged] == ["trimmed"]
    # When workers go on reading and acknowledging (the count dips and comes back)
    for entry_id in held:
        rconn.xack(STREAM, keys.CONSUMER_GROUP, entry_id)
        rconn.xdel(STREAM, entry_id)
        group.stats()
    got = rconn.xreadgroup(keys.CONSUMER_GROUP, "w1", {STREAM: ">"}, count=5)
    for entry_id, _ in got[0][1]:
        group.stats()
        rconn.xack(STREAM, keys.CONSUMER_GROUP, entry_id)
        rconn.xdel(STREAM, entry_id)
        group.stats()
    # Then the one trim is told once
    assert [(k, lost) for _, k, lost in events.damaged] == [("trimmed", 3)]


def test_a_trim_is_counted_in_the_metrics(rconn: redis.Redis) -> None:
    metrics = Metrics()
    group = _group(rconn, metrics)
    _queue(rconn, undelivered=50, held=1)  # a group that has read knows its entries-read
    group.stats()
    rconn.xtrim(STREAM, maxlen=10, approximate=False)
    group.stats()
    lost = metrics.registry.get_sample_value("redbatch_requests_lost_total", {"shard": MODEL})
    seen = metrics.registry.get_sample_value(
        "redbatch_stream_damage_total", {"shard": MODEL, "kind": "trimmed"}
    )
    assert (lost, seen) == (40.0, 1.0)


def test_acknowledgements_out_of_order_are_no_damage(rconn: redis.Redis) -> None:
    """A null lag (one slow request pending, later ones acked and deleted) is normal."""
    group = _group(rconn, Recorder())
    held = _queue(rconn, undelivered=5, held=10)
    rconn.xack(STREAM, keys.CONSUMER_GROUP, *held[1:])
    rconn.xdel(STREAM, *held[1:])
    assert rconn.xinfo_groups(STREAM)[0]["lag"] is None
    group.stats()
    assert group.damage == []


def test_a_deleted_stream_is_reported_with_the_backlog_last_seen(rconn: redis.Redis) -> None:
    events = Recorder()
    group = _group(rconn, events)
    _queue(rconn, undelivered=30, held=5)
    group.stats()
    rconn.delete(STREAM)
    with pytest.raises(redis.ResponseError) as read:
        rconn.xreadgroup(keys.CONSUMER_GROUP, "w1", {STREAM: ">"})
    group.gone(read.value)
    assert _kinds(group) == ["deleted"]
    assert group.damage[0]["lost"] == 35
    assert "without persistence" in group.damage[0]["detail"]
    assert events.damaged == [(MODEL, "deleted", 35)]
    assert rconn.xinfo_groups(STREAM)[0]["name"] == keys.CONSUMER_GROUP.encode()


def test_a_destroyed_group_is_reported_as_recreated_and_entries_come_again(
    rconn: redis.Redis,
) -> None:
    events = Recorder()
    group = _group(rconn, events)
    held = _queue(rconn, undelivered=20, held=5)
    group.stats()
    rconn.xgroup_destroy(STREAM, keys.CONSUMER_GROUP)
    with pytest.raises(redis.ResponseError) as read:
        rconn.xreadgroup(keys.CONSUMER_GROUP, "w1", {STREAM: ">"})
    group.gone(read.value)
    assert _kinds(group) == ["group_recreated"]
    assert events.damaged[0][1:] == ("group_recreated", 0)
    again = rconn.xreadgroup(keys.CONSUMER_GROUP, "w2", {STREAM: ">"}, count=100)
    ids = [entry_id for entry_id, _ in again[0][1]]
    assert len(ids) == 25
    assert set(held) <= set(ids)
    group.stats()
    assert _kinds(group) == ["group_recreated"]


def test_an_exhausted_stream_is_reported_once(rconn: redis.Redis) -> None:
    events = Recorder()
    group = _group(rconn, events)
    group.stats()
    rconn.xadd(STREAM, {"rid": "x", "body": b"x"}, id=MAX_ID)
    group.stats()
    group.stats()
    assert _kinds(group) == ["exhausted"]
    assert events.damaged == [(MODEL, "exhausted", 0)]


def test_damage_notes_stay_bounded(rconn: redis.Redis) -> None:
    group = _group(rconn, Recorder())
    for _ in range(12):
        rconn.xgroup_destroy(STREAM, keys.CONSUMER_GROUP)
        group.gone(redis.ResponseError("NOGROUP No such key"))
    assert len(group.damage) == 10


# ---------------------------------------------------------------------------------------------
# redbatch status


def _status(redis_url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, Any]:
    code = main(["--redis-url", redis_url, "status", "--model", MODEL])
    text = " ".join(capsys.readouterr().out.split())  # folded to 80 columns: read as one text
    assert main(["--redis-url", redis_url, "status", "--model", MODEL, "--json"]) == code
    return code, text, json.loads(capsys.readouterr().out)


def test_status_shows_an_exhausted_stream_with_no_worker_and_exits_1(
    rconn: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rconn.xadd(STREAM, {"rid": "x", "body": b"x"}, id=MAX_ID)
    code, text, doc = _status(redis_url, capsys)
    assert code == 1
    assert re.search(rf"exhausted {re.escape(STREAM)} \(now\).*A damaged stream", text)
    assert [d["kind"] for d in doc["damage"]] == ["exhausted"]
    assert doc["damage"][0]["blocking"] is True


def test_watch_shows_the_damage_first(rconn: redis.Redis) -> None:
    rconn.xadd(STREAM, {"rid": "x", "body": b"x"}, id=MAX_ID)
    frame = render(None, take_snapshot(rconn, MODEL, PREFIX))
    damage = frame.index("Damage (see")
    assert "exhausted" in frame[damage:]
    assert damage < frame.index("queue")


def test_status_shows_a_trim_and_exits_0(
    rconn: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rconn.xgroup_create(STREAM, keys.CONSUMER_GROUP, "0", mkstream=True)
    _queue(rconn, undelivered=40, held=2)
    rconn.execute_command("XADD", STREAM, "MAXLEN", "0", "*", "rid", "x", "body", "x")
    code, text, doc = _status(redis_url, capsys)
    assert code == 0
    assert "undelivered entries were deleted (trimmed): at least 41" in text
    assert [(d["kind"], d["lost"]) for d in doc["damage"]] == [("trimmed", 41)]


@pytest.mark.parametrize("key", [STREAM, DEAD])
def test_status_shows_a_key_of_the_wrong_type_and_does_not_crash(
    rconn: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    rconn.set(key, "not a stream")
    code, text, doc = _status(redis_url, capsys)
    assert code == 1
    assert "holds a string, not a stream" in text
    assert [(d["kind"], d["stream"]) for d in doc["damage"]] == [("wrong_type", key)]


# ---------------------------------------------------------------------------------------------
# End to end: a worker sees it, status shows what it saw, the documented repair works


def _repair_script() -> str:
    """The shell block under "Repairing an exhausted stream" in docs/operations.md."""
    text = DOCS.read_text()
    section = text[text.index("### Repairing an exhausted stream") :]
    block = section[section.index("```sh\n") + 6 :]
    return block[: block.index("\n```")]


def _run_repair(redis_url: str) -> None:
    script = _repair_script()
    assert script.startswith("S='redbatch:{demo}:requests'")
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("redis-cli is not installed")
    shell = f'redis-cli() {{ "{cli}" -u "{redis_url}" "$@"; }}\nset -e\n{script}\n'
    done = subprocess.run(
        ["bash", "-c", shell], check=False, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr


def _submit(client: Client) -> Any:
    return client.submit({"features": np.zeros((1, 16), np.float32)})


def test_a_worker_reports_an_exhausted_stream_and_the_documented_repair_serves_again(
    tmp_path: Path,
    rconn: redis.Redis,
    redis_url: str,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = write_config(tmp_path, MODEL, redis_url)
    with (
        caplog.at_level(logging.WARNING, logger="worker.redisio.group"),
        running_worker(config, "w-damage"),
        Client(MODEL, redis_url) as client,
    ):
        assert client.wait(_submit(client), 20).ok
        rconn.xadd(STREAM, {"rid": "poison", "body": b"x"}, id=MAX_ID)
        with pytest.raises(RedbatchError):
            _submit(client)
        eventually(lambda: any("(exhausted)" in r.getMessage() for r in caplog.records))
        # the worker's record carries the note from its next heartbeat
        eventually(lambda: "seen by worker w-damage" in _status(redis_url, capsys)[1])
        code, _, doc = _status(redis_url, capsys)
        assert code == 1
        assert {(d["kind"], d["worker"]) for d in doc["damage"]} == {
            ("exhausted", None),
            ("exhausted", "w-damage"),
        }
        # the worker answers the poison entry (malformed) and so delivers the largest id
        eventually(lambda: rconn.xinfo_groups(STREAM)[0]["last-delivered-id"] == MAX_ID.encode())
        _run_repair(redis_url)
        assert client.wait(_submit(client), 20).ok
        assert client.wait(_submit(client), 20).ok
    code, _text, doc = _status(redis_url, capsys)
    assert code == 0
    assert not [d for d in doc["damage"] if d["worker"] is None]
