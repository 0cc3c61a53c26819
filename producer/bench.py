"""``redbatch bench``: a fixed load test of the workers, every figure set against its ceiling.

The producer never imports the worker or onnxruntime, so the bench orchestrates processes:

- ``python -m worker`` workers it starts from a generated config (metrics port on), or workers
  already serving (``--no-start``);
- ``python -m worker.benchkit``: model files, and the ceilings measured in the same run (bare
  ``session.run``, the Redis protocol alone, an in-process asyncio batcher), each as JSON;
- producer processes (``multiprocessing``, spawn) that drive the load: closed loop (C callers,
  one reply in, one request out) or open loop (Poisson or bursty arrivals at a rate), pipelining
  submits and waiting on many reply keys per round trip.

A phase is one load against one worker configuration: ``warmup_s`` of load, then ``duration_s``
measured. Throughput counts replies that arrived in the measured window; latency is per request
sent in it, from the send (closed loop) or the scheduled arrival (open loop, so a late sender
cannot hide queueing) to the reply. The worker's ``/metrics`` histograms are scraped at the
window's start and end and diffed, which says where the time went on the worker's side.

Scenarios are fixed presets (``SCENARIOS``); ``targets`` compares them with the goals of the
performance issue. ``format_report`` is the table, ``plot`` the latency-throughput chart.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import os
import platform
import resource
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import redis

from producer import core, keys
from producer.errors import RedbatchError, WaitTimeout

__all__ = [
    "SCENARIOS",
    "BenchError",
    "LoadResult",
    "LoadSpec",
    "ProducerTally",
    "add_arguments",
    "arrivals",
    "format_report",
    "input_rows",
    "percentiles",
    "plot",
    "run_command",
    "run_load",
    "targets",
    "worker_view",
]

HELP = """\
Load-test redbatch workers and set every figure against its ceiling, measured in the same run:
throughput, end-to-end latency percentiles (p50, p90, p99, p99.9), the batch-rows histogram,
where each request's time goes on the worker (from its /metrics histograms), bare
session.run rows/s at the same batch sizes, the Redis protocol alone, and an in-process asyncio
batcher. Prints a table; --json writes the full report, --plot a latency-throughput chart.

By default the bench starts a private redis-server on a free loopback port and its own workers
(python -m worker) with synthetic models; with --redis-url it starts them on that Redis instead;
with --no-start it drives the workers already serving --model there (REDIS_URL or the top-level
--redis-url count only then, so a bench never floods a shared Redis by accident).

scenarios (--scenario NAME[,NAME], or all; each fixed so runs compare):
{scenarios}

Without --scenario it runs a custom load: --model with --concurrency (closed loop) and/or
--rate (open loop, --arrivals poisson or bursty); several values make a sweep for --plot.

examples:
  redbatch bench --scenario all --json docs/bench.json --plot docs/latency-throughput.png
  redbatch bench --scenario all --quiet-s 60      # on a shared host: wait for idle cores
  redbatch bench --scenario heavy-closed --duration-s 5
  redbatch bench --model tiny --concurrency 1,4,16,64 --plot tiny.png
  redbatch bench --model heavy --rate 1000,2000,4000 --arrivals bursty --burst-size 8
  redbatch bench --no-start --redis-url redis://127.0.0.1:6379/0 --model demo \\
      --concurrency 64 --metrics-url http://127.0.0.1:9100/metrics
