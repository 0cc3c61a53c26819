"""The lanes-backlog preset (issue 28): a high-class caller behind a million low rows.

One worker serves the heavy model. First a high caller alone (a closed loop of one
``Client.infer(priority="high")``) gives its idle p50 and p99. Then a low backlog of
``--lane-low-rows`` rows (``Client.submit_many(priority="low")``, ``--lane-request-rows`` rows a
request) and a normal one of ``--lane-normal-rows`` go in, and while the worker drains them the
bench alternates windows of ``--lane-caller-s`` without the caller and with it
(``--lane-rounds`` pairs): the backlog's rows per second in each (from the worker's requests
per class, times the rows a request holds), the caller's latency in the windows with it, and
the mean batch run (``redbatch_inference_seconds`` sum over count) those windows saw. The
backlog need not drain whole: the point is that the caller's wait does not grow with it.

Shared pieces for ``tenants.py`` live here too: a lane's backlog sent raw with known rids (and
its entry ids), per-class request counts from /metrics, and the clean-up.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import redis

from producer.client.blocking import Client
from producer.protocol import keys
from producer.protocol.lanes import lane_stream, lanes_key, tenant_rid, weights_key
from tools.bench.errors import BenchError
from tools.bench.load import percentiles
from tools.bench.metrics import machine_busy_s, scrape
from tools.bench.phases import Phases
from tools.bench.processes import POLL_S, PREFIX, WorkerProcess, WorkerSetup, request_inputs
from tools.bench.report import say
from tools.bench.wire import input_rows

__all__ = [
    "LANES_MODEL",
    "class_requests",
    "clear_lanes",
    "enqueue_raw",
    "lanes_backlog",
    "lanes_setup",
    "wait_empty",
]

LANES_MODEL = "heavy"
_CHUNK = 1024  # requests per submit_many call: the client encodes a chunk at a time
_TXN = 256  # requests per MULTI of a raw enqueue (as the client's)


def lanes_setup(b: Phases) -> WorkerSetup:
    """The worker of both lanes presets: heavy, max_batch_size 32, its own served name."""
    return WorkerSetup(LANES_MODEL, 32, b.o.max_wait_ms, name="heavy-lanes")


def class_requests(samples: Mapping[str, float]) -> dict[str, float]:
    """Requests whose batch started, by class (``redbatch_queue_wait_seconds_count``)."""
    counts = {"high": 0.0, "normal": 0.0, "low": 0.0}
    head = "redbatch_queue_wait_seconds_count{"
    for name, value in samples.items():
        if name.startswith(head):
            cls = name[len(head) :].rstrip("}").partition("class=")[2].partition(",")[0]
            if cls in counts:
                counts[cls] += value
    return counts


def _runs(samples: Mapping[str, float]) -> tuple[float, float]:
    return (
        samples.get("redbatch_inference_seconds_sum", 0.0),
        samples.get("redbatch_inference_seconds_count", 0.0),
    )


def enqueue_raw(
    conn: redis.Redis,
    served: str,
    cls: str,
    tenant: str | None,
    body: bytes,
    count: int,
    tag: str,
) -> tuple[list[str], list[int]]:
    """``count`` requests of one body to lane ``(cls, tenant)``, each ``MULTI`` opening with the
    lane's ``SADD`` as a client's does; returns their rids and their entry ids' milliseconds."""
    stream = lane_stream(PREFIX, served, cls, tenant)
    lane_set = lanes_key(PREFIX, served)
    rids = [tenant_rid(tenant, f"{tag}-{i:07d}") for i in range(count)]
    ids_ms: list[int] = []
    for first in range(0, count, _TXN):
        pipe = conn.pipeline(transaction=True)
        if stream != keys.request_stream(PREFIX, served):
            pipe.sadd(lane_set, stream)
        for rid in rids[first : first + _TXN]:
            pipe.xadd(stream, {"rid": rid, "body": body})
        got = pipe.execute()
        ids_ms += [int(bytes(i).split(b"-")[0]) for i in got if isinstance(i, bytes)]
    return rids, ids_ms


def wait_empty(conn: redis.Redis, streams: Sequence[str], limit_s: float) -> float:
    """Poll until every stream is empty (answered entries are deleted); returns the seconds."""
    started = time.monotonic()
    while any(conn.xlen(s) for s in streams):
        if time.monotonic() - started > limit_s:
            raise BenchError(f"the worker did not drain {', '.join(streams)} within {limit_s:g} s")
        time.sleep(POLL_S)
    return time.monotonic() - started


