"""A Redis outage in the middle of a batch: answered when Redis returns, one log line per outage."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from eventually import eventually
from harness import running_worker, send, stream_is_empty, wait_reply, write_config

from tools.localredis import LocalRedis


@pytest.fixture(scope="module")
def aof_server() -> Iterator[LocalRedis]:
    """A private Redis that persists every write, so the batch in hand survives a restart."""
    with LocalRedis("--appendonly", "yes", "--appendfsync", "always") as server:
        yield server


def _outage_lines(caplog: pytest.LogCaptureFixture) -> Counter[str]:
    return Counter(
        r.getMessage().split(" (", 1)[0]
        for r in caplog.records
        if r.levelno == logging.WARNING and "unreachable" in r.getMessage()
    )


def test_a_batch_run_while_redis_is_down_is_answered_when_it_returns(
    tmp_path: Path,
    aof_server: LocalRedis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.WARNING)
    config = write_config(tmp_path, "demo", aof_server.url)
    x = np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32)
    r = redis.Redis.from_url(aof_server.url, socket_timeout=30)
    running, proceed = threading.Event(), threading.Event()
    with running_worker(config, name="w1") as worker:
        real_run = worker.model.run

        def held_run(feeds: dict[str, np.ndarray], names: list[str]) -> list[np.ndarray]:
            running.set()
            assert proceed.wait(60)
            return real_run(feeds, names)

        monkeypatch.setattr(worker.model, "run", held_run)
        # Given a batch that the worker has read and is running
        send(r, "demo", "through-outage", {"features": x})
        assert running.wait(30)
        # When Redis dies under it, and comes back after the writer has noticed
        aof_server.stop(kill=True)
        proceed.set()
        eventually(lambda: any("writing replies" in k for k in _outage_lines(caplog)))
        aof_server.start()
        r = redis.Redis.from_url(aof_server.url, socket_timeout=30)
        # Then the reply written after the restart is the batch's, and nothing is left over
        reply = wait_reply(r, "through-outage", timeout_s=30)
        eventually(lambda: stream_is_empty(r, "demo"))
    assert reply.ok
    assert reply.batch_rows == 3
    lines = _outage_lines(caplog)
    assert max(lines.values()) == 1, lines  # one line per outage per task, not per retry
    assert any("reachable again; writing replies resumed" in m for m in caplog.messages)


class _LosesFirstHeartbeat:
    """A Redis stand-in whose first write of the record (SET NX, in the heartbeat script) lands
    but whose first renewal fails, as when the connection drops just after the first write."""

    def __init__(self) -> None:
        self.keys: dict[str, object] = {}
        self.renewals = 0

    def register_script(self, _source: str) -> Callable[..., int]:
        return self._beat

    def _beat(self, keys: list[str], args: list[object]) -> int:
        key, only_new = keys[0], args[3] == "nx"
        if only_new and key in self.keys:
            return 0
        if not only_new:
            self.renewals += 1
            if self.renewals == 1:
                raise redis.ConnectionError("connection reset while reading the reply")
        self.keys[key] = args[0]
        return 1


def test_a_retried_first_heartbeat_does_not_take_its_own_record_for_another_worker() -> None:
    from worker.ops.record import Registry
    from worker.redisio.retry import OutageRetry

    client = _LosesFirstHeartbeat()
    record = {"name": "w1", "model": {"name": "demo"}, "host": "h", "pid": 1}
    registry = Registry(client, "redbatch", record, threading.Event())  # type: ignore[arg-type]

    free = OutageRetry("starting up", max_wait_s=0.01).call(registry.beat_first)

    assert free  # the retry found its own first write, which is not another worker's
    assert registry.published
    assert client.renewals == 2


def test_a_write_refused_for_memory_is_logged_as_redis_full_not_unreachable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from worker.redisio.retry import OutageRetry

    # A write refused twice: the second refusal starts an outage, which is logged once
    calls = iter([redis.exceptions.OutOfMemoryError("OOM command not allowed")] * 2 + [None])

    def twice_refused() -> str:
        refusal = next(calls)
        if refusal is not None:
            raise refusal
        return "written"

    caplog.set_level(logging.WARNING, logger="worker.redisio.retry")
    assert OutageRetry("writing replies", max_wait_s=0.01).call(twice_refused) == "written"
    messages = [r.getMessage() for r in caplog.records if r.name == "worker.redisio.retry"]
    assert messages[0].startswith("Redis is full (maxmemory) during writing replies")
    assert not any("unreachable" in m for m in messages)