"""

#: Closed-loop callers in the presets, and requests in flight for the protocol-only ceiling.
CALLERS = 64
#: The Celery figure from the performance issue: 210 to 260 requests/s on the heavy model.
CELERY_REQUESTS_PER_S = (210.0, 260.0)
#: The issue's in-process asyncio batcher on the heavy model, on these 2 cores.
ISSUE_ASYNCIO_REQUESTS_PER_S = 6000.0
_PREFIX = "rbbench"
_PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9))
_BODIES = 64  # distinct request bodies a producer cycles through
_SEND_QUANTUM_S = 0.001  # an open-loop sender wakes at most this often; arrivals due go together
_MAX_WAIT_KEYS = 1024  # reply keys per BLPOP or sweep; replies come back roughly oldest first
_MAX_REQUESTS = 2_000_000  # per phase and producer: rate * seconds must stay under it
_WORKER_START_S = 180.0
_POLL_S = 0.02  # readiness and drain polls: a started process gives no event to wait on
_QUIET_CORES = 0.25  # --quiet-s: busier than this, and someone else is using the machine


class BenchError(RedbatchError):
    """Raised when a benchmark cannot run: a process it started failed, or did not answer."""


# ---------------------------------------------------------------------------------------------
# Requests and arrivals


def input_rows(specs: Sequence[dict[str, Any]], rows: int, seed: int) -> dict[str, np.ndarray]:
    """Arrays of ``rows`` rows for inputs described as in a worker record (name, dtype, shape).

    Free non-batch dimensions are 1; floats are standard normal clipped to the input's min/max,
    integers and booleans are zero (or the input's min).
    """
    rng = np.random.default_rng(seed)
    arrays = {}
    for spec in specs:
        shape = [rows] + [d if isinstance(d, int) and d > 0 else 1 for d in spec["shape"][1:]]
        dtype = np.dtype(spec["dtype"])
        low, high = spec.get("min"), spec.get("max")
        if dtype.kind == "f":
            values = rng.standard_normal(shape)
            if low is not None or high is not None:
                values = np.clip(values, low, high)
            arrays[spec["name"]] = values.astype(dtype)
        else:
            arrays[spec["name"]] = np.full(shape, low or 0, dtype=dtype)
    return arrays


def arrivals(rate_per_s: float, duration_s: float, seed: int, *, burst_size: int = 1) -> np.ndarray:
    """Send times in seconds from the start: Poisson at ``rate_per_s`` requests per second, or,
    with ``burst_size`` > 1, bursts of that many requests arriving as a Poisson process."""
    if rate_per_s * duration_s > _MAX_REQUESTS:
        raise ValueError(f"rate {rate_per_s:g}/s for {duration_s:g} s is over {_MAX_REQUESTS}.")
    rng = np.random.default_rng(seed)
    events_per_s = rate_per_s / burst_size
    expected = events_per_s * duration_s
    gaps = rng.exponential(1.0 / events_per_s, size=int(expected + 6 * expected**0.5 + 16))
    times = np.cumsum(gaps)
    return np.repeat(times[times < duration_s], burst_size)


# ---------------------------------------------------------------------------------------------
# Statistics


def percentiles(values_ms: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99, p99.9, mean and max (empty when there are no values)."""
    if len(values_ms) == 0:
        return {}
    values = np.asarray(values_ms, dtype=np.float64)
    stats = np.percentile(values, [q for _, q in _PERCENTILES])
    result = {name: float(v) for (name, _), v in zip(_PERCENTILES, stats, strict=True)}
    result["mean"] = float(values.mean())
    result["max"] = float(values.max())
    return result


def _counts(values: Sequence[int]) -> dict[str, int]:
    """How often each value occurs, by value."""
    return {str(v): n for v, n in sorted(Counter(int(v) for v in values).items())}


# ---------------------------------------------------------------------------------------------
# The load a producer process drives


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """One phase's load, as one producer process (or all of them together) drives it."""

    url: str
    prefix: str
    model: str
    inputs: tuple[dict[str, Any], ...] | list[dict[str, Any]]
    mode: str = "closed"  # closed, poisson or bursty
    concurrency: int = CALLERS
    rate_per_s: float = 0.0
    burst_size: int = 16
    duration_s: float = 3.0
    warmup_s: float = 0.5
    timeout_s: float = 30.0
    seed: int = 0

    def share(self, index: int, producers: int) -> LoadSpec:
        """Producer ``index``'s part: its callers, or its share of the rate, and its own seed."""
        callers = self.concurrency // producers + (index < self.concurrency % producers)
        return replace(
            self,
            concurrency=callers,
            rate_per_s=self.rate_per_s / producers,
            seed=self.seed * 1000 + index,
        )

    def label(self) -> str:
        if self.mode == "closed":
            return f"closed C={self.concurrency}"
        burst = f" x{self.burst_size}" if self.mode == "bursty" else ""
        return f"{self.mode} {self.rate_per_s:,.0f}/s{burst}"


@dataclass(slots=True)
class ProducerTally:
    """What one producer process measured. Requests count when sent in the measured window."""

    latencies_ms: list[float] = field(default_factory=list)
    batch_rows: list[int] = field(default_factory=list)  # per successful request
    codes: Counter[str] = field(default_factory=Counter)
    completed_in_window: int = 0  # replies that arrived in the window, whenever sent
    sent: int = 0  # every request sent, warmup included
    lost: int = 0  # no reply within timeout_s
    cpu_s: float = 0.0
    max_send_lag_ms: float = 0.0  # how far an open-loop sender fell behind its schedule


@dataclass(slots=True)
class LoadResult:
    """All producers' tallies for one phase."""

    spec: LoadSpec
    producers: int
    tallies: list[ProducerTally]

    def summary(self) -> dict[str, Any]:
        latencies = [v for t in self.tallies for v in t.latencies_ms]
        rows = [v for t in self.tallies for v in t.batch_rows]
        codes: Counter[str] = sum((t.codes for t in self.tallies), Counter())
        completed = sum(t.completed_in_window for t in self.tallies)
        sent = sum(t.sent for t in self.tallies)
        cpu_s = sum(t.cpu_s for t in self.tallies)
        return {
            "requests": len(latencies),
            "ok": codes.get("OK", 0),
            "errors": {c: n for c, n in codes.items() if c != "OK"},
            "lost": sum(t.lost for t in self.tallies),
            "throughput_per_s": completed / self.spec.duration_s,
            "latency_ms": percentiles(latencies),
            "batch_rows": {
                "mean": float(np.mean(rows)) if rows else 0.0,
                "histogram": _counts(rows),
            },
            "producer": {
                "processes": self.producers,
                "cpu_ms_per_request": 1000.0 * cpu_s / sent if sent else 0.0,
                "max_send_lag_ms": max(t.max_send_lag_ms for t in self.tallies),
            },
        }


# LPOP of many keys in one command: a pipeline of LPOPs costs the producer about 10 us of
# redis-py work per key, and the sweep looks at every awaited key.
_POP_ALL_LUA = """
local popped = {}
for i, key in ipairs(KEYS) do
  popped[i] = redis.call('LPOP', key)
end
return popped
"""


class _Replies:
    """The replies one producer awaits, oldest first, each with its reference time.

    A load generator needs only each reply's outcome and batch rows, so it reads those two
    fields (``_outcome``) instead of decoding the outputs as ``Client`` does: every CPU
    millisecond it spends is one the worker and Redis do not get on the same cores.
    """

    def __init__(self, conn: redis.Redis, spec: LoadSpec, tally: ProducerTally, window: Any):
        self.conn = conn
        self.prefix = spec.prefix
        self.timeout_s = spec.timeout_s
        self.tally = tally
        self.w0, self.w1 = window
        # reply key -> (reference time, send time); dicts keep insertion (send) order
        self._awaited: dict[bytes, tuple[float, float]] = {}
        self._pop_all = conn.register_script(_POP_ALL_LUA)

    @property
    def in_flight(self) -> int:
        return len(self._awaited)

    def add(self, rid: str, t_ref: float, sent: float) -> None:
        self._awaited[keys.reply_key(self.prefix, rid).encode()] = (t_ref, sent)

    def round(self, take_new: Callable[[], None] | None = None) -> None:
        """Block for one reply, then sweep up every other reply ready; ``take_new()`` adds the
        requests sent meanwhile first, so replies written in the same batch are swept too.

        WaitTimeout when the oldest request has waited ``timeout_s``.
        """
        oldest_sent = next(iter(self._awaited.values()))[1]
        left_s = oldest_sent + self.timeout_s - time.monotonic()
        if left_s <= 0:
            raise WaitTimeout(f"no reply within {self.timeout_s:g} s")
        keys_ = list(itertools.islice(self._awaited, _MAX_WAIT_KEYS))
        block_s = max(round(min(left_s, core.MAX_BLOCK_S), 3), 0.001)
        item = self.conn.blpop(keys_, block_s)
        if item is None:
            return
        self._record([(core.as_bytes(item[0]), core.as_bytes(item[1]))], time.monotonic())
        if take_new is not None:
            take_new()
        if self._awaited:
            keys_ = list(itertools.islice(self._awaited, _MAX_WAIT_KEYS))
            raws = self._pop_all(keys=keys_)
            now = time.monotonic()
            self._record([(k, r) for k, r in zip(keys_, raws, strict=True) if r is not None], now)

    def _record(self, popped: Sequence[tuple[bytes, bytes]], now: float) -> None:
        tally = self.tally
        if self.w0 <= now < self.w1:
            tally.completed_in_window += len(popped)
        for key, raw in popped:
            t_ref, _ = self._awaited.pop(key)
            if not self.w0 <= t_ref < self.w1:
                continue
            code, batch_rows = _outcome(raw)
            tally.latencies_ms.append((now - t_ref) * 1000.0)
            tally.codes[code] += 1
            if batch_rows is not None:
                tally.batch_rows.append(batch_rows)

    def give_up(self) -> None:
        """Count what is still awaited as lost."""
        self.tally.lost += self.in_flight
        self._awaited.clear()


def _outcome(raw: bytes) -> tuple[str, int | None]:
    """A reply's code (OK, or its error's) and, when ok, its batch rows (protocol section 3)."""
    try:
        doc = msgpack.unpackb(raw, raw=False)
        if doc["ok"]:
            return "OK", int(doc["batch_rows"])
        return str(doc["error"]["code"]), None
    except (ValueError, TypeError, KeyError, msgpack.UnpackException):
        return "BAD_REPLY", None


class _Sender:
    """Pipelined XADDs of bodies encoded once, under fresh rids (a random tag and a count)."""

    def __init__(self, conn: redis.Redis, spec: LoadSpec) -> None:
        self.conn = conn
        self.stream = keys.request_stream(spec.prefix, spec.model)
        self.bodies = [
            core.build_submission(input_rows(spec.inputs, 1, spec.seed + i), now_s=0.0).body
            for i in range(_BODIES)
        ]
        self._tag = uuid.uuid4().hex[:12]
        self._next = 0
        self._pipe = conn.pipeline(transaction=False)

    def rids(self, n: int) -> list[str]:
        """Queue ``n`` requests for the next ``send()``; returns their rids."""
        rids = []
        for _ in range(n):
            rid = f"{self._tag}-{self._next}"
            body = self.bodies[self._next % _BODIES]
            self._next += 1
            self._pipe.xadd(self.stream, core.Submission(rid, body).fields())
            rids.append(rid)
        return rids

    def send(self) -> None:
        """Send the queued requests in one round trip."""
        self._pipe.execute()


def _closed_loop(spec: LoadSpec, conn: redis.Redis, tally: ProducerTally, t0: float) -> None:
    """C callers: every reply is answered at once by a new request, until the window ends."""
    w1 = t0 + spec.warmup_s + spec.duration_s
    replies = _Replies(conn, spec, tally, (t0 + spec.warmup_s, w1))
    sender = _Sender(conn, spec)
    try:
        while True:
            now = time.monotonic()
            want = spec.concurrency - replies.in_flight if now < w1 else 0
            if want > 0:
                for rid in sender.rids(want):
                    replies.add(rid, now, now)
                sender.send()
                tally.sent += want
            if not replies.in_flight:
                return
            replies.round()
    except WaitTimeout:
        replies.give_up()


class _Inbox:
    """Requests the open-loop sender has sent and the receiver has not taken up yet."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.items: list[tuple[str, float, float]] = []  # rid, scheduled time, send time
        self.done = False

    def put(self, rids: Sequence[str], scheduled: np.ndarray, sent: float) -> None:
        with self.cond:
            self.items += [(rid, float(t), sent) for rid, t in zip(rids, scheduled, strict=True)]
            self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify()


def _open_loop(spec: LoadSpec, conn: redis.Redis, tally: ProducerTally, t0: float) -> None:
    """Requests at scheduled times whatever the replies do; a second thread takes the replies.

    The receiver blocks on the reply keys it knows. It learns of newer requests each time a
    reply wakes it, before it sweeps, which is soon enough because a worker answers a stream in
    order: a newer request's reply comes with or after an older one's. (With several workers
    a reply can wait behind an older one for up to a batch.) With nothing awaited it waits for
    the sender on a condition instead.
    """
    w0, w1 = t0 + spec.warmup_s, t0 + spec.warmup_s + spec.duration_s
    burst = spec.burst_size if spec.mode == "bursty" else 1
    times = t0 + arrivals(spec.rate_per_s, w1 - t0, spec.seed, burst_size=burst)
    recv_conn = redis.Redis(connection_pool=conn.connection_pool)  # its own connection
    replies = _Replies(recv_conn, spec, tally, (w0, w1))
    inbox = _Inbox()
    failure: list[BaseException] = []
    receiver = threading.Thread(
        target=_receive, args=(replies, inbox, failure), name="replies", daemon=True
    )
    receiver.start()
    sender = _Sender(conn, spec)
    try:
        i = 0
        while i < len(times) and not failure:
            now = time.monotonic()
            if times[i] > now:
                time.sleep(max(float(times[i]) - now, _SEND_QUANTUM_S))
                now = time.monotonic()
            j = int(np.searchsorted(times, now, side="right"))
            due = times[i:j]
            tally.max_send_lag_ms = max(tally.max_send_lag_ms, (now - float(due[0])) * 1000.0)
            tally.sent += len(due)
            inbox.put(sender.rids(len(due)), due, now)
            sender.send()
            i = j
    finally:
        inbox.close()
        receiver.join(timeout=spec.timeout_s + 10)
    if failure:
        raise failure[0]


def _receive(replies: _Replies, inbox: _Inbox, failure: list[BaseException]) -> None:
    def take_new() -> None:
        with inbox.cond:
            for rid, t_ref, sent in inbox.items:
                replies.add(rid, t_ref, sent)
            inbox.items.clear()

    try:
        while True:
            take_new()
            if not replies.in_flight:
                with inbox.cond:
                    if inbox.done and not inbox.items:
                        return
                    if not inbox.items:
                        inbox.cond.wait(0.1)
                continue
            try:
                replies.round(take_new)
            except WaitTimeout:
                replies.give_up()
                failure.append(BenchError("replies stopped coming; see the phase's lost count"))
                return
    except BaseException as exc:  # handed to the sender's thread, which raises it
        failure.append(exc)


def _producer_main(spec: LoadSpec, conn: Any) -> None:
    """A producer process: connect, say ready, wait for the start time, drive, send the tally."""
    try:
        client = redis.Redis.from_url(spec.url, decode_responses=False, socket_timeout=30)
        client.ping()
        conn.send(("ready", None))
        t0 = conn.recv()
        tally = ProducerTally()
        cpu0 = time.process_time()
        time.sleep(max(t0 - time.monotonic(), 0.0))
        if spec.concurrency or spec.mode != "closed":
            drive = _closed_loop if spec.mode == "closed" else _open_loop
            drive(spec, client, tally, t0)
        tally.cpu_s = time.process_time() - cpu0
        client.close()
        conn.send(("done", tally))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _spawn(target: Callable[..., None], args_list: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Start one spawned process per args; returns (process, pipe) pairs, each said ready."""
    ctx = multiprocessing.get_context("spawn")
    started = []
    for args in args_list:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(*args, child), daemon=True)
        proc.start()
        child.close()
        started.append((proc, parent))
    for _, pipe in started:
        _expect(pipe, "ready", 120.0)
    return started


