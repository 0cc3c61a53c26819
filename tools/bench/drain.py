"""The drain preset: a backlog of tiny requests enqueued first, then a fresh worker drains it.

Unlike the other presets this is not a load with a window: it measures how fast a worker
empties a stream it finds full (a restart after an outage), and whether its memory stays near
its idle size while it does (peak RSS over idle RSS, read from /proc). The requests go in with
known rids, so every reply is collected afterwards and counted.
"""

from __future__ import annotations

import time

import redis

from producer.client import results, submission
from producer.protocol import keys
from tools.bench.errors import BenchError
from tools.bench.load import LoadSpec, batch_rows_summary
from tools.bench.metrics import cpu_cores, cpu_sample, memory_kib, scrape, worker_view
from tools.bench.phases import Phases
from tools.bench.processes import POLL_S, PREFIX, WorkerProcess, WorkerSetup
from tools.bench.report import say
from tools.bench.wire import ProducerTally, Sender

__all__ = ["drain"]


def drain(b: Phases) -> None:
    """A backlog of tiny requests enqueued first, then a fresh worker started to drain it."""
    n = b.o.drain_requests
    setup = WorkerSetup("tiny", 32, b.o.max_wait_ms, name="tiny-drain")
    b.workers.stop()
    say("drain: idle memory of a fresh worker")
    idle = WorkerProcess(setup, b.model_file("tiny"), b.url, b.workdir, b.o.providers).start()
    try:
        time.sleep(1.0)  # settle: the idle figure is taken once start-up work is over
        idle_kib = memory_kib(idle.pid)
        inputs = idle.record["inputs"]
    finally:
        idle.stop()
    spec = b.load_spec(PREFIX, setup.served, inputs, {})
    conn = redis.Redis.from_url(b.url, socket_timeout=60)
    try:
        b.wait_for_quiet()
        say(f"drain: enqueueing {n:,} tiny requests")
        enqueue_s = _enqueue(conn, spec, n)
        say("drain: starting a worker on the backlog")
        worker = WorkerProcess(setup, b.model_file("tiny"), b.url, b.workdir, b.o.providers).start()
        try:
            ready = time.monotonic()
            before = scrape([worker.metrics_url])
            cpu_before = cpu_sample(conn, {"worker": [worker.pid]})
            sampled = _wait_drained(conn, spec, worker.pid, limit_s=120 + n / 500)
            drain_s = time.monotonic() - ready
            cpu_after = cpu_sample(conn, {"worker": [worker.pid]})
            after = scrape([worker.metrics_url])
            end_kib = memory_kib(worker.pid)
        finally:
            worker.stop()
        tally = _collect(conn, spec, n)
    finally:
        conn.close()
    peak = end_kib["VmHWM"]
    b.report["drain"] = {
        "requests": n,
        "enqueue_s": enqueue_s,
        "enqueue_per_s": n / enqueue_s,
        "drain_s": drain_s,
        "drain_per_s": n / drain_s,
        "ok": tally.codes.get("OK", 0),
        "errors": {c: k for c, k in tally.codes.items() if c != "OK"},
        "missing": tally.lost,
        "batch_rows": batch_rows_summary(tally.batch_rows),
        "rss_kib": {
            "idle": idle_kib["VmRSS"],
            "idle_peak": idle_kib["VmHWM"],
            "drain_peak": peak,
            "drain_sampled_max": sampled,
            "drain_end": end_kib["VmRSS"],
        },
        "peak_over_idle": peak / idle_kib["VmRSS"],
        "worker_side": worker_view(before, after),
        "cpu_cores": cpu_cores(cpu_before, cpu_after),
    }
    d = b.report["drain"]
    say(
        f"drain: {d['drain_per_s']:,.0f} req/s, peak RSS {peak / 1024:.0f} MiB "
        f"= {d['peak_over_idle']:.2f} x idle {idle_kib['VmRSS'] / 1024:.0f} MiB"
    )


def _drain_rid(i: int) -> str:
    return f"drain-{i:07d}"


def _enqueue(conn: redis.Redis, spec: LoadSpec, n: int) -> float:
    """XADD ``n`` requests in pipelines of 1,000; returns the seconds it took."""
    sender = Sender(conn, spec.prefix, spec.model, spec.inputs, spec.seed)
    started = time.monotonic()
    for first in range(0, n, 1000):
        pipe = conn.pipeline(transaction=False)
        for i in range(first, min(first + 1000, n)):
            body = sender.bodies[i % len(sender.bodies)]
            pipe.xadd(sender.stream, submission.Submission(_drain_rid(i), body).fields())
        pipe.execute()
    return time.monotonic() - started


def _wait_drained(conn: redis.Redis, spec: LoadSpec, pid: int, limit_s: float) -> int:
    """Poll until the stream is empty (entries are deleted when answered); returns the highest
    VmRSS sampled meanwhile, in KiB."""
    stream = keys.request_stream(spec.prefix, spec.model)
    deadline = time.monotonic() + limit_s
    highest = 0
    while conn.xlen(stream):
        highest = max(highest, memory_kib(pid)["VmRSS"])
        if time.monotonic() > deadline:
            raise BenchError(f"the worker did not drain the backlog within {limit_s:g} s")
        time.sleep(POLL_S)
    return highest


def _collect(conn: redis.Redis, spec: LoadSpec, n: int) -> ProducerTally:
    """Pop the ``n`` drain replies in pipelines of 2,000; missing ones count as lost."""
    tally = ProducerTally()
    for first in range(0, n, 2000):
        rids = [_drain_rid(i) for i in range(first, min(first + 2000, n))]
        pipe = conn.pipeline(transaction=False)
        for rid in rids:
            pipe.lpop(keys.reply_key(spec.prefix, spec.model, rid))
        for rid, raw in zip(rids, pipe.execute(), strict=True):
            if raw is None:
                tally.lost += 1
                continue
            result = results.parse_reply(rid, raw)
            tally.codes[result.error.code if result.error else "OK"] += 1
            if result.ok and result.batch_rows is not None:
                tally.batch_rows.append(int(result.batch_rows))
    return tally
