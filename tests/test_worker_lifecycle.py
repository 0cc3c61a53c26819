"""Workers sharing a stream, stopping on SIGTERM, and their validation records in Redis."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import redis
from eventually import eventually
from harness import (
    running_worker,
    send,
    serve_in_thread,
    stream_is_empty,
    wait_reply,
    write_config,
)

from tools.localredis import free_port
from worker.config import load_config
from worker.ops.metrics import Metrics
from worker.service import Worker, prepare

ROOT = Path(__file__).resolve().parents[1]


def _pipelined(rconn, model: str, count: int, make) -> list[str]:
    pipe = rconn.pipeline(transaction=False)
    rids = [send(pipe, model, f"{model}-{i}", make(i)) for i in range(count)]
    pipe.execute()
    return rids


def test_two_workers_share_a_burst_and_answer_each_request_once(
    tmp_path: Path, redis_url: str, rconn
) -> None:
    config = write_config(
        tmp_path, "slow", redis_url, batching="max_batch_size = 8\nmax_wait_ms = 2"
    )
    x = np.random.default_rng(1).normal(size=(1, 512)).astype(np.float32)
    with running_worker(config, name="w1"), running_worker(config, name="w2"):
        rids = _pipelined(rconn, "slow", 160, lambda i: {"x": x})
        replies = [wait_reply(rconn, rid) for rid in rids]
        assert stream_is_empty(rconn, "slow")

    by_worker = Counter(r.worker for r in replies)
    assert set(by_worker) == {"w1", "w2"}, by_worker
    assert all(r.ok for r in replies)
    assert [r.rid for r in replies] == rids
    assert not any(
        rconn.exists(f"redbatch:{{slow}}:reply:{rid}") for rid in rids
    )  # BLPOP took the one


def test_live_worker_record_is_in_redis_and_removed_on_clean_exit(
    tmp_path: Path, redis_url: str, rconn
) -> None:
    config = write_config(
        tmp_path, "demo", redis_url, extra="[inputs.features]\nmin = -5.0\nmax = 5.0"
    )
    with running_worker(config, name="recorded"):
        names = rconn.smembers("redbatch:{demo}:workers")
        record = json.loads(rconn.get("redbatch:{demo}:worker:recorded"))
        ttl = rconn.ttl("redbatch:{demo}:worker:recorded")
    assert names == {b"recorded"}
    assert 0 < ttl <= 15
    assert record["state"] == "ready"
    assert record["model"]["name"] == "demo"
    assert record["model"]["version"] == "7"
    assert len(record["model"]["sha256"]) == 64
    assert record["model"]["opset"] == 17
    assert record["inputs"] == [
        {
            "name": "features",
            "dtype": "float32",
            "shape": [-1, 16],
            "batch_axis": 0,
            "min": -5.0,
            "max": 5.0,
            "reject_non_finite": True,
        }
    ]
    assert {o["name"] for o in record["outputs"]} == {"probs", "label"}
    assert record["runtime"]["providers"] == ["CPUExecutionProvider"]
    assert record["batching"]["max_batch_size"] == 32
    assert record["warmup"]["batch_sizes"] == [1, 32]
    assert record["pid"] == os.getpid()
    assert not rconn.exists("redbatch:{demo}:worker:recorded")
    assert not rconn.smembers("redbatch:{demo}:workers")


def _worker_process(config: Path, name: str) -> subprocess.Popen[str]:
    """``python -m worker`` on ``config``, its log on a pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "worker", "--config", str(config), "--name", name],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_answers_the_batch_in_hand_and_exits_zero(
    tmp_path: Path, redis_url: str, rconn, signum: signal.Signals
) -> None:
    # Given a backlog far larger than the worker holds, on a slow model
    config = write_config(
        tmp_path, "slow", redis_url, batching="max_batch_size = 16\nmax_wait_ms = 5"
    )
    x = np.zeros((1, 512), np.float32)
    rids = _pipelined(rconn, "slow", 1500, lambda i: {"x": x})
    proc = _worker_process(config, "term")
    try:
        # When the signal arrives while it is serving
        wait_reply(rconn, rids[0], timeout_s=60)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()

    # Then it exits 0, nothing it read is left pending, and the rest waits in the stream
    assert proc.returncode == 0, stderr
    assert "stopped" in stderr
    group = rconn.xinfo_groups("redbatch:{slow}:requests")[0]
    assert group["pending"] == 0
    left = rconn.xlen("redbatch:{slow}:requests")
    answered = sum(rconn.llen(f"redbatch:{{slow}}:reply:{rid}") for rid in rids[1:]) + 1
    assert left > 0, "the backlog should outlast the worker"
    assert answered + left == len(rids)