def clear_lanes(conn: redis.Redis, served: str, rids: Sequence[str] = ()) -> None:
    """After a preset, with its worker stopped: its lanes, lane set, weights and the replies
    of ``rids`` deleted, so that the next preset (and Redis's memory) starts clean."""
    for cls in ("high", "normal", "low"):
        conn.delete(lane_stream(PREFIX, served, cls))
    for member in conn.smembers(lanes_key(PREFIX, served)):
        conn.unlink(member)
    conn.delete(lanes_key(PREFIX, served), weights_key(PREFIX, served))
    for first in range(0, len(rids), 4096):
        pipe = conn.pipeline(transaction=False)
        for rid in rids[first : first + 4096]:
            pipe.unlink(keys.reply_key(PREFIX, served, rid))
        pipe.execute()


def _caller(client: Client, inputs: Mapping[str, np.ndarray], seconds: float) -> list[float]:
    """One closed-loop high caller for ``seconds``: each request's latency in ms."""
    latencies = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        client.infer(inputs, timeout_s=60.0, priority="high")
        latencies.append((time.perf_counter() - t) * 1000.0)
    return latencies


class _Window:
    """One window of the drain: the backlog's rows served and the model runs, from /metrics."""

    def __init__(self, worker: WorkerProcess, rows_per_request: int) -> None:
        self.worker, self.rows = worker, rows_per_request
        self.t0 = time.monotonic()
        self.before = scrape([worker.metrics_url])
        self.busy0, self.cpu0 = machine_busy_s(), time.process_time()

    def close(self) -> dict[str, float]:
        after = scrape([self.worker.metrics_url])
        seconds = time.monotonic() - self.t0
        machine = (machine_busy_s() - self.busy0) / seconds
        caller = (time.process_time() - self.cpu0) / seconds
        got, had = class_requests(after), class_requests(self.before)
        backlog = sum(got[c] - had[c] for c in ("normal", "low")) * self.rows
        (s1, n1), (s0, n0) = _runs(after), _runs(self.before)
        high = "redbatch_queue_wait_seconds_sum{class=high}"
        waited = after.get(high, 0.0) - self.before.get(high, 0.0)
        high_n = got["high"] - had["high"]
        return {
            "seconds": seconds,
            "backlog_rows": backlog,
            "rows_per_s": backlog / seconds,
            "low_rows": (got["low"] - had["low"]) * self.rows,
            "runs": n1 - n0,
            "mean_run_ms": 1000.0 * (s1 - s0) / (n1 - n0) if n1 > n0 else 0.0,
            "high_wait_ms": 1000.0 * waited / high_n if high_n else 0.0,  # enqueue to batch
            "machine_cores": machine,  # every process's, the bench's and neighbours' too
            "bench_cores": caller,  # this process's: the caller's, when it runs
        }


def lanes_backlog(b: Phases) -> None:
    """The lanes-backlog preset (see the module)."""
    o = b.o
    setup = lanes_setup(b)
    b.workers.stop()
    conn = redis.Redis.from_url(b.url, socket_timeout=120)
    clear_lanes(conn, setup.served)
    b.wait_for_quiet()
    worker = b.workers.get(setup)
    for key in ("onnxruntime", "providers"):
        b.report["machine"].setdefault(key, worker.record["runtime"][key])
    spec = request_inputs(worker.record)
    one = input_rows(spec, 1, seed=7)
    block = input_rows(spec, o.lane_request_rows, seed=8)
    handles: list[str] = []
    result: dict[str, Any] = {"model": LANES_MODEL, "max_batch_size": setup.max_batch_size}
    try:
        with Client(setup.served, url=b.url, prefix=PREFIX) as client:
            _caller(client, one, 2.0)  # warm: the high lane is learnt (lane_watch_ms)
            say(f"lanes-backlog: one high caller alone for {o.lane_caller_s:g} s")
            idle = _Window(worker, o.lane_request_rows)
            result["idle"] = percentiles(_caller(client, one, o.lane_caller_s))
            result["idle"]["mean_run_ms"] = idle.close()["mean_run_ms"]
            enqueue = _enqueue_backlog(client, block, o.lane_low_rows, o.lane_normal_rows)
            handles = enqueue.pop("handles")
            result["enqueue"] = enqueue
            _await_class(worker, "low", limit_s=15.0)
            result["windows"] = _alternate(
                client, worker, one, o.lane_caller_s, o.lane_rounds, o.lane_request_rows
            )
    finally:
        b.workers.stop()  # SIGTERM: it answers what it holds; the rest stays queued
        say("lanes-backlog: deleting what is left of the backlog and its replies")
        clear_lanes(conn, setup.served, handles)
        conn.close()
    b.report["lanes"] = {**(b.report.get("lanes") or {}), "backlog": _judge(result)}


