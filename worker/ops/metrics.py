"""Prometheus metrics and health endpoints: the one module that owns the metric objects.

The worker's stages call a few named events (``worker.events.Events``: ``batch_done``,
``redis_down``, ...); ``Metrics`` implements them as Prometheus series, recorded once per batch.
``/metrics`` serves them, ``/healthz`` says the process is alive, and ``/readyz`` says it is
warm and reading from the stream.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Info,
    ProcessCollector,
    make_wsgi_app,
)

from producer.protocol.errors import ERROR_CODES
from producer.redisio.memory import MemoryReading
from worker.events import Events
from worker.model.held import HeldState
from worker.ops.histograms import ByClassHistogram, Histogram
from worker.redisio.group import StreamStats

__all__ = ["Metrics", "MetricsServer"]

log = logging.getLogger(__name__)

#: What a worker can be doing when Redis goes away (the ``OutageRetry`` names) and what becomes of
#: a claimed entry (``Reclaimer``): labels exported at 0 from the start.
OUTAGE_TASKS = ("starting up", "reading requests", "writing replies")
CLAIM_KINDS = ("reclaimed", "own", "poisoned", "deleted")
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


STAGES = ("preprocess", "postprocess")


class StageTotals:
    """Busy and CPU seconds per stage since start, for the worker's record (``status
    --watch`` turns two of them into how busy each stage was in between)."""

    def __init__(self) -> None:
        self.threads = 0
        self._started = time.monotonic()
        self._cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
        self._lock = threading.Lock()
        self._totals = {stage: [0, 0.0, 0.0] for stage in (*STAGES, "model")}

    def add(self, stage: str, requests: int, busy_s: float, cpu_s: float) -> None:
        with self._lock:
            total = self._totals[stage]
            total[0] += requests
            total[1] += busy_s
            total[2] += cpu_s

    def snapshot(self) -> dict[str, Any]:
        """{"threads", "cpu_s" (the process's), "uptime_s", "cores", and per stage
        {"requests", "busy_s", "cpu_s"}}; the model's requests are rows and its CPU is not apart
        from the process's."""
        with self._lock:
            stages = {
                stage: {"requests": n, "busy_s": round(busy, 6), "cpu_s": round(cpu, 6)}
                for stage, (n, busy, cpu) in self._totals.items()
            }
        return {
            "threads": self.threads,
            "cpu_s": round(time.process_time(), 6),
            "uptime_s": round(time.monotonic() - self._started, 6),  # times two samples exactly
            "cores": self._cores or os.cpu_count() or 0,
            **stages,
        }


class Metrics(Events):
    """The worker's series, in a registry of its own (so tests can run several workers); the
    events they count are ``Events``' (fault points are not theirs)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "redbatch_requests", "Requests answered, by outcome code.", ["code"], registry=r
        )
        self.batch_rows = Histogram(
            "redbatch_batch_rows", "Rows per model run.", buckets=_ROW_BUCKETS, registry=r
        )
        self.batch_requests = Histogram(
            "redbatch_batch_requests", "Requests per batch.", buckets=_ROW_BUCKETS, registry=r
        )
        self.queue_wait = ByClassHistogram(
            "redbatch_queue_wait_seconds",
            "From enqueue (stream id time) to batch start, by the request's class.",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.decode = Histogram(
            "redbatch_decode_validate_seconds",
            "Decoding and validating one request.",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.inference = Histogram(
            "redbatch_inference_seconds", "One model run.", buckets=_SECONDS_BUCKETS, registry=r
        )
        self.reply_write = Histogram(
            "redbatch_reply_write_seconds",
            "Writing a batch's replies, acks and deletes (one round trip).",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        # Per shard (``shard`` is its tag: the model's name for its first): sum over shards
        # for the model's queue, max for its oldest entry.
        self.backlog = Gauge(
            "redbatch_backlog",
            "Entries in the lane's stream (XLEN): unfinished work.",
            ["shard", "class", "tenant"],
            registry=r,
        )
        self.pending = Gauge(
            "redbatch_pending",
            "Entries of the lane read by a worker and not yet answered.",
            ["shard", "class", "tenant"],
            registry=r,
        )
        self.lag = Gauge(
            "redbatch_group_lag",
            "Entries of the lane not yet read by the group (-1 when Redis cannot tell).",
            ["shard", "class", "tenant"],
            registry=r,
        )
        self.dead_letters = Gauge(
            "redbatch_dead_letters",
            "Entries in the shard's dead-letter stream.",
            ["shard"],
            registry=r,
        )
        self.backlog_age = Gauge(
            "redbatch_backlog_oldest_age_seconds",
            "Age of the oldest entry in the lane's stream (0 when it is empty).",
            ["shard", "class", "tenant"],
            registry=r,
        )
        self._lanes: set[tuple[str, str, str]] = set()  # (shard, class, tenant) exported
        self.used_memory = Gauge(
            "redbatch_redis_used_memory_bytes",
            "Redis used_memory (NaN when INFO is refused to the worker).",
            registry=r,
        )
        self.max_memory = Gauge(
            "redbatch_redis_maxmemory_bytes",
            "Redis maxmemory; 0: no limit (NaN when INFO is refused to the worker).",
            registry=r,
        )
        self.memory_headroom = Gauge(
            "redbatch_redis_memory_headroom_ratio",
            "1 - used_memory / maxmemory: producers are refused below 1 - their high watermark "
            "(0.2 by default); negative past maxmemory; NaN without a limit.",
            registry=r,
        )
        self.redis_outages = Counter(
            "redbatch_redis_outages",
            "Times Redis became unreachable, one per outage, by what the worker was doing.",
            ["during"],
            registry=r,
        )
        self.stream_damage = Counter(
            "redbatch_stream_damage",
            "Times a request stream was damaged under the workers, by kind (deleted, trimmed, "
            "exhausted, group_recreated).",
            ["shard", "kind"],
            registry=r,
        )
        self.requests_lost = Counter(
            "redbatch_requests_lost",
            "Requests lost to stream damage (at least this many), by shard.",
            ["shard"],
            registry=r,
        )
        self.claims = Counter(
            "redbatch_claims",
            "Entries taken over from a stopped or stuck consumer, by what became of them "
            "(reclaimed, own after a restart, poisoned, deleted).",
            ["kind"],
            registry=r,
        )
        self.lease_renewals = Counter(
            "redbatch_lease_renewals", "Held entries whose lease was renewed.", registry=r
        )
        self.consumers_removed = Counter(
            "redbatch_consumers_removed",
            "Idle consumers with nothing pending removed from the group.",
            registry=r,
        )
        self.cancelled_runs = Counter(
            "redbatch_cancelled_after_run",
            "Requests answered CANCELLED after running: a cancel check answered during the "
            "run (compute spent for nothing).",
            registry=r,
        )
        self.splits = Counter(
            "redbatch_requests_split",
            "Requests whose rows were split across two batches to fill the room a higher class "
            "left, by class.",
            ["class"],
            registry=r,
        )
        self.hook_seconds = {
            stage: Histogram(
                f"redbatch_{stage}_seconds",
                f"The pipeline's {stage} of one request (its share of a batch call).",
                buckets=_SECONDS_BUCKETS,
                registry=r,
            )
            for stage in STAGES
        }
        self.hook_busy = Counter(
            "redbatch_pipeline_busy_seconds",
            "Seconds the pipeline's threads spent in hook calls, by stage.",
            ["stage"],
            registry=r,
        )
        self.hook_cpu = Counter(
            "redbatch_pipeline_cpu_seconds",
            "CPU seconds of the pipeline's threads in hook calls, by stage.",
            ["stage"],
            registry=r,
        )
        self.hook_threads = Gauge(
            "redbatch_pipeline_threads", "Threads the pipeline's hooks run on.", registry=r
        )
        ProcessCollector(registry=r)  # process_cpu_seconds_total: the whole worker's CPU
        self.stages = StageTotals()
        self.warmup = Gauge("redbatch_warmup_seconds", "Time spent warming up.", registry=r)
        self.ready = Gauge("redbatch_ready", "1 while warm and reading the stream.", registry=r)
        self.model = Info("redbatch_model", "The model and runtime served.", registry=r)
        self._held_series(r)
        self._zero_known_labels()

    def _held_series(self, r: CollectorRegistry) -> None:
        """A model's session under a budget of several (worker/model/held.py)."""
        self.loaded = Gauge("redbatch_model_loaded", "1 while the session is held.", registry=r)
        self.loads = Counter("redbatch_model_loads", "Session loads after start.", registry=r)
        self.evictions = Counter(
            "redbatch_model_evictions", "Sessions released for the budget.", registry=r
        )
        self.load_time = Gauge(
            "redbatch_model_load_seconds", "The last load, warmup included.", registry=r
        )
        self.held_bytes = Gauge(
            "redbatch_model_held_bytes", "Resident memory the last load added.", registry=r
        )
        self.device_bytes = Gauge(
            "redbatch_model_device_bytes", "GPU memory the last load took (CUDA).", registry=r
        )
        self.loaded.set(1)
        self._seen_held = (1, 0)

    def held_seen(self, state: HeldState) -> None:
        """Record a load or release of the session."""
        loads, evictions = self._seen_held
        self.loads.inc(max(state.loads - loads, 0))
        self.evictions.inc(max(state.evictions - evictions, 0))
        self._seen_held = (state.loads, state.evictions)
        self.loaded.set(1 if state.loaded else 0)
        self.load_time.set(state.load_s)
        self.held_bytes.set(state.held_bytes)
        self.device_bytes.set(state.device_bytes)

    def _zero_known_labels(self) -> None:
        """Export every known label at 0 from the start: a series that first appears at 1 hides
        that first count from rate() and increase(), so a worker's first error went unseen."""
        for code in ("OK", *ERROR_CODES, "DEAD_LETTER"):
            self.requests.labels(code=code)
        for during in OUTAGE_TASKS:
            self.redis_outages.labels(during=during)
        for kind in CLAIM_KINDS:
            self.claims.labels(kind=kind)
        for stage in STAGES:
            self.hook_busy.labels(stage=stage)
            self.hook_cpu.labels(stage=stage)

    def describe(self, record: dict[str, Any]) -> None:
        """Publish the validation record's identity fields and warmup time."""
        self.model.info(
            {
                "name": record["model"]["name"],
                "version": record["model"]["version"],
                "sha256": record["model"]["sha256"],
                "providers": ",".join(record["runtime"]["providers"]),
                "onnxruntime": record["runtime"]["onnxruntime"],
                "worker": record["name"],
            }
        )
        self.warmup.set(record["warmup"]["total_ms"] / 1000.0)
        pipeline = record.get("pipeline")
        self.hook_threads.set(0 if pipeline is None else pipeline["threads"])
        self.stages.threads = 0 if pipeline is None else pipeline["threads"]

    def hook_ran(self, stage: str, requests: int, wall_s: float, cpu_s: float) -> None:
        """Record one hook call: its requests' share of its time, and its thread's busy and
        CPU seconds (how bound by preprocessing the worker is)."""
        if requests:
            self.hook_seconds[stage].observe_many([wall_s / requests] * requests)
        self.hook_busy.labels(stage=stage).inc(wall_s)
        self.hook_cpu.labels(stage=stage).inc(cpu_s)
        self.stages.add(stage, requests, wall_s, cpu_s)

    def stream_seen(
        self, stats: StreamStats, now_ms: float, shard: str, cls: str = "normal", tenant: str = ""
    ) -> None:
        """Record one lane's stream state (shard ``shard``, class ``cls``, ``tenant`` or ""),
        sampled by the heartbeat; the dead letters are the shard's (its default lane's)."""
        labels = {"shard": shard, "class": cls, "tenant": tenant}
        self._lanes.add((shard, cls, tenant))
        self.backlog.labels(**labels).set(stats.backlog)
        self.pending.labels(**labels).set(stats.pending)
        self.lag.labels(**labels).set(-1 if stats.lag is None else stats.lag)
        if cls == "normal" and not tenant:
            self.dead_letters.labels(shard=shard).set(stats.dead)
        oldest = stats.oldest_ms
        age = 0.0 if oldest is None else max(now_ms - oldest, 0.0) / 1000.0
        self.backlog_age.labels(**labels).set(age)

    def keep_lanes(self, lanes: set[tuple[str, str, str]]) -> None:
        """Drop the series of every lane not in ``lanes`` (shard, class, tenant): a lane
        removed, or a retired shard's, so that its last values do not linger."""
        for gone in self._lanes - lanes:
            for gauge in (self.backlog, self.pending, self.lag, self.backlog_age):
                with contextlib.suppress(KeyError):
                    gauge.remove(*gone)
        self._lanes &= lanes

    def shard_gone(self, shard: str) -> None:
        """Drop a retired shard's series (every lane of it), so that none lingers."""
        self.keep_lanes({lane for lane in self._lanes if lane[0] != shard})
        with contextlib.suppress(KeyError):
            self.dead_letters.remove(shard)

    def memory_seen(self, memory: MemoryReading | None) -> None:
        """Record Redis memory: on a cluster, the fullest node of the model's shards."""
        nan = float("nan")
        self.used_memory.set(nan if memory is None else memory.used_bytes)
        self.max_memory.set(nan if memory is None else memory.max_bytes)
        fraction = None if memory is None else memory.used_fraction
        self.memory_headroom.set(nan if fraction is None else 1.0 - fraction)

    def redis_down(self, during: str) -> None:
        """Count one Redis outage noticed while ``during`` (reading or writing)."""
        self.redis_outages.labels(during=during).inc()

    def stream_damaged(self, shard: str, kind: str, lost: int) -> None:
        """Count one damage to a shard's stream and the requests it lost."""
        self.stream_damage.labels(shard=shard, kind=kind).inc()
        if lost > 0:
            self.requests_lost.labels(shard=shard).inc(lost)

    def claimed(self, kind: str) -> None:
        """Count one entry taken over from another consumer (or an earlier self)."""
        self.claims.labels(kind=kind).inc()

    def leases_renewed(self, count: int) -> None:
        self.lease_renewals.inc(count)

    def consumers_forgotten(self, count: int) -> None:
        self.consumers_removed.inc(count)

    def cancelled_after_run(self) -> None:
        self.cancelled_runs.inc()

    def split(self, cls: str) -> None:
        self.splits.labels(cls).inc()

    def batch_done(
        self,
        codes: Iterable[str],
        queued_s: Sequence[float],
        decode_s: Iterable[float],
        runs: Iterable[tuple[int, float]],
        write_s: float,
        classes: Sequence[str] = (),
    ) -> None:
        """Record one batch: the codes of the answers written, per-request waits (one each, so
        also the batch's size), each run's rows and seconds."""
        for code, count in Tally(codes).items():
            self.requests.labels(code=code).inc(count)
        self.batch_requests.observe(len(queued_s))
        self.queue_wait.observe_many(queued_s, classes)
        self.decode.observe_many(decode_s)
        for rows, seconds in runs:
            self.batch_rows.observe(rows)
            self.inference.observe(seconds)
            self.stages.add("model", rows, seconds, 0.0)
        self.reply_write.observe(write_s)


class _QuietHandler(WSGIRequestHandler):
    # A client that connects and sends nothing (a port scan, a TCP health check, a stalled
    # scraper) is dropped after this long instead of holding its thread for good.
    timeout = 10.0

    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not events
        return


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, so one slow or idle client never stops /healthz answering
    the kubelet, nor ``close()`` returning at shutdown; daemon threads are never joined."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or hung up is routine (port scans, TCP health checks): one
        DEBUG line, not socketserver's traceback on stderr, which bypasses the JSON logs."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # TimeoutError, ConnectionResetError, BrokenPipeError
            log.debug("metrics client %s: %s", client_address, exc)
            return
        log.exception("metrics request from %s failed", client_address)


class MetricsServer(threading.Thread):
    """Serves /metrics, /healthz and /readyz on ``port`` (0 picks a free one) until closed.

    ``problem()`` says why the worker is not healthy (None: it is), and the 503 body says it;
    without it, ``is_healthy()`` decides and a failure blames a batch past ``max_run_s``."""

    def __init__(
        self,
        metrics: Metrics,
        is_ready: Callable[[], bool],
        port: int,
        is_healthy: Callable[[], bool] = lambda: True,
        host: str = "0.0.0.0",
        problem: Callable[[], str | None] | None = None,
    ) -> None:
        super().__init__(name="redbatch-metrics", daemon=True)
        self._metrics_app = make_wsgi_app(metrics.registry)
        self._is_ready = is_ready
        self._problem = problem or (
            lambda: None if is_healthy() else "a batch has run longer than max_run_s"
        )
        self._server: WSGIServer = make_server(
            host, port, self._app, server_class=_ThreadingServer, handler_class=_QuietHandler
        )
        self.port = self._server.server_port
        self.address = (str(self._server.server_address[0]), self.port)

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            problem = self._problem()
            start_response("200 OK" if problem is None else "503 Service Unavailable", [])
            return [b"ok\n" if problem is None else problem.encode() + b"\n"]
        if path == "/readyz":
            ready = self._is_ready()
            start_response("200 OK" if ready else "503 Service Unavailable", [])
            return [b"ready\n" if ready else b"not ready\n"]
        return self._metrics_app(environ, start_response)

    def run(self) -> None:
        log.info("metrics on :%d (/metrics, /healthz, /readyz)", self.port)
        self._server.serve_forever(poll_interval=0.5)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