def _expect(pipe: Any, what: str, timeout_s: float) -> Any:
    if not pipe.poll(timeout_s):
        raise BenchError(f"a producer process did not report {what} within {timeout_s:g} s")
    try:
        kind, value = pipe.recv()
    except EOFError:
        raise BenchError("a producer process exited without reporting") from None
    if kind == "error":
        raise BenchError(f"a producer process failed:\n{value}")
    return value


def run_load(
    spec: LoadSpec, producers: int = 1, probe: Callable[[list[int]], Any] | None = None
) -> tuple[LoadResult, Any, Any]:
    """Drive ``spec`` from ``producers`` processes; ``probe(producer_pids)`` runs at the
    window's start and end (metrics, CPU). Returns the result and the two probes."""
    if spec.mode not in ("closed", "poisson", "bursty"):
        raise ValueError(f"load mode must be closed, poisson or bursty, not {spec.mode!r}")
    started = _spawn(_producer_main, [(spec.share(i, producers),) for i in range(producers)])
    try:
        t0 = time.monotonic() + 0.1
        for _, pipe in started:
            pipe.send(t0)
        before = after = None
        if probe is not None:
            pids = [proc.pid for proc, _ in started]
            time.sleep(max(t0 + spec.warmup_s - time.monotonic(), 0.0))
            before = probe(pids)
            time.sleep(max(t0 + spec.warmup_s + spec.duration_s - time.monotonic(), 0.0))
            after = probe(pids)
        limit_s = spec.warmup_s + spec.duration_s + spec.timeout_s + 60
        tallies = [_expect(pipe, "its tally", limit_s) for _, pipe in started]
    finally:
        for proc, pipe in started:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
            pipe.close()
    return LoadResult(spec, producers, tallies), before, after


# ---------------------------------------------------------------------------------------------
# The worker's own timings (its /metrics histograms)

_STAGE_ORDER = ("queue_wait", "read", "decode_validate", "batch_assembly", "inference")
_STAGE_LAST = ("reply_encode", "reply_write")


def scrape(urls: Sequence[str]) -> dict[str, float]:
    """Every sample of the workers' /metrics, by name and labels, summed over ``urls``."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except (OSError, urllib.error.URLError) as exc:
            raise BenchError(f"cannot read worker metrics at {url}: {exc}") from exc
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                name = f"{s.name}{{{labels}}}" if labels else s.name
                samples[name] = samples.get(name, 0.0) + s.value
    return samples


def worker_view(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the worker saw between two scrapes: requests, runs, batch rows, and per stage the
    observations and the mean time per observation and per request."""
    diff = {k: v - before.get(k, 0.0) for k, v in after.items()}
    requests = sum(v for k, v in diff.items() if k.startswith("redbatch_requests_total{"))
    runs = diff.get("redbatch_batch_rows_count", 0.0)
    buckets: dict[str, float] = {}
    below = 0.0
    bounds = sorted(
        (float(k.split("le=")[1].rstrip("}")), v)
        for k, v in diff.items()
        if k.startswith("redbatch_batch_rows_bucket{")
    )
    for bound, cumulative in bounds:
        if cumulative - below:
            buckets["+Inf" if bound == float("inf") else f"<={bound:g}"] = cumulative - below
        below = cumulative
    names = [k[len("redbatch_") : -len("_seconds_count")] for k in diff if _is_stage_count(k)]
    known = (*_STAGE_ORDER, *_STAGE_LAST)
    first = [n for n in _STAGE_ORDER if n in names]
    last = [n for n in _STAGE_LAST if n in names]
    stages = {}
    for name in (*first, *sorted(n for n in names if n not in known), *last):
        count = diff[f"redbatch_{name}_seconds_count"]
        total_s = diff.get(f"redbatch_{name}_seconds_sum", 0.0)
        stages[name] = {
            "count": int(count),
            "mean_ms": 1000.0 * total_s / count if count else 0.0,
            "per_request_ms": 1000.0 * total_s / requests if requests else 0.0,
        }
    return {
        "requests": int(requests),
        "runs": int(runs),
        "mean_batch_rows": diff.get("redbatch_batch_rows_sum", 0.0) / runs if runs else 0.0,
        "batch_rows_histogram": {k: int(v) for k, v in buckets.items()},
        "stages": stages,
    }


def _is_stage_count(key: str) -> bool:
    return key.startswith("redbatch_") and key.endswith("_seconds_count") and "{" not in key


# ---------------------------------------------------------------------------------------------
# Who used the cores: these machines are shared, and a busy neighbour moves every figure

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_sample(conn: redis.Redis, pids: dict[str, Sequence[int]]) -> dict[str, float]:
    """CPU seconds used so far by the whole machine (busy time, all cores), by Redis (its INFO),
    and by each named group of local processes; ``t`` is the monotonic time."""
    sample = {"t": time.monotonic(), "machine": _machine_busy_s()}
    info = conn.info("cpu")
    sample["redis"] = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    for name, group in pids.items():
        sample[name] = sum(_process_cpu_s(pid) for pid in group)
    return sample


def cpu_cores(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Cores busy between two samples, by user; ``other`` is the machine less all of them (a
    neighbour, or a Redis that is not on this machine when negative)."""
    elapsed_s = after["t"] - before["t"]
    cores = {k: (after[k] - before[k]) / elapsed_s for k in after if k != "t"}
    cores["other"] = cores["machine"] - sum(v for k, v in cores.items() if k != "machine")
    return cores


def _machine_busy_s() -> float:
    with open("/proc/stat", encoding="ascii") as fh:
        fields = [int(v) for v in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait; guest time is already in user
    return (sum(fields[:8]) - idle) * _TICK_S


def _process_cpu_s(pid: int) -> float:
    """User and system CPU seconds of one process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            after_name = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(after_name[11]) + int(after_name[12])) * _TICK_S


# ---------------------------------------------------------------------------------------------
# Processes the bench starts


def _flags(**options: object) -> list[str]:
    """Command-line flags from keyword arguments: ``model_file=p`` is ``--model-file p``."""
    return [a for k, v in options.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def _benchkit(*args: str, timeout_s: float, redis_url: str | None = None) -> dict[str, Any]:
    """Run ``python -m worker.benchkit ARGS`` and return the JSON it prints; ``redis_url``
    goes in the environment, where no process listing shows its password."""
    command = [sys.executable, "-m", "worker.benchkit", *args]
    env = {**os.environ, "REDIS_URL": redis_url} if redis_url else None
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False, env=env
        )
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"{shlex.join(command)} ran over {timeout_s:g} s") from exc
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise BenchError(f"{shlex.join(command)} failed (exit {done.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@contextlib.contextmanager
def _private_redis() -> Iterator[str]:
    """A redis-server on a free loopback port, via ``benchkit redis``; stopped on exit."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.benchkit", "redis"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    assert proc.stderr is not None
    try:
        line = proc.stdout.readline()
        if not line:
            raise BenchError(f"could not start redis-server: {proc.stderr.read().strip()}")
        yield str(json.loads(line)["url"])
    finally:
        proc.stdin.close()  # benchkit stops the server when its stdin closes
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(timeout=10)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak) of a process, in KiB, from /proc/PID/status."""
    values = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0])
    return values


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    """What a started worker serves: a synthetic model under a name, and its batching."""

    model: str
    max_batch_size: int = 32
    max_wait_ms: float = 5.0
    name: str = ""  # the served model name; the synthetic model's name when empty

    @property
    def served(self) -> str:
        return self.name or self.model