def _enqueue_backlog(
    client: Client, block: Mapping[str, np.ndarray], low_rows: int, normal_rows: int
) -> dict[str, Any]:
    """The low backlog, then the normal one, with ``submit_many`` in chunks; how long it took."""
    rows = len(next(iter(block.values())))
    handles: list[str] = []
    started = time.monotonic()
    for cls, total in (("low", low_rows), ("normal", normal_rows)):
        count = -(-total // rows)
        say(f"lanes-backlog: queueing {count:,} {cls} requests of {rows} rows ({count * rows:,})")
        for first in range(0, count, _CHUNK):
            n = min(_CHUNK, count - first)
            handles += client.submit_many([block] * n, priority=cls, reply_ttl_s=900)
    seconds = time.monotonic() - started
    low, normal = -(-low_rows // rows) * rows, -(-normal_rows // rows) * rows
    say(f"lanes-backlog: {low + normal:,} rows queued in {seconds:.1f} s")
    return {
        "low_rows": low,
        "normal_rows": normal,
        "rows_per_request": rows,
        "seconds": seconds,
        "rows_per_s": (low + normal) / seconds,
        "handles": handles,
    }


def _await_class(worker: WorkerProcess, cls: str, limit_s: float) -> None:
    """Wait until the worker has started a batch of ``cls`` (it learns a new lane at a sync)."""
    deadline = time.monotonic() + limit_s
    while class_requests(scrape([worker.metrics_url]))[cls] == 0:
        if time.monotonic() > deadline:
            raise BenchError(f"the worker served no {cls} request within {limit_s:g} s")
        time.sleep(0.1)


def _alternate(
    client: Client,
    worker: WorkerProcess,
    one: Mapping[str, np.ndarray],
    seconds: float,
    rounds: int,
    per_request: int,
) -> list[dict[str, Any]]:
    """``rounds`` pairs of windows while the backlog drains: without the caller, then with it."""
    windows: list[dict[str, Any]] = []
    for n in range(1, rounds + 1):
        say(f"lanes-backlog: round {n}: {seconds:g} s of backlog alone")
        window = _Window(worker, per_request)
        time.sleep(seconds)
        windows.append({"round": n, "caller": False, **window.close()})
        say(f"lanes-backlog: round {n}: {seconds:g} s with the high caller")
        window = _Window(worker, per_request)
        latencies = _caller(client, one, seconds)
        windows.append({"round": n, "caller": True, **window.close(), "latencies": latencies})
        say(
            f"lanes-backlog: round {n}: alone {windows[-2]['rows_per_s']:,.0f} rows/s, with the "
            f"caller {windows[-1]['rows_per_s']:,.0f} rows/s, caller p99 "
            f"{percentiles(latencies)['p99']:.1f} ms"
        )
    return windows


def _mean_run(windows: Sequence[dict[str, Any]]) -> float:
    runs = sum(w["runs"] for w in windows)
    return sum(w["mean_run_ms"] * w["runs"] for w in windows) / runs if runs else 0.0


def _mean_of(windows: Sequence[dict[str, Any]], key: str) -> float:
    return sum(w[key] for w in windows) / len(windows) if windows else 0.0


def _judge(result: dict[str, Any]) -> dict[str, Any]:
    """The two criteria: the caller's p99 against its bound, the drain with it against without."""
    windows = result.pop("windows")
    alone = [w for w in windows if not w["caller"]]
    with_caller = [w for w in windows if w["caller"]]
    latencies = [v for w in with_caller for v in w.pop("latencies")]
    busy = percentiles(latencies)
    idle_p99 = result["idle"]["p99"]
    # The backlog's own batch run (windows without the caller): what the caller waits behind.
    # The windows with it mix in the caller's own one-row runs, which lower the mean.
    backlog_run = _mean_run(alone)
    mixed_run = _mean_run(with_caller)
    bound = max(3 * idle_p99, idle_p99 + 3 * backlog_run)
    bound_mixed = max(3 * idle_p99, idle_p99 + 3 * mixed_run)
    rate_alone = sum(w["backlog_rows"] for w in alone) / sum(w["seconds"] for w in alone)
    rate_with = sum(w["backlog_rows"] for w in with_caller) / sum(w["seconds"] for w in with_caller)
    return {
        **result,
        "busy": busy,
        "busy_requests": len(latencies),
        "mean_run_ms": backlog_run,
        "mean_run_with_caller_ms": mixed_run,
        "p99_bound_ms": bound,
        "p99_met": busy["p99"] <= bound,
        "p99_bound_with_caller_runs_ms": bound_mixed,
        "p99_met_with_caller_runs": busy["p99"] <= bound_mixed,
        "high_wait_ms": _mean_of(with_caller, "high_wait_ms"),
        "drain_alone_rows_per_s": rate_alone,
        "drain_with_caller_rows_per_s": rate_with,
        "drain_ratio": rate_with / rate_alone if rate_alone else 0.0,
        "drain_met": rate_alone > 0 and rate_with / rate_alone >= 0.9,
        "windows": windows,
    }
