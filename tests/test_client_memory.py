"""Producers on a full Redis: refused early and clearly (RedisFull), or waiting for room.

The client tests run against both clients (``shell``: see ``tests/shells.py``). Redis runs with
``maxmemory-policy noeviction``; each test sets ``maxmemory`` relative to what Redis uses at
that moment, so "full" means the same whatever the server holds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import redis
from harness import running_worker, write_config

from producer import ConnectionFailed, RedisFull
from producer.cli.main import main as redbatch
from producer.protocol import keys
from producer.redisio import memory

if TYPE_CHECKING:
    from shells import Shell

pytest_plugins = ["shells"]

X = {"features": np.zeros((1, 16), np.float32)}
STREAM = "redbatch:{demo}:requests"


@pytest.fixture
def full(rconn: redis.Redis) -> Iterator[redis.Redis]:
    """A Redis whose used_memory is 90% of its maxmemory: past the default watermark (80%)."""
    rconn.config_set("maxmemory-policy", "noeviction")
    used = int(rconn.info("memory")["used_memory"])
    rconn.config_set("maxmemory", int(used / 0.9))
    yield rconn
    rconn.config_set("maxmemory", 0)


def _infos(rconn: redis.Redis) -> int:
    """How many INFO commands the server has run."""
    return int(rconn.info("commandstats").get("cmdstat_info", {}).get("calls", 0))


def test_submit_and_infer_are_refused_at_once_above_the_watermark_and_send_nothing(
    shell: Shell, full: redis.Redis, redis_url: str
) -> None:
    with shell.Client("demo", redis_url) as client:
        with pytest.raises(RedisFull) as refused:
            client.submit(X)
        with pytest.raises(RedisFull) as inferred:
            client.infer(X, timeout_s=5)
    message = str(refused.value)
    assert "is full" in message
    assert "of maxmemory" in message
    assert "high watermark of 80%" in message
    assert "wait_for_backlog=True" in message
    assert not isinstance(refused.value, ConnectionFailed)  # not an outage to retry through
    assert "high watermark of 80%" in str(inferred.value)
    assert full.xlen(STREAM) == 0


def test_a_lower_watermark_refuses_sooner_and_none_turns_it_off(
    shell: Shell, rconn: redis.Redis, redis_url: str
) -> None:
    # Given a Redis at 60% of its maxmemory
    rconn.config_set("maxmemory-policy", "noeviction")
    used = int(rconn.info("memory")["used_memory"])
    rconn.config_set("maxmemory", int(used / 0.6))
    try:
        with (
            shell.Client("demo", redis_url) as default,
            shell.Client("demo", redis_url, memory_high_watermark=0.5) as strict,
            shell.Client("demo", redis_url, memory_high_watermark=None) as off,
        ):
            default.submit(X)
            off.submit(X)
            with pytest.raises(RedisFull, match="high watermark of 50%"):
                strict.submit(X)
    finally:
        rconn.config_set("maxmemory", 0)
    assert rconn.xlen(STREAM) == 2


@pytest.mark.parametrize("watermark", [0, 1.5, -0.1, float("nan"), "0.8", True])
def test_a_bad_watermark_is_a_value_error_naming_it(shell: Shell, watermark: object) -> None:
    with pytest.raises(ValueError, match="memory_high_watermark"):
        shell.Client("demo", memory_high_watermark=watermark)


def test_redis_refusing_a_write_for_memory_is_redis_full_not_retried(
    shell: Shell, rconn: redis.Redis, redis_url: str
) -> None:
    # Given a client without a watermark, on a Redis that refuses writes (OOM)
    rconn.config_set("maxmemory-policy", "noeviction")
    rconn.config_set("maxmemory", 1)
    try:
        with shell.Client("demo", redis_url, memory_high_watermark=None) as client:
            # When it submits, Redis's refusal is the same specific error, not a 30 s retry
            # ending in RedisUnavailable
            with pytest.raises(RedisFull, match=r"is full \(maxmemory\): it refused the write"):
                client.submit(X)
            with pytest.raises(RedisFull, match="Nothing was written"):
                client.submit_many([X, X])  # a transaction discarded for OOM
            with pytest.raises(RedisFull):
                client.cancel("r1")
    finally:
        rconn.config_set("maxmemory", 0)
    assert rconn.xlen(STREAM) == 0


def test_memory_is_read_once_per_interval_not_per_submit(
    shell: Shell, rconn: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "MAX_AGE_S", 3600.0)
    before = _infos(rconn)
    with shell.Client("demo", redis_url) as client:
        for _ in range(200):
            client.submit(X)
    assert rconn.xlen(STREAM) == 200
    assert _infos(rconn) - before == 2  # the client's one, and this test's INFO commandstats


def test_a_reading_goes_stale_with_time_or_once_a_quarter_of_the_room_is_sent() -> None:
    watch = memory.MemoryWatch("r", 0.8)
    assert watch.stale(0.0)
    watch.seen(memory.MemoryReading(used_bytes=600, max_bytes=1000, policy="noeviction"), 10.0)
    assert not watch.stale(10.5)
    assert watch.stale(10.0 + memory.MAX_AGE_S)
    watch.sent(49)  # the room below the watermark is 200 bytes
    assert not watch.stale(10.5)
    watch.sent(1)
    assert watch.stale(10.5)
    watch.seen(memory.MemoryReading(800, 1000, "noeviction"), 11.0)
    assert watch.full() is not None
    assert watch.stale(11.0)  # a refusal reads again before the next try
    watch.seen(memory.MemoryReading(900, 1000, "allkeys-lru"), 12.0)
    assert watch.full() is None  # Redis evicts rather than refuses: nothing to stop for


def test_of_several_shards_readings_the_one_with_least_room_counts() -> None:
    # On a cluster each shard's master has its own memory: a submit may go to any of them
    watch = memory.MemoryWatch("r", 0.8)
    roomy = memory.MemoryReading(100, 10_000, "noeviction")  # 7,900 bytes below the watermark
    tight = memory.MemoryReading(700, 1_000, "noeviction")  # 100 bytes
    unlimited = memory.MemoryReading(5_000, 0, "noeviction")
    assert watch.tightest([roomy, tight, unlimited]) is tight
    assert watch.tightest([unlimited, roomy]) is roomy
    watch.seen(watch.tightest([roomy, memory.MemoryReading(900, 1_000, "noeviction")]), 1.0)
    assert watch.full() is not None


def test_memory_is_read_from_every_shard_a_client_sends_to(
    shell: Shell, redis_url: str, rconn: redis.Redis
) -> None:
    # Given a model with three shards (all on this one Redis)
    rconn.rpush(keys.shards_key(keys.DEFAULT_PREFIX, "demo"), "demo", "demo~b", "demo~c")
    before = _infos(rconn)
    # When a client submits
    with shell.Client("demo", redis_url) as client:
        client.submit(X)
    # Then it read memory once per shard (on a cluster: each shard's master)
    assert _infos(rconn) - before == 3 + 1  # and this test's INFO commandstats


def test_submit_with_wait_for_backlog_waits_for_room_then_sends(
    shell: Shell, full: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a full Redis, and workers that free memory while the submit waits (here: maxmemory
    # raised at the client's second sleep)
    sleeps: list[float] = []

    def room_appears(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            full.config_set("maxmemory", 0)

    shell.patch_sleep(monkeypatch, room_appears)
    with shell.Client("demo", redis_url, wait_for_backlog=True) as client:
        rid = client.submit(X)
    # Then it waited, looked again, and sent the request once there was room
    assert len(sleeps) == 2
    [(_, fields)] = full.xrange(STREAM)
    assert fields[b"rid"] == rid.encode()


def test_infer_waiting_for_room_ends_within_its_timeout_with_nothing_sent(
    shell: Shell, full: redis.Redis, redis_url: str
) -> None:
    waited = pytest.raises(RedisFull, match="ran out while it waited for room")
    with shell.Client("demo", redis_url, wait_for_backlog=True) as client, waited as refused:
        client.infer(X, timeout_s=0.3)
    assert "nothing was sent" in str(refused.value)
    assert full.xlen(STREAM) == 0


def test_map_stops_sending_when_redis_fills_and_answers_what_it_sent(
    shell: Shell,
    tmp_path: Path,
    rconn: redis.Redis,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a worker, and a client that reads memory before every send
    monkeypatch.setattr(memory, "MAX_AGE_S", 0.0)
    config = write_config(tmp_path, "demo", redis_url)
    x = np.arange(400 * 16, dtype=np.float32).reshape(400, 16) / 6400
    rconn.config_set("maxmemory-policy", "noeviction")
    chunks = []
    try:
        with running_worker(config), shell.Client("demo", redis_url) as client:
            it = client.map({"features": x}, rows_per_request=1, concurrency=8)
            chunks.append(next(it))
            # When Redis fills up after the first reply
            used = int(rconn.info("memory")["used_memory"])
            rconn.config_set("maxmemory", int(used / 0.95))
            with pytest.raises(RedisFull):
                chunks.extend(it)
            # Then what was sent is answered and yielded in order, nothing is left queued
            assert rconn.xlen(STREAM) == 0
    finally:
        rconn.config_set("maxmemory", 0)
    assert [c.start for c in chunks] == list(range(len(chunks)))
    assert all(c.ok for c in chunks)
    assert 1 <= len(chunks) < 400


def test_run_on_a_full_redis_stops_and_lists_the_rows_not_sent(
    tmp_path: Path, full: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    np.savez(tmp_path / "x.npz", features=np.zeros((50, 16), np.float32))
    code = redbatch(
        [
            "run",
            "--model",
            "demo",
            "--input",
            str(tmp_path / "x.npz"),
            "--output",
            str(tmp_path / "y.npz"),
            "--redis-url",
            redis_url,
            "--no-progress",
            "--wait-for-worker",  # none: the run stops before any reply
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "the run stopped early" in err
    assert "is full" in err
    [line] = (tmp_path / "y.npz.errors.jsonl").read_text().splitlines()
    entry = json.loads(line)
    assert (entry["start"], entry["stop"], entry["code"]) == (0, 50, "REDIS_FULL")
    assert full.xlen(STREAM) == 0


def test_run_takes_the_watermark_and_wait_options(tmp_path: Path) -> None:
    args = ["run", "--model", "demo", "--input", "x.npz", "--output", "y.npz"]
    assert redbatch([*args, "--memory-high-watermark", "1.5"]) == 2
    assert redbatch([*args, "--memory-high-watermark", "nope"]) == 2