class WorkerProcess:
    """One ``python -m worker`` process with a generated config, its metrics port on."""

    def __init__(self, setup: WorkerSetup, model_file: Path, url: str, workdir: Path) -> None:
        self.setup = setup
        self.url = url
        self.port = _free_port()
        self.name = f"bench-{setup.served}-{setup.max_batch_size}-{uuid.uuid4().hex[:6]}"
        self.config = workdir / f"{self.name}.toml"
        self.log = workdir / f"{self.name}.log"
        self.config.write_text(
            f"""[redis]
url = "{url}"
prefix = "{_PREFIX}"

[model]
name = "{setup.served}"
path = "{model_file}"
version = "bench"
providers = ["cpu"]

[batching]
max_batch_size = {setup.max_batch_size}
max_wait_ms = {setup.max_wait_ms}

[delivery]
reply_ttl_s = 600

[metrics]
port = {self.port}
""",
            encoding="utf-8",
        )
        self._proc: subprocess.Popen[bytes] | None = None
        self.record: dict[str, Any] = {}

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self) -> WorkerProcess:
        """Start the worker and return once /readyz says it reads the stream."""
        command = [sys.executable, "-m", "worker", "--config", str(self.config)]
        # REDIS_URL overrides the config's redis.url: set it, so that a REDIS_URL in the
        # caller's environment cannot point the bench's workers at another Redis.
        env = {**os.environ, "REDIS_URL": self.url}
        with self.log.open("wb") as log:
            self._proc = subprocess.Popen(
                [*command, "--name", self.name, "--log-level", "WARNING"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + _WORKER_START_S
        while not self._ready():
            if self._proc.poll() is not None:
                raise BenchError(f"worker exited at start:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise BenchError(f"worker not ready within {_WORKER_START_S:g} s")
            time.sleep(_POLL_S)
        self.record = _worker_records(self.url, _PREFIX, self.setup.served, self.name)[0]
        return self

    def _ready(self) -> bool:
        url = f"http://127.0.0.1:{self.port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def _log_tail(self) -> str:
        lines = self.log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        return "\n".join(lines[-15:])

    def stop(self) -> None:
        """SIGTERM (the worker answers what it holds), then wait; SIGKILL after 30 s."""
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None


def _worker_records(
    url: str, prefix: str, model: str, name: str | None = None
) -> list[dict[str, Any]]:
    """The live workers' validation records for ``model`` (only ``name``'s when given)."""
    from producer.client import Client

    with Client(model, url, prefix=prefix) as client:
        records = [r for r in client.workers() if name is None or r.get("name") == name]
    if not records:
        raise BenchError(f"no live worker record for model {model!r}")
    return records


class _Workers:
    """At most one started worker at a time, kept while the next phase wants the same setup."""

    def __init__(self, url: str, workdir: Path, model_file: Callable[[str], Path]) -> None:
        self.url, self.workdir, self.model_file = url, workdir, model_file
        self.current: WorkerProcess | None = None

    def get(self, setup: WorkerSetup) -> WorkerProcess:
        if self.current is not None and self.current.setup == setup:
            return self.current
        self.stop()
        _say(f"starting a worker: {setup.model}, max_batch_size {setup.max_batch_size}")
        worker = WorkerProcess(setup, self.model_file(setup.model), self.url, self.workdir)
        self.current = worker.start()
        return worker

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


def _say(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# A bench run: its settings, ceilings, phases and report


@dataclass(frozen=True, slots=True)
class Options:
    """A run's settings, read once from the command line."""

    scenarios: tuple[str, ...] = ()
    duration_s: float = 3.0
    warmup_s: float = 0.5
    producers: int = 1
    timeout_s: float = 30.0
    drain_requests: int = 100_000
    max_wait_ms: float = 5.0
    model: str = "tiny"
    concurrency: tuple[int, ...] = ()
    rates: tuple[float, ...] = ()
    arrivals: str = "poisson"
    burst_size: int = 16
    max_batch_size: int = 32
    ceilings: bool = True
    no_start: bool = False
    metrics_urls: tuple[str, ...] = ()
    model_file: str | None = None
    prefix: str = keys.DEFAULT_PREFIX
    quiet_s: float = 0.0


class Bench:
    """One run: builds models, measures ceilings, runs phases, and keeps the report."""

    def __init__(self, options: Options, url: str, workdir: Path) -> None:
        self.o = options
        self.url = url
        self.workdir = workdir
        self._models: dict[str, Path] = {}
        self.workers = _Workers(url, workdir, self.model_file)
        self.max_throughput: dict[WorkerSetup, float] = {}
        settings = asdict(options)
        settings["redis"] = core.redact_url(url)
        self.report: dict[str, Any] = {
            "redbatch_bench": 1,
            "command": _command_line(),
            "started_at": _utc_now(),
            "machine": _machine(url),
            "source": _source(),
            "settings": settings,
            "ceilings": {"bare": {}, "protocol": {}, "asyncio": {}},
            "phases": [],
            "drain": None,
            "targets": [],
        }

    # -- models and ceilings ----------------------------------------------------------------

    def model_file(self, name: str) -> Path:
        """The synthetic model ``name``, built once per run by ``benchkit build``."""
        if name not in self._models:
            path = self.workdir / f"{name}.onnx"
            _benchkit("build", name, str(path), timeout_s=300)
            self._models[name] = path
        return self._models[name]

    @property
    def _ceiling_s(self) -> float:
        return max(self.o.duration_s / 2, 0.5)

    def bare(self, model: str, sizes: Sequence[int], model_file: Path | None = None) -> None:
        _say(f"ceiling: bare session.run, {model}, batch {', '.join(map(str, sizes))}")
        path = model_file or self.model_file(model)
        result = self._ceiling(
            "bare",
            *_flags(
                model_file=path, batch_sizes=",".join(map(str, sizes)), duration_s=self._ceiling_s
            ),
            timeout_s=120 + 4 * self._ceiling_s * len(sizes),
        )
        known = self.report["ceilings"]["bare"].setdefault(model, result)
        known["batch"].update(result["batch"])
        self.report["machine"].setdefault("onnxruntime", result["onnxruntime"])
        self.report["machine"].setdefault("providers", result["providers"])

    def protocol(self, model: str, source: tuple[str, str], max_batch_size: int) -> None:
        """The Redis protocol alone, with ``model``'s request and reply sizes; ``source`` is
        ``("--model-file", PATH)`` or ``("--specs", JSON_PATH)``."""
        _say(f"ceiling: Redis protocol alone, {model}-sized requests, {CALLERS} in flight")
        flags = _flags(
            prefix=f"{_PREFIX}-protocol",
            concurrency=CALLERS,
            max_batch_size=max_batch_size,
            producers=self.o.producers,
            duration_s=self.o.duration_s,
            warmup_s=self.o.warmup_s,
        )
        timeout_s = 180 + self.o.duration_s + self.o.timeout_s
        result = self._ceiling("protocol", *source, *flags, timeout_s=timeout_s)
        self.report["ceilings"]["protocol"][model] = result

    def asyncio_batcher(self, model: str) -> None:
        _say(f"ceiling: in-process asyncio batcher, {model}, {CALLERS} callers")
        flags = _flags(
            model_file=self.model_file(model),
            callers=CALLERS,
            max_batch_size=32,
            window_ms=10,
            duration_s=self.o.duration_s,
            warmup_s=self.o.warmup_s,
        )
        result = self._ceiling("asyncio", *flags, timeout_s=120 + self.o.duration_s)
        self.report["ceilings"]["asyncio"][model] = result

    def _ceiling(self, *args: str, timeout_s: float) -> dict[str, Any]:
        """A ``benchkit`` measurement, with the cores it, Redis and anything else used."""
        self.wait_for_quiet()
        conn = redis.Redis.from_url(self.url, socket_timeout=10)
        try:
            before = cpu_sample(conn, {})
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            result = _benchkit(*args, timeout_s=timeout_s, redis_url=self.url)
            after = cpu_sample(conn, {})
            done = resource.getrusage(resource.RUSAGE_CHILDREN)
        finally:
            conn.close()
        used_s = done.ru_utime + done.ru_stime - children.ru_utime - children.ru_stime
        after["benchkit"], before["benchkit"] = used_s, 0.0
        result["cpu_cores"] = cpu_cores(before, after)
        return result

    def wait_for_quiet(self) -> None:
        """With ``--quiet-s``: wait, at most that long, until the machine's cores are idle
        (under ``_QUIET_CORES`` busy over half a second, an idle worker included)."""
        deadline = time.monotonic() + self.o.quiet_s
        said = False
        while self.o.quiet_s:
            before = _machine_busy_s()
            time.sleep(0.5)
            busy = (_machine_busy_s() - before) / 0.5
            if busy < _QUIET_CORES:
                return
            if time.monotonic() > deadline:
                _say(f"the machine is still busy ({busy:.2f} cores); measuring anyway")
                return
            if not said:
                _say(f"waiting for the machine to go quiet ({busy:.2f} cores busy)")
                said = True

    # -- phases -----------------------------------------------------------------------------

    def phase(
        self,
        phase_id: str,
        setup: WorkerSetup,
        load: dict[str, Any],
        series: str | None = None,
    ) -> dict[str, Any]:
        """Run ``load`` against a started worker serving ``setup``; returns the phase."""
        worker = self.workers.get(setup)
        self.report["machine"].setdefault("onnxruntime", worker.record["runtime"]["onnxruntime"])
        spec = self.load_spec(_PREFIX, setup.served, worker.record["inputs"], load)
        urls = [worker.metrics_url]
        phase = self._measure(phase_id, spec, setup.model, worker.record, urls, [worker.pid])
        phase["series"] = series
        if spec.mode == "closed" and spec.concurrency >= CALLERS:
            self.max_throughput[setup] = phase["throughput_per_s"]
        return phase

    def load_spec(self, prefix: str, served: str, inputs: Any, load: dict[str, Any]) -> LoadSpec:
        o = self.o
        return LoadSpec(
            url=self.url,
            prefix=prefix,
            model=served,
            inputs=inputs,
            duration_s=o.duration_s,
            warmup_s=o.warmup_s,
            timeout_s=o.timeout_s,
            **load,
        )

    def _measure(
        self,
        phase_id: str,
        spec: LoadSpec,
        model: str,
        record: dict[str, Any],
        metrics_urls: Sequence[str],
        worker_pids: Sequence[int] = (),
    ) -> dict[str, Any]:
        self.wait_for_quiet()
        _say(f"{phase_id}: {spec.label()} for {spec.warmup_s:g} + {spec.duration_s:g} s")
        conn = redis.Redis.from_url(self.url, socket_timeout=10)

        def probe(producer_pids: list[int]) -> tuple[dict[str, float], dict[str, float]]:
            pids = {"producers": producer_pids, "worker": worker_pids}
            metrics = scrape(metrics_urls) if metrics_urls else {}
            return metrics, cpu_sample(conn, pids)

        try:
            result, before, after = run_load(spec, self.o.producers, probe)
        finally:
            conn.close()
        batching = record["batching"]
        phase: dict[str, Any] = {
            "id": phase_id,
            "model": model,
            "worker": {
                "max_batch_size": batching["max_batch_size"],
                "max_wait_ms": batching["max_wait_ms"],
            },
            "load": {
                "mode": spec.mode,
                "label": spec.label(),
                "concurrency": spec.concurrency if spec.mode == "closed" else None,
                "rate_per_s": spec.rate_per_s if spec.mode != "closed" else None,
                "burst_size": spec.burst_size if spec.mode == "bursty" else None,
                "producers": self.o.producers,
                "duration_s": spec.duration_s,
                "warmup_s": spec.warmup_s,
            },
            **result.summary(),
            "worker_side": worker_view(before[0], after[0]) if metrics_urls else None,
            "cpu_cores": cpu_cores(before[1], after[1]),
        }
        phase["vs_ceiling"] = self._ratios(phase)
        if phase["worker_side"] is not None:
            phase["worker_side"]["outside_ms"] = _outside_ms(phase)
        self.report["phases"].append(phase)
        lat = phase["latency_ms"]
        _say(
            f"{phase_id}: {phase['throughput_per_s']:,.0f} req/s, p50 {lat.get('p50', 0):.1f} ms, "
            f"p99 {lat.get('p99', 0):.1f} ms, mean batch {phase['batch_rows']['mean']:.1f}"
        )
        if phase["lost"]:
            _say(f"{phase_id}: {phase['lost']} requests got no reply within {spec.timeout_s:g} s")
        return phase

    def _ratios(self, phase: dict[str, Any]) -> dict[str, float]:
        ceilings = self.report["ceilings"]
        throughput = phase["throughput_per_s"]
        bare = ceilings["bare"].get(phase["model"], {}).get("batch", {})
        ratios = {}
        at_max = bare.get(str(phase["worker"]["max_batch_size"]))
        if at_max:
            ratios["throughput_over_bare"] = throughput / at_max["rows_per_s"]
        if bare.get("1") and phase["latency_ms"]:
            ratios["p50_over_bare_batch1"] = phase["latency_ms"]["p50"] / bare["1"]["run_ms"]["p50"]
        protocol = ceilings["protocol"].get(phase["model"])
        if protocol and protocol["throughput_per_s"]:
            ratios["throughput_over_protocol"] = throughput / protocol["throughput_per_s"]
        return ratios

    def closed_max(self, setup: WorkerSetup, scenario: str) -> float:
        """The setup's throughput at ``CALLERS`` closed-loop callers, measured now if no phase
        of this run has measured it yet."""
        if setup not in self.max_throughput:
            self.phase(f"{scenario}/max", setup, {"mode": "closed", "concurrency": CALLERS})
        return self.max_throughput[setup]

    # -- runs -------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Measure the ceilings, then run the scenarios (or the custom load); returns the report."""
        try:
            if self.o.no_start:
                self._run_against_live_workers()
            elif self.o.scenarios:
                self._run_scenarios()
            else:
                self._run_custom()
        finally:
            self.workers.stop()
        self.report["targets"] = targets(self.report)
        self.report["finished_at"] = _utc_now()
        return self.report

    def _run_scenarios(self) -> None:
        chosen = [SCENARIOS[name] for name in self.o.scenarios]
        if self.o.ceilings:
            bare: dict[str, set[int]] = {}
            for scenario in chosen:
                for model, model_sizes in scenario.bare:
                    bare.setdefault(model, set()).update(model_sizes)
            for model, sizes in sorted(bare.items()):
                self.bare(model, sorted(sizes))
            for model in sorted({m for s in chosen for m in s.protocol}):
                self.protocol(model, ("--model-file", str(self.model_file(model))), 32)
            for model in sorted({m for s in chosen for m in s.asyncio}):
                self.asyncio_batcher(model)
        for scenario in chosen:
            scenario.run(self)

    def _custom_phases(self) -> Iterator[tuple[str, dict[str, Any], str]]:
        o = self.o
        for c in o.concurrency:
            yield f"custom/closed-C{c}", {"mode": "closed", "concurrency": c}, "closed"
        for rate in o.rates:
            load = {"mode": o.arrivals, "rate_per_s": rate, "burst_size": o.burst_size}
            yield f"custom/{o.arrivals}-{rate:g}", load, o.arrivals

    def _run_custom(self) -> None:
        o = self.o
        setup = WorkerSetup(o.model, o.max_batch_size, o.max_wait_ms)
        if o.ceilings:
            self.bare(o.model, sorted({1, o.max_batch_size}))
            source = ("--model-file", str(self.model_file(o.model)))
            self.protocol(o.model, source, o.max_batch_size)
        for phase_id, load, kind in self._custom_phases():
            self.phase(phase_id, setup, load, series=f"{o.model} {kind}")

    def _run_against_live_workers(self) -> None:
        o = self.o
        record = _worker_records(self.url, o.prefix, o.model)[0]
        self.report["machine"].setdefault("onnxruntime", record["runtime"]["onnxruntime"])
        if o.ceilings:
            sizes = sorted({1, int(record["batching"]["max_batch_size"])})
            if o.model_file:
                self.bare(o.model, sizes, Path(o.model_file))
            specs = self.workdir / "specs.json"
            specs.write_text(json.dumps({k: record[k] for k in ("inputs", "outputs")}))
            self.protocol(o.model, ("--specs", str(specs)), sizes[-1])
        for phase_id, load, kind in self._custom_phases():
            spec = self.load_spec(o.prefix, o.model, record["inputs"], load)
            phase = self._measure(phase_id, spec, o.model, record, o.metrics_urls)
            phase["series"] = f"{o.model} {kind}"


def _utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _command_line() -> str | None:
    """The command as typed, when this process is the ``redbatch`` command line."""
    if Path(sys.argv[0]).name in ("redbatch", "__main__.py"):
        return shlex.join(["redbatch", *sys.argv[1:]])
    return None


def _source() -> dict[str, Any] | None:
    """The commit measured and the files changed since, when running from a git checkout."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "producer", "worker"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "changed": [line[3:] for line in status.splitlines()]}


def _machine(url: str) -> dict[str, Any]:
    """Cores, CPU, OS and versions: what the figures depend on."""
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    conn = redis.Redis.from_url(url, socket_timeout=10)
    try:
        redis_version = conn.info("server").get("redis_version")
    finally:
        conn.close()
    return {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "redis_py": redis.__version__,
        "redis_server": redis_version,
    }


# ---------------------------------------------------------------------------------------------
# Scenarios


@dataclass(frozen=True, slots=True)
class Scenario:
    """A fixed preset: what it runs, and the ceilings it is compared with."""

    run: Callable[[Bench], None]
    about: str
    bare: tuple[tuple[str, tuple[int, ...]], ...] = ()
    protocol: tuple[str, ...] = ()
    asyncio: tuple[str, ...] = ()


def _closed(callers: int) -> dict[str, Any]:
    return {"mode": "closed", "concurrency": callers}


def _tiny_closed(b: Bench) -> None:
    b.phase("tiny-closed", WorkerSetup("tiny", 32, b.o.max_wait_ms), _closed(CALLERS))


def _single_caller(b: Bench) -> None:
    for model in ("tiny", "heavy"):
        b.phase(f"single-caller/{model}", WorkerSetup(model, 32, b.o.max_wait_ms), _closed(1))


def _heavy_closed(b: Bench) -> None:
    for size in (1, 32):
        setup = WorkerSetup("heavy", size, b.o.max_wait_ms)
        b.phase(f"heavy-closed/mbs{size}", setup, _closed(CALLERS))


def _poisson_half(b: Bench) -> None:
    setup = WorkerSetup("heavy", 32, b.o.max_wait_ms)
    rate = b.closed_max(setup, "poisson-half") / 2
    b.phase("poisson-half/poisson", setup, {"mode": "poisson", "rate_per_s": rate})
    load = {"mode": "bursty", "rate_per_s": rate, "burst_size": 16}
    b.phase("poisson-half/bursty", setup, load)


def _sweep(b: Bench) -> None:
    setup = WorkerSetup("heavy", 32, b.o.max_wait_ms)
    top = b.closed_max(setup, "sweep")
    for callers in (1, 4, 16, 64, 128):
        b.phase(f"sweep/closed-C{callers}", setup, _closed(callers), series="heavy closed loop")
    for share in (0.25, 0.5, 0.75, 0.9):
        load = {"mode": "poisson", "rate_per_s": share * top}
        b.phase(f"sweep/poisson-{share:g}", setup, load, series="heavy Poisson")


def _drain(b: Bench) -> None:
    """A backlog of tiny requests enqueued first, then a fresh worker started to drain it."""
    n = b.o.drain_requests
    setup = WorkerSetup("tiny", 32, b.o.max_wait_ms, name="tiny-drain")
    b.workers.stop()
    _say("drain: idle memory of a fresh worker")
    idle = WorkerProcess(setup, b.model_file("tiny"), b.url, b.workdir).start()
    try:
        time.sleep(1.0)  # settle: the idle figure is taken once start-up work is over
        idle_kib = memory_kib(idle.pid)
        inputs = idle.record["inputs"]
    finally:
        idle.stop()
    spec = b.load_spec(_PREFIX, setup.served, inputs, {})
    conn = redis.Redis.from_url(b.url, socket_timeout=60)
    try:
        b.wait_for_quiet()
        _say(f"drain: enqueueing {n:,} tiny requests")
        enqueue_s = _enqueue(conn, spec, n)
        _say("drain: starting a worker on the backlog")
        worker = WorkerProcess(setup, b.model_file("tiny"), b.url, b.workdir).start()
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
        "batch_rows": {
            "mean": float(np.mean(tally.batch_rows)) if tally.batch_rows else 0.0,
            "histogram": _counts(tally.batch_rows),
        },
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
    _say(
        f"drain: {d['drain_per_s']:,.0f} req/s, peak RSS {peak / 1024:.0f} MiB "
        f"= {d['peak_over_idle']:.2f} x idle {idle_kib['VmRSS'] / 1024:.0f} MiB"
    )


def _drain_rid(i: int) -> str:
    return f"drain-{i:07d}"


def _enqueue(conn: redis.Redis, spec: LoadSpec, n: int) -> float:
    """XADD ``n`` requests in pipelines of 1,000; returns the seconds it took."""
    sender = _Sender(conn, spec)
    started = time.monotonic()
    for first in range(0, n, 1000):
        pipe = conn.pipeline(transaction=False)
        for i in range(first, min(first + 1000, n)):
            body = sender.bodies[i % _BODIES]
            pipe.xadd(sender.stream, core.Submission(_drain_rid(i), body).fields())
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
        time.sleep(_POLL_S)
    return highest


def _collect(conn: redis.Redis, spec: LoadSpec, n: int) -> ProducerTally:
    """Pop the ``n`` drain replies in pipelines of 2,000; missing ones count as lost."""
    settings = core.Settings.create(spec.model, spec.prefix, None, False)
    tally = ProducerTally()
    for first in range(0, n, 2000):
        rids = [_drain_rid(i) for i in range(first, min(first + 2000, n))]
        pipe = conn.pipeline(transaction=False)
        for rid in rids:
            pipe.lpop(settings.reply_key(rid))
        for rid, raw in zip(rids, pipe.execute(), strict=True):
            if raw is None:
                tally.lost += 1
                continue
            result = core.parse_reply(rid, raw)
            tally.codes[result.error.code if result.error else "OK"] += 1
            if result.ok and result.batch_rows is not None:
                tally.batch_rows.append(int(result.batch_rows))
    return tally


SCENARIOS: dict[str, Scenario] = {
    "tiny-closed": Scenario(
        _tiny_closed,
        f"tiny model, {CALLERS} closed-loop callers, vs the Redis-protocol-only ceiling",
        bare=(("tiny", (1, 32)),),
        protocol=("tiny",),
    ),
    "single-caller": Scenario(
        _single_caller,
        "one caller at a time, tiny and heavy: p50 vs bare batch-1 run time",
        bare=(("tiny", (1,)), ("heavy", (1,))),
    ),
    "heavy-closed": Scenario(
        _heavy_closed,
        f"heavy model, {CALLERS} closed-loop callers, max_batch_size 1 and 32, "
        "vs bare session.run and an in-process asyncio batcher",
        bare=(("heavy", (1, 32)),),
        asyncio=("heavy",),
    ),
    "poisson-half": Scenario(
        _poisson_half,
        "heavy model, Poisson (and bursty) arrivals at half the closed-loop maximum",
        bare=(("heavy", (32,)),),
    ),
    "sweep": Scenario(
        _sweep,
        "heavy model: closed loop at 1 to 128 callers, Poisson at 25 to 90% of the maximum",
        bare=(("heavy", (1, 32)),),
    ),
    "drain": Scenario(
        _drain,
        "100,000 tiny requests enqueued, then a worker started: drain rate, peak vs idle RSS",
    ),
}


# ---------------------------------------------------------------------------------------------
# Targets (the performance issue's goals)


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal the report has the figures for: measured, reference, ratio, and whether met.

    ``ratio`` is measured / reference; a goal is met when it is ``>=`` (or ``<=``) ``threshold``.
    """
    phases = {p["id"]: p for p in report["phases"]}
    ceilings = report["ceilings"]

    def rate(phase_id: str) -> float | None:
        phase = phases.get(phase_id)
        return phase["throughput_per_s"] if phase else None

    def latency(phase_id: str, key: str) -> float | None:
        phase = phases.get(phase_id)
        return phase["latency_ms"].get(key) if phase else None

    def bare(model: str, size: int, key: str) -> float | None:
        batch = ceilings["bare"].get(model, {}).get("batch", {}).get(str(size))
        if batch is None:
            return None
        return float(batch["rows_per_s"] if key == "rows" else batch["run_ms"]["p50"])

    def plus(value: float | None, extra: float) -> float | None:
        return None if value is None else value + extra

    heavy = rate("heavy-closed/mbs32")
    poisson = phases.get("poisson-half/poisson")
    poisson_limit = None
    if poisson:
        run_ms = bare("heavy", poisson["worker"]["max_batch_size"], "ms")
        poisson_limit = plus(run_ms and 2 * run_ms, poisson["worker"]["max_wait_ms"] + 5.0)
    drain = report.get("drain") or {}
    rss = drain.get("rss_kib", {})
    low, high = CELERY_REQUESTS_PER_S
    rows = [
        ("heavy-vs-bare", "heavy, 64 callers, max 32: req/s over bare session.run rows/s at 32",
         heavy, bare("heavy", 32, "rows"), ">=", 0.75),
        ("heavy-vs-asyncio", "heavy, 64 callers: req/s over the asyncio batcher measured here",
         heavy, ceilings["asyncio"].get("heavy", {}).get("throughput_per_s"), ">=", 1.0),
        ("heavy-vs-issue-asyncio", "heavy, 64 callers: req/s over the issue's asyncio 6,000/s",
         heavy, ISSUE_ASYNCIO_REQUESTS_PER_S, ">=", 1.0),
        ("tiny-vs-protocol", "tiny, 64 callers: req/s over the Redis-protocol-only req/s",
         rate("tiny-closed"), ceilings["protocol"].get("tiny", {}).get("throughput_per_s"),
         ">=", 0.8),
        ("single-caller-heavy", "heavy, one caller: p50 ms over bare batch-1 run + 2 ms",
         latency("single-caller/heavy", "p50"), plus(bare("heavy", 1, "ms"), 2.0), "<=", 1.0),
        ("single-caller-tiny", "tiny, one caller: p50 ms over bare batch-1 run + 2 ms",
         latency("single-caller/tiny", "p50"), plus(bare("tiny", 1, "ms"), 2.0), "<=", 1.0),
        ("poisson-half", "heavy, Poisson at half max: p99 ms over max_wait + 2 runs + 5 ms",
         latency("poisson-half/poisson", "p99"), poisson_limit, "<=", 1.0),
        ("batching-pays", "heavy: req/s at max_batch_size 32 over max_batch_size 1",
         heavy, rate("heavy-closed/mbs1"), ">=", 5.0),
        ("vs-celery", f"heavy, max 32: req/s over Celery's {high:g}/s (top of {low:g}-{high:g})",
         heavy, high, ">=", 20.0),
        ("drain-memory", f"drain {drain.get('requests', 0):,}: worker peak RSS over idle RSS",
         rss.get("drain_peak"), rss.get("idle"), "<=", 1.5),
    ]  # fmt: skip
    found = []
    for target_id, what, measured, reference, op, threshold in rows:
        if measured is None or not reference:
            continue
        ratio = measured / reference
        met = ratio >= threshold if op == ">=" else ratio <= threshold
        found.append(
            {
                "id": target_id,
                "what": what,
                "measured": measured,
                "reference": reference,
                "ratio": ratio,
                "op": op,
                "threshold": threshold,
                "met": bool(met),
            }
        )
    return found


# ---------------------------------------------------------------------------------------------
# The report as a table, and as a chart

_STAGE_TITLES = {
    "queue_wait": "queue wait",
    "decode_validate": "decode+validate",
    "batch_assembly": "batch assembly",
    "inference": "inference",
    "reply_write": "reply write",
}


def format_report(report: dict[str, Any]) -> str:
    """The report as readable tables: machine, ceilings, phases, worker time, drain, targets."""
    m, s = report["machine"], report["settings"]
    lines = [
        f"redbatch bench  {m['cpus_usable']} cores ({m['cpu_model'] or 'cpu'}), "
        f"Python {m['python']}, onnxruntime {m.get('onnxruntime', '?')}, "
        f"Redis {m['redis_server']}, redis-py {m['redis_py']}",
        f"each phase: {s['warmup_s']:g} s warmup, then {s['duration_s']:g} s measured; "
        f"{s['producers']} producer process(es)",
        "",
    ]
    lines += _format_ceilings(report["ceilings"])
    if report["phases"]:
        lines += ["", *_format_phases(report["phases"]), "", *_format_stages(report["phases"])]
        lines += ["", *_format_cpu(report), "", *_format_batches(report["phases"])]
    if report.get("drain"):
        lines += ["", *_format_drain(report["drain"])]
    if report["targets"]:
        lines += ["", "targets (ratio = measured / reference)"]
        for t in report["targets"]:
            mark = "met " if t["met"] else "MISS"
            lines.append(
                f"  [{mark}] {t['what']}: {t['ratio']:.2f} (needs {t['op']} {t['threshold']:g};"
                f" {t['measured']:,.2f} vs {t['reference']:,.2f})"
            )
    return "\n".join(lines)


def _format_ceilings(ceilings: dict[str, Any]) -> list[str]:
    lines = ["ceilings (measured in this run)"]
    for model, c in ceilings["bare"].items():
        parts = [
            f"batch {size}: {b['rows_per_s']:,.0f} rows/s, {b['run_ms']['p50']:.2f} ms/run"
            for size, b in sorted(c["batch"].items(), key=lambda kv: int(kv[0]))
        ]
        lines.append(f"  bare session.run  {model:<6} " + "; ".join(parts))
    for model, c in ceilings["protocol"].items():
        lines.append(
            f"  protocol only     {model:<6} {c['throughput_per_s']:,.0f} req/s "
            f"({CALLERS} in flight, p50 {c['latency_ms'].get('p50', 0):.1f} ms; no model, "
            "no decoding)"
        )
    for model, c in ceilings["asyncio"].items():
        lines.append(
            f"  asyncio batcher   {model:<6} {c['throughput_per_s']:,.0f} req/s "
            f"({c['callers']} callers, max {c['max_batch_size']}, {c['window_ms']:g} ms window, "
            f"mean batch {c['mean_batch_rows']:.1f}, p50 {c['latency_ms'].get('p50', 0):.1f} ms;"
            " in-process, no Redis)"
        )
    return lines


def _format_phases(phases: Sequence[dict[str, Any]]) -> list[str]:
    head = (
        f"{'phase':<24} {'load':<20} {'mbs':>3} {'req/s':>7} {'/bare':>5} {'/proto':>6} "
        f"{'p50':>6} {'p90':>6} {'p99':>6} {'p99.9':>6} {'p50/b1':>6} {'batch':>5} {'cpu/req':>7}"
    )
    lines = [
        "phases (latency: ms, end to end; /bare, /proto: throughput over that ceiling; p50/b1: "
        "p50 over bare batch-1 run time; batch: mean rows of each request's batch; cpu/req: "
        "producer CPU ms per request)",
        head,
    ]
    for p in phases:
        lat, r = p["latency_ms"], p["vs_ceiling"]
        lines.append(
            f"{p['id']:<24} {p['load']['label']:<20} {p['worker']['max_batch_size']:>3} "
            f"{p['throughput_per_s']:>7,.0f} {_ratio(r.get('throughput_over_bare')):>5} "
            f"{_ratio(r.get('throughput_over_protocol')):>6} "
            + " ".join(f"{lat.get(k, float('nan')):>6.1f}" for k in ("p50", "p90", "p99", "p99.9"))
            + f" {_ratio(r.get('p50_over_bare_batch1')):>6}"
            + f" {p['batch_rows']['mean']:>5.1f} {p['producer']['cpu_ms_per_request']:>7.3f}"
            + (f"  {p['lost']} lost" if p["lost"] else "")
            + (f"  errors {p['errors']}" if p["errors"] else "")
        )
    return lines


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 0.1 else f"{value:.2f}"


def _format_stages(phases: Sequence[dict[str, Any]]) -> list[str]:
    views = [(p, p["worker_side"]) for p in phases if p.get("worker_side")]
    if not views:
        return ["worker timings: none (no metrics endpoint)"]
    names: list[str] = []
    for _, view in views:
        names += [n for n in view["stages"] if n not in names]
    titles = [_STAGE_TITLES.get(n, n.replace("_", " ")) for n in names]
    lines = [
        "where a request's time goes (ms; the worker's mean per request, or per run or write "
        "for the batch it went through; queue wait runs from enqueue to batch start and "
        "includes read, decode and validate; outside: the end-to-end mean less queue wait, "
        "inference and reply write)",
        f"{'phase':<24} {'e2e mean':>8} "
        + " ".join(f"{t:>15}" for t in titles)
        + f" {'outside':>8} {'runs':>6}",
    ]
    for phase, view in views:
        cells = [
            f"{view['stages'][n]['mean_ms']:>15.3f}" if n in view["stages"] else f"{'-':>15}"
            for n in names
        ]
        outside = view.get("outside_ms")
        lines.append(
            f"{phase['id']:<24} {phase['latency_ms'].get('mean', float('nan')):>8.2f} "
            + " ".join(cells)
            + f" {'-' if outside is None else f'{outside:.2f}':>8} {view['runs']:>6}"
        )
    return lines


def _outside_ms(phase: dict[str, Any]) -> float | None:
    """The end-to-end mean less the worker's queue wait, inference and reply write means: the
    time its metrics do not cover (sending, the reply's trip back, anything unmeasured)."""
    stages = (phase.get("worker_side") or {}).get("stages", {})
    parts = [stages.get(n, {}).get("mean_ms") for n in ("queue_wait", "inference", "reply_write")]
    if None in parts or not phase["latency_ms"]:
        return None
    return float(phase["latency_ms"]["mean"] - sum(p for p in parts if p is not None))


def _format_cpu(report: dict[str, Any]) -> list[str]:
    columns = ("machine", "worker", "redis", "producers", "benchkit", "other")
    lines = [
        f"cores busy during each measurement (of {report['machine']['cpus_usable']}; other: "
        "the machine less everything the bench started, i.e. a neighbour's load)",
        f"{'measurement':<24} " + " ".join(f"{c:>9}" for c in columns),
    ]
    rows = [(f"ceiling {kind} {model}", c.get("cpu_cores")) for kind in ("bare", "protocol",
            "asyncio") for model, c in report["ceilings"][kind].items()]  # fmt: skip
    rows += [(p["id"], p.get("cpu_cores")) for p in report["phases"]]
    if report.get("drain"):
        rows.append(("drain", report["drain"].get("cpu_cores")))
    for name, cores in rows:
        if cores:
            cells = [f"{cores[c]:>9.2f}" if c in cores else f"{'-':>9}" for c in columns]
            lines.append(f"{name:<24} " + " ".join(cells))
    return lines


def _format_batches(phases: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["batch rows per request (rows of the batch each request ran in: requests)"]
    for p in phases:
        hist = p["batch_rows"]["histogram"]
        total = sum(hist.values()) or 1
        top = sorted(hist.items(), key=lambda kv: -kv[1])[:6]
        cells = ", ".join(f"{rows}: {n:,} ({100 * n / total:.0f}%)" for rows, n in top)
        more = f", {len(hist) - 6} more sizes" if len(hist) > 6 else ""
        lines.append(f"  {p['id']:<24} {cells}{more}")
    return lines


def _format_drain(d: dict[str, Any]) -> list[str]:
    rss = d["rss_kib"]
    return [
        f"drain  {d['requests']:,} tiny requests enqueued in {d['enqueue_s']:.1f} s, then a "
        f"fresh worker: drained in {d['drain_s']:.1f} s = {d['drain_per_s']:,.0f} req/s, "
        f"mean batch {d['batch_rows']['mean']:.1f}, {d['ok']:,} ok, {d['missing']} missing",
        f"       worker RSS: idle {rss['idle'] / 1024:.0f} MiB (start-up peak "
        f"{rss['idle_peak'] / 1024:.0f}), draining peak {rss['drain_peak'] / 1024:.0f} MiB, "
        f"at the end {rss['drain_end'] / 1024:.0f} MiB: peak {d['peak_over_idle']:.2f} x idle",
    ]


_PLOT_HINT = "--plot needs matplotlib: pip install 'redbatch[plot]' (or pip install matplotlib)"


def _matplotlib() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BenchError(_PLOT_HINT) from exc
    return plt


def plot(report: dict[str, Any], path: Path) -> None:
    """Latency (p50 and p99) against throughput for each series of phases (a sweep)."""
    series: dict[str, list[dict[str, Any]]] = {}
    for p in report["phases"]:
        if p.get("series") and p["latency_ms"]:
            series.setdefault(p["series"], []).append(p)
    if not series:
        raise BenchError(
            "--plot draws a sweep: use --scenario sweep (or all), or give several "
            "--concurrency or --rate values."
        )
    plt = _matplotlib()
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, (name, phases) in enumerate(series.items()):
        points = sorted(phases, key=lambda p: p["load"]["concurrency"] or p["load"]["rate_per_s"])
        x = [p["throughput_per_s"] for p in points]
        color = colors[n % len(colors)]
        for key, style in (("p50", "o-"), ("p99", "s--")):
            y = [p["latency_ms"][key] for p in points]
            ax.plot(x, y, style, color=color, label=f"{name} {key}")
    # The ceilings of the models plotted, at the batch size their workers used.
    ceilings = report["ceilings"]
    for model, size in sorted(
        {(p["model"], p["worker"]["max_batch_size"]) for p in report["phases"] if p.get("series")}
    ):
        bare = ceilings["bare"].get(model, {}).get("batch", {}).get(str(size))
        marks = [(bare and bare["rows_per_s"], f"bare session.run {model}, batch {size}")]
        protocol = ceilings["protocol"].get(model)
        marks.append((protocol and protocol["throughput_per_s"], f"protocol only, {model}"))
        batcher = ceilings["asyncio"].get(model)
        if batcher and batcher["latency_ms"]:
            lat = batcher["latency_ms"]
            x = [batcher["throughput_per_s"]] * 2
            label = f"in-process asyncio batcher, {model} (p50, p99)"
            ax.plot(x, [lat["p50"], lat["p99"]], "k*", markersize=9, label=label)
        for x_ceiling, label in marks:
            if x_ceiling:
                ax.axvline(x_ceiling, color="grey", linestyle=":", linewidth=1)
                ax.annotate(
                    label,
                    (x_ceiling, 0.98),
                    xycoords=("data", "axes fraction"),
                    rotation=90,
                    va="top",
                    ha="right",
                    fontsize=8,
                )
    ax.set_xlim(left=0)
    ax.set_yscale("log")
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("end-to-end latency (ms)")
    m = report["machine"]
    ax.set_title(f"redbatch: latency vs throughput ({m['cpus_usable']} cores, CPU)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The command line


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,8,64")
    return values


def _float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of numbers") from None
    if not values or not min(values) > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive numbers, e.g. 500,1000")
    return values


def _scenario_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names == ("all",):
        return tuple(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown scenario {', '.join(unknown) or text!r}; "
            f"choose from {', '.join(SCENARIOS)} or all"
        )
    return names


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text} is not between 0 and 3600 seconds")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``redbatch bench`` options (``producer.cli`` registers the subcommand)."""
    parser.description = HELP.format(
        scenarios="\n".join(f"  {name:<14} {s.about}" for name, s in SCENARIOS.items())
    )
    add = parser.add_argument
    add("--scenario", type=_scenario_list, metavar="NAME", help="preset(s) to run, or all")
    add("--duration-s", type=_seconds, default=3.0, metavar="S", help="measured (default 3)")
    add("--warmup-s", type=_seconds, default=0.5, metavar="S", help="load before (default 0.5)")
    add("--json", metavar="PATH", help="write the full report as JSON")
    add("--plot", metavar="PATH", help="draw p50 and p99 against throughput (needs matplotlib)")
    add("--model", default="tiny", metavar="NAME", help="custom load: model (default tiny)")
    add("--concurrency", type=_int_list, metavar="C[,C]", help="closed-loop callers")
    add("--rate", type=_float_list, metavar="R[,R]", help="open-loop requests/s")
    add("--arrivals", choices=("poisson", "bursty"), default="poisson", help="open-loop kind")
    add("--burst-size", type=_count, default=16, metavar="N", help="requests per burst")
    add("--max-batch-size", type=_count, default=32, metavar="N", help="started workers")
    add("--max-wait-ms", type=float, default=5.0, metavar="MS", help="started workers")
    add("--producers", type=_count, default=1, metavar="N", help="producer processes")
    add("--timeout-s", type=_seconds, default=30.0, metavar="S", help="per reply (default 30)")
    add("--drain-requests", type=_count, default=100_000, metavar="N", help="drain backlog")
    add("--no-ceilings", action="store_true", help="skip the bare and protocol ceilings")
    add(
        "--quiet-s",
        type=float,
        default=0.0,
        metavar="S",
        help="before each measurement, wait up to S s for the machine to be idle (shared hosts)",
    )
    add(
        "--redis-url",
        dest="bench_redis_url",
        metavar="URL",
        help="start the workers on this Redis (default: a private redis-server)",
    )
    add("--no-start", action="store_true", help="drive the workers serving --model there")
    add(
        "--metrics-url",
        action="append",
        default=[],
        metavar="URL",
        help="with --no-start: a worker's /metrics (repeat for several)",
    )
    add("--model-file", metavar="PATH", help="with --no-start: the .onnx, for bare ceilings")
    add(
        "--prefix",
        default=argparse.SUPPRESS,
        help=f"with --no-start: the workers' key prefix (default {keys.DEFAULT_PREFIX})",
    )


def _options(args: argparse.Namespace) -> Options:
    from producer.job import UsageError

    scenarios = tuple(args.scenario or ())
    custom = bool(args.concurrency or args.rate)
    if scenarios and custom:
        raise UsageError("--scenario runs fixed presets; leave out --concurrency and --rate.")
    if args.no_start and scenarios:
        raise UsageError(
            "--no-start drives live workers with --concurrency or --rate; the presets start "
            "their own workers with fixed settings."
        )
    if not args.no_start and (args.metrics_url or args.model_file):
        raise UsageError("--metrics-url and --model-file go with --no-start.")
    if not args.no_start and not scenarios and not keys.is_valid_model_name(args.model):
        raise UsageError(f"--model {args.model!r} is not a model name.")
    if args.max_wait_ms < 0:
        raise UsageError("--max-wait-ms must not be negative.")
    return Options(
        scenarios=scenarios,
        duration_s=args.duration_s,
        warmup_s=args.warmup_s,
        producers=args.producers,
        timeout_s=args.timeout_s,
        drain_requests=args.drain_requests,
        max_wait_ms=args.max_wait_ms,
        model=args.model,
        concurrency=args.concurrency or (() if args.rate else (CALLERS,)),
        rates=args.rate or (),
        arrivals=args.arrivals,
        burst_size=args.burst_size,
        max_batch_size=args.max_batch_size,
        ceilings=not args.no_ceilings,
        no_start=args.no_start,
        metrics_urls=tuple(args.metrics_url),
        model_file=args.model_file,
        prefix=getattr(args, "prefix", keys.DEFAULT_PREFIX),
        quiet_s=max(args.quiet_s, 0.0),
    )


def run_command(args: argparse.Namespace) -> int:
    """``redbatch bench``: run, print the table, write --json and --plot; returns 0."""
    from producer.job import UsageError

    options = _options(args)
    for path in (args.json, args.plot):
        if path and not Path(path).resolve().parent.is_dir():
            raise UsageError(f"directory for {path!r} does not exist.")
    if args.plot:
        _matplotlib()  # fail before a long run, not after it
    with contextlib.ExitStack() as stack:
        if options.no_start:
            url = args.bench_redis_url or args.redis_url
        elif args.bench_redis_url:
            url = args.bench_redis_url
        else:
            url = stack.enter_context(_private_redis())
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="redbatch-bench-")))
        report = Bench(options, url, workdir).run()
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.plot:
        plot(report, Path(args.plot))
    return 0