def test_a_stop_signal_while_starting_exits_zero_with_a_line(
    tmp_path: Path, redis_url: str
) -> None:
    # Given a worker whose warm-up takes minutes
    config = write_config(tmp_path, "slow", redis_url)
    config.write_text(config.read_text().replace("runs = 1\n", "runs = 10000\n"))
    proc = _worker_process(config, "early")
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # When SIGTERM comes once it is loading the model
            if "loading the model" in line:
                break
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    # Then it exits 0 with a line saying so, not 143 with nothing
    assert proc.returncode == 0, stderr
    assert "stopped by SIGTERM while starting" in stderr


def _burst(config: Path) -> subprocess.CompletedProcess[str]:
    """Run ``redbatch-worker --burst`` to its end."""
    return subprocess.run(
        [sys.executable, "-m", "worker", "--config", str(config), "--burst"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_burst_mode_drains_the_stream_and_exits(tmp_path: Path, redis_url: str, rconn) -> None:
    config = write_config(tmp_path, "demo", redis_url)
    x = np.zeros((1, 16), np.float32)
    rids = _pipelined(rconn, "demo", 200, lambda i: {"features": x})
    done = _burst(config)
    assert done.returncode == 0, done.stderr
    assert all(rconn.llen(f"redbatch:{{demo}}:reply:{rid}") == 1 for rid in rids)
    assert stream_is_empty(rconn, "demo")
    # and before serving it froze what start-up left alive out of the garbage collector
    frozen = re.search(r"froze (\d+) start-up objects", done.stderr)
    assert frozen is not None, done.stderr
    assert int(frozen.group(1)) > 10_000


def test_a_worker_on_resp3_serves(tmp_path: Path, redis_url: str, rconn) -> None:
    # protocol=3 in the URL: Redis answers in RESP3 (maps where RESP2 has flat arrays)
    config = write_config(tmp_path, "demo", f"{redis_url}?protocol=3")
    x = np.zeros((1, 16), np.float32)
    rids = _pipelined(rconn, "demo", 40, lambda i: {"features": x})
    with running_worker(config):
        replies = [wait_reply(rconn, rid) for rid in rids]
    assert all(reply.ok for reply in replies)
    assert stream_is_empty(rconn, "demo")


def test_worker_survives_flushall_and_serves_again(tmp_path: Path, redis_url: str, rconn) -> None:
    config = write_config(tmp_path, "demo", redis_url)
    x = np.zeros((1, 16), np.float32)
    with running_worker(config) as worker:
        send(rconn, "demo", "before-flush", {"features": x})
        assert wait_reply(rconn, "before-flush").ok
        rconn.flushall()  # the group and the stream are gone under the worker's blocked read
        send(rconn, "demo", "after-flush", {"features": x})
        assert wait_reply(rconn, "after-flush").ok
        assert worker.reader.is_alive()


def test_worker_rides_out_a_redis_restart(tmp_path: Path, redis_server, redis_url: str) -> None:
    # Given a serving worker, when Redis is killed and comes back empty (no persistence)
    config = write_config(tmp_path, "demo", redis_url)
    x = np.zeros((1, 16), np.float32)
    with running_worker(config) as worker:
        before = redis.Redis.from_url(redis_url, socket_timeout=30)
        send(before, "demo", "before-restart", {"features": x})
        assert wait_reply(before, "before-restart").ok
        before.close()
        redis_server.restart(kill=True)
        after = redis.Redis.from_url(redis_url, socket_timeout=30)
        send(after, "demo", "after-restart", {"features": x})
        # Then it reconnects, recreates its group and serves again
        assert wait_reply(after, "after-restart").ok
        after.close()
        assert worker.reader.is_alive()
        assert worker.writer.is_alive()


def test_a_stop_while_redis_is_unreachable_at_start_exits_zero(tmp_path: Path) -> None:
    # Given a worker whose Redis is not there yet (nothing listens on its port)
    url = f"redis://127.0.0.1:{free_port()}/0"
    config = write_config(tmp_path, "demo", url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker", "--config", str(config), "--name", "early"],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "REDIS_URL": url},
    )
    lines: list[str] = []
    retrying = threading.Event()

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "Redis unreachable during starting up" in line:
                retrying.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        # When it says it is retrying, an operator gives up on it
        assert retrying.wait(60), "".join(lines)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        reader.join(timeout=10)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()
    stderr = "".join(lines)

    # Then it exits 0 with one line saying why, not an error
    assert proc.returncode == 0, stderr
    assert "stopped before Redis could be reached" in stderr


def test_a_metrics_port_in_use_is_a_config_error(tmp_path: Path, redis_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(tmp_path, "demo", redis_url, extra=f"[metrics]\nport = {port}")
        result = subprocess.run(
            [sys.executable, "-m", "worker", "--config", str(config)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 2, result.stderr
    assert f"[metrics] 0.0.0.0:{port} cannot be opened" in result.stderr
    assert "another worker on this host" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_name_another_live_worker_holds_is_warned_about(
    tmp_path: Path, redis_url: str, rconn, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a live record under the name, written by another process
    other = {"name": "twin", "host": "elsewhere", "pid": 4242, "heartbeat_at": "just now"}
    rconn.set("redbatch:{demo}:worker:twin", json.dumps(other), ex=15)
    config = write_config(tmp_path, "demo", redis_url)
    with caplog.at_level(logging.WARNING), running_worker(config, name="twin"):
        pass
    warned = [r.getMessage() for r in caplog.records if "already held the name" in r.getMessage()]
    assert len(warned) == 1
    assert "'twin'" in warned[0]


def test_a_free_name_is_not_warned_about(
    tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = write_config(tmp_path, "demo", redis_url)
    with caplog.at_level(logging.WARNING), running_worker(config, name="solo"):
        pass
    assert not [r for r in caplog.records if "already held the name" in r.getMessage()]


def _record(rconn: redis.Redis, key: str) -> dict:
    raw = rconn.get(key)
    return json.loads(raw) if raw is not None else {}


def test_a_draining_worker_shows_draining_until_it_exits(
    tmp_path: Path, redis_url: str, rconn
) -> None:
    # Given a worker whose heartbeat beats often, running one batch while it holds another
    config = write_config(tmp_path, "demo", redis_url)
    client = redis.Redis.from_url(redis_url)
    metrics = Metrics()
    worker = Worker(prepare(load_config(config), "drainer"), client, metrics=metrics)
    worker.registry.interval_s = 0.3  # a TTL of 1 s: a heartbeat that stopped shows soon
    first_running, go = threading.Event(), threading.Event()
    second_running, proceed = threading.Event(), threading.Event()
    turns = [(first_running, go), (second_running, proceed)]
    real_run = worker.model.run

    def run_in_turn(feeds: dict[str, np.ndarray], names: list[str]) -> list[np.ndarray]:
        started, wait_for = turns.pop(0) if turns else (threading.Event(), go)
        started.set()
        assert wait_for.wait(60), "the test never let this batch run"
        return real_run(feeds, names)

    worker.model.run = run_in_turn  # type: ignore[method-assign]
    key, stream = "redbatch:{demo}:worker:drainer", "redbatch:{demo}:requests"
    x = np.zeros((1, 16), np.float32)
    thread, failure = serve_in_thread(worker, "drainer")
    try:
        assert worker.ready.wait(30), failure
        send(rconn, "demo", "first", {"features": x})
        assert first_running.wait(30)
        send(rconn, "demo", "second", {"features": x})
        eventually(lambda: rconn.xpending(stream, "workers")["pending"] == 2)  # read, held
        # When it is told to stop, and its drain runs the batch it held
        worker.request_stop()
        go.set()
        assert second_running.wait(30)
        # Then its record says draining, and the heartbeat goes on while it drains
        eventually(lambda: _record(rconn, key).get("state") == "draining")
        beat = _record(rconn, key)["heartbeat_at"]
        eventually(lambda: _record(rconn, key).get("heartbeat_at", beat) > beat)
        assert rconn.smembers("redbatch:{demo}:workers") == {b"drainer"}
        # and so do the stream gauges: a request sent once it reads no more stays, and is seen
        worker.reader.join(timeout=30)
        send(rconn, "demo", "after-stop", {"features": x})
        # "first" was deleted once answered
        eventually(lambda: metrics.backlog.labels("demo", "normal", "")._value.get() == 2)
        assert thread.is_alive()
        proceed.set()
        thread.join(timeout=30)
    finally:
        go.set()
        proceed.set()
        client.close()
    # and once the drain ends, so does the heartbeat, and the record is gone
    assert not thread.is_alive()
    assert not failure, failure
    assert not worker.registry.is_alive()
    assert wait_reply(rconn, "first").ok
    assert wait_reply(rconn, "second").ok
    assert not rconn.exists(key)
    assert not rconn.smembers("redbatch:{demo}:workers")
    assert rconn.xlen(stream) == 1  # "after-stop" waits for the next worker


def test_burst_mode_answers_what_a_dead_consumer_left_pending_before_it_exits(
    tmp_path: Path, redis_url: str, rconn
) -> None:
    # Given five requests, three of them read and never answered by a crashed burst worker
    config = write_config(tmp_path, "demo", redis_url, extra="[delivery]\nclaim_idle_ms = 1000")
    x = np.zeros((1, 16), np.float32)
    rids = _pipelined(rconn, "demo", 5, lambda i: {"features": x})
    stream = "redbatch:{demo}:requests"
    rconn.xgroup_create(stream, "workers", id="0", mkstream=True)
    assert len(rconn.xreadgroup("workers", "ghost", {stream: ">"}, count=3)[0][1]) == 3
    # When a burst worker runs
    done = _burst(config)
    # Then it claims the ghost's entries once idle past claim_idle_ms, and exits 0 once nothing
    # is left in the stream or pending in the group
    assert done.returncode == 0, done.stderr
    assert all(rconn.llen(f"redbatch:{{demo}}:reply:{rid}") == 1 for rid in rids)
    assert stream_is_empty(rconn, "demo")
    assert "redelivering entries of consumer 'ghost'" in done.stderr


def test_reads_take_about_a_batch_of_rows_so_a_backlog_of_large_requests_stays_out(
    tmp_path: Path, redis_url: str, rconn
) -> None:
    # Given a worker of max_batch_size 16 whose first batch (one request) is held in its run
    config = write_config(tmp_path, "demo", redis_url, batching="max_batch_size = 16")
    client = redis.Redis.from_url(redis_url)
    worker = Worker(prepare(load_config(config), "reader"), client)
    running, go = threading.Event(), threading.Event()
    real_run = worker.model.run

    def held(feeds: dict[str, np.ndarray], names: list[str]) -> list[np.ndarray]:
        running.set()
        assert go.wait(60), "the test never let the batch run"
        return real_run(feeds, names)

    worker.model.run = held  # type: ignore[method-assign]
    stream = "redbatch:{demo}:requests"
    thread, failure = serve_in_thread(worker, "reader")
    try:
        assert worker.ready.wait(30), failure
        send(rconn, "demo", "first", {"features": np.zeros((16, 16), np.float32)})
        assert running.wait(30)
        # When a backlog of 40 requests of 16 rows (a batch each) arrives meanwhile, at once
        pipe = rconn.pipeline(transaction=True)
        for i in range(40):
            send(pipe, "demo", f"big-{i}", {"features": np.zeros((16, 16), np.float32)})
        pipe.execute()
        eventually(worker.queue.full)  # the reader has read all it will before the run ends
        held_entries = rconn.xpending(stream, "workers")["pending"]
        # Then the worker holds a few of them, one per read, not 16 per read
        assert held_entries <= 6
        assert worker.reader.read_count == 1
    finally:
        go.set()
        worker.request_stop()
        thread.join(timeout=60)
        client.close()
    assert not failure, failure
    assert wait_reply(rconn, "first").ok
    assert rconn.xpending(stream, "workers")["pending"] == 0  # what it held, it answered
