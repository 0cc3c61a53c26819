"""A running worker's /metrics counts the work it did; /healthz and /readyz tell its state."""

from __future__ import annotations

import math
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import prometheus_client
import pytest
from harness import running_worker, send, wait_reply, write_config
from prometheus_client import CollectorRegistry, generate_latest

from producer.redisio.memory import MemoryReading
from worker.ops.histograms import Histogram
from worker.ops.memalarm import MemoryAlarm
from worker.ops.metrics import Metrics, MetricsServer
from worker.redisio.stream import StreamStats


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


#: The oldest entry's age of the demo shard's version 2 stream (its default lane).
OLDEST = 'redbatch_backlog_oldest_age_seconds{class="normal",shard="demo",tenant=""}'


def _value(text: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    assert match, f"{series} not in /metrics"
    return float(match.group(1))


def test_metrics_match_the_work_done(tmp_path: Path, redis_url: str, rconn) -> None:
    config = write_config(tmp_path, "demo", redis_url, extra="[inputs.features]\nmax = 5.0")
    metrics = Metrics()
    state = {"ready": False}
    server = MetricsServer(metrics, lambda: state["ready"], port=0)
    server.start()
    try:
        # While not ready, /healthz is up and /readyz says 503
        assert _get(server.port, "/healthz") == (200, "ok\n")
        assert _get(server.port, "/readyz")[0] == 503
        with running_worker(config, metrics=metrics) as worker:
            state["ready"] = worker.ready.is_set()
            assert _get(server.port, "/readyz")[0] == 200
            good = np.zeros((2, 16), np.float32)
            bad = np.full((1, 16), 9.0, np.float32)
            for i in range(6):
                send(rconn, "demo", f"ok{i}", {"features": good})
            for i in range(3):
                send(rconn, "demo", f"bad{i}", {"features": bad})
            rconn.xadd("redbatch:{demo}:requests", {"rid": "bad id!", "body": b""})
            for rid in [*(f"ok{i}" for i in range(6)), *(f"bad{i}" for i in range(3))]:
                wait_reply(rconn, rid)
            worker.stop.set()  # stop reading, so the next entry stays in the stream
            worker.reader.join()
            rconn.xadd("redbatch:{demo}:requests", {"rid": "queued", "body": b""})
            worker._sample_stream()  # what the heartbeat does every 5 s
        # A batch's metrics are recorded once it is written; after a stop, all of them are.
        text = _get(server.port, "/metrics")[1]
    finally:
        server.close()

    assert _value(text, 'redbatch_requests_total{code="OK"}') == 6
    assert _value(text, 'redbatch_requests_total{code="INVALID_INPUT"}') == 3
    assert _value(text, "redbatch_batch_rows_sum") == 12  # 6 requests of 2 rows
    assert _value(text, "redbatch_batch_requests_sum") == 10  # 9 answered, 1 dead letter
    runs = _value(text, "redbatch_batch_rows_count")
    assert _value(text, "redbatch_inference_seconds_count") == runs
    assert _value(text, 'redbatch_queue_wait_seconds_count{class="normal"}') == 10  # v2 requests
    assert _value(text, 'redbatch_queue_wait_seconds_count{class="high"}') == 0
    assert _value(text, "redbatch_decode_validate_seconds_count") == 10
    assert _value(text, "redbatch_reply_write_seconds_count") >= 1
    assert _value(text, "redbatch_warmup_seconds") > 0
    assert _value(text, 'redbatch_backlog{class="normal",shard="demo",tenant=""}') == 1
    assert _value(text, 'redbatch_pending{class="normal",shard="demo",tenant=""}') == 0
    assert _value(text, 'redbatch_dead_letters{shard="demo"}') == 1
    assert _value(text, 'redbatch_requests_total{code="DEAD_LETTER"}') == 1
    assert 'redbatch_model_info{name="demo"' in text
    # Codes and outages that did not happen are exported at 0, so their first count is seen.
    assert _value(text, 'redbatch_requests_total{code="POISONED"}') == 0
    assert _value(text, 'redbatch_redis_outages_total{during="writing replies"}') == 0
    assert _value(text, 'redbatch_claims_total{kind="reclaimed"}') == 0
    # Redis memory and the backlog's age, sampled with the stream
    assert _value(text, "redbatch_redis_used_memory_bytes") > 0
    assert _value(text, "redbatch_redis_maxmemory_bytes") == 0
    assert math.isnan(_value(text, "redbatch_redis_memory_headroom_ratio"))  # no limit set
    assert 0 <= _value(text, OLDEST) < 60


def test_memory_gauges_and_alarm_follow_redis_past_maxmemory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a worker's metrics and memory alarm fed by heartbeat samples
    metrics, alarm = Metrics(), MemoryAlarm()

    def sample(used: int, limit: int) -> str:
        stats = StreamStats(
            3, 1, 2, 0, oldest_ms=1_000, memory=MemoryReading(used, limit, "noeviction")
        )
        metrics.stream_seen(stats, now_ms=3_500, shard="demo")
        metrics.memory_seen(stats.memory)
        alarm.seen(stats.memory)
        return generate_latest(metrics.registry).decode()

    # When Redis is at 60%, then past maxmemory twice, then back under
    text = sample(600, 1000)
    assert _value(text, "redbatch_redis_memory_headroom_ratio") == pytest.approx(0.4)
    assert _value(text, OLDEST) == 2.5
    text = sample(1200, 1000)
    sample(1300, 1000)
    assert _value(text, "redbatch_redis_memory_headroom_ratio") == pytest.approx(-0.2)
    sample(900, 1000)
    # Then one line said it passed maxmemory, and one that it came back
    lines = [r.getMessage() for r in caplog.records if r.name == "worker.ops.memalarm"]
    assert len(lines) == 2
    assert lines[0].startswith("Redis is past maxmemory")
    assert lines[1].startswith("Redis is back under maxmemory")


def test_healthz_fails_while_a_batch_hangs() -> None:
    hung = [False]
    server = MetricsServer(Metrics(), lambda: not hung[0], 0, is_healthy=lambda: not hung[0])
    server.start()
    try:
        assert _get(server.port, "/healthz")[0] == 200
        hung[0] = True
        status, body = _get(server.port, "/healthz")
        assert status == 503
        assert "max_run_s" in body
        assert _get(server.port, "/readyz")[0] == 503
    finally:
        server.close()


def test_batch_histograms_expose_what_prometheus_clients_own_would() -> None:
    bounds = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.5, 1, 10)
    # Values on, between and beyond the bounds, as batches and one at a time.
    batches = [[0.0001, 0.0005, 0.00051], [], [0.003, 0.003, 0.5, 7.0], [11.0, float("inf")]]
    theirs = CollectorRegistry()
    reference = prometheus_client.Histogram("x_seconds", "Doc.", buckets=bounds, registry=theirs)
    ours = CollectorRegistry()
    histogram = Histogram("x_seconds", "Doc.", bounds, ours)
    for batch in batches:
        for value in batch:
            reference.observe(value)
        histogram.observe_many(batch)
    histogram.observe(0.002)
    reference.observe(0.002)

    def lines(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return [line for line in text.splitlines() if "_created" not in line]

    assert lines(ours) == lines(theirs)
    assert histogram.count == 10
    assert _value(generate_latest(ours).decode(), 'x_seconds_bucket{le="0.0005"}') == 2


def test_metrics_server_listens_where_it_is_told() -> None:
    server = MetricsServer(Metrics(), lambda: True, 0, host="127.0.0.1")
    server.start()
    try:
        assert server.address[0] == "127.0.0.1"
        assert _get(server.port, "/healthz") == (200, "ok\n")
    finally:
        server.close()


def test_an_idle_connection_neither_stops_healthz_nor_holds_up_close() -> None:
    # Given a client that connects to the metrics port and sends nothing (a port scan, a load
    # balancer's TCP check); the kubelet's probes time out after 3 s
    server = MetricsServer(Metrics(), lambda: True, 0, host="127.0.0.1")
    server.start()
    idle = socket.create_connection(("127.0.0.1", server.port))
    try:
        # Then /healthz still answers at once
        assert _get(server.port, "/healthz") == (200, "ok\n")
        # And close() (at the end of a SIGTERM drain) returns without waiting for that client
        started = time.monotonic()
        server.close()
        assert time.monotonic() - started < 5.0  # not the client: it never leaves
    finally:
        idle.close()


def test_an_idle_client_timed_out_leaves_no_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from worker.ops import metrics as metrics_module

    monkeypatch.setattr(metrics_module._QuietHandler, "timeout", 0.2)
    server = MetricsServer(Metrics(), lambda: True, 0, host="127.0.0.1")
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as idle:
            idle.settimeout(10)
            assert idle.recv(1) == b""  # the server hung up on it
    finally:
        server.close()
    assert "Traceback" not in capsys.readouterr().err


def test_a_lane_gone_from_a_sample_loses_its_series_and_the_others_keep_theirs() -> None:
    metrics = Metrics()
    stats = StreamStats(3, 1, 2, 0, oldest_ms=1_000, memory=None)
    metrics.stream_seen(stats, now_ms=2_000, shard="demo")
    metrics.stream_seen(stats, 2_000, "demo", "low", "acme")
    metrics.keep_lanes({("demo", "normal", "")})  # the acme lane was removed
    text = generate_latest(metrics.registry).decode()
    assert _value(text, 'redbatch_backlog{class="normal",shard="demo",tenant=""}') == 3
    assert 'tenant="acme"' not in text
    metrics.shard_gone("demo")
    assert 'shard="demo"' not in generate_latest(metrics.registry).decode()
