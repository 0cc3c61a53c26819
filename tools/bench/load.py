"""A phase's load: what it is (``LoadSpec``), how producer processes drive it, what it measured.

Closed loop: C callers, one reply in, one request out. Open loop: Poisson or bursty arrivals at
a rate, sent on schedule whatever the replies do, with a second thread taking the replies. Each
producer is a spawned process (``run_load`` starts them, hands them one start time, and
collects their ``ProducerTally``), so the load is not limited by one interpreter's GIL.

Throughput counts replies that arrived in the measured window; latency is per request sent in
it, from the send (closed loop) or the scheduled arrival (open loop, so a late sender cannot
hide queueing) to the reply.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import redis

from producer.protocol.errors import WaitTimeout
from producer.redisio.topology import Topology
from tools.bench.errors import BenchError
from tools.bench.wire import ProducerTally, Replies, Sender, Sent

__all__ = [
    "CALLERS",
    "LoadResult",
    "LoadSpec",
    "arrivals",
    "batch_rows_summary",
    "percentiles",
    "run_load",
    "tail_split",
]

#: Closed-loop callers in the presets, and requests in flight for the protocol-only ceiling.
CALLERS = 64
_PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9))
_SEND_QUANTUM_S = 0.001  # an open-loop sender wakes at most this often; arrivals due go together
_MAX_REQUESTS = 2_000_000  # per phase and producer: rate * seconds must stay under it


# ---------------------------------------------------------------------------------------------
# Arrivals and statistics


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


def tail_split(
    latencies_ms: Sequence[float], worker_ms: Sequence[tuple[float, float]], share: float = 0.01
) -> dict[str, dict[str, float]]:
    """Where the time of every request, and of the slowest ``share`` of them, went, by the
    replies' own timings: queued (enqueue to its batch's start), inference (its batch's run)
    and the rest of the end-to-end time (sending, writing the reply, the way back)."""
    if len(latencies_ms) == 0:
        return {}
    e2e = np.asarray(latencies_ms, dtype=np.float64)
    worker = np.asarray(worker_ms, dtype=np.float64).reshape(-1, 2)
    cut = np.percentile(e2e, 100.0 * (1.0 - share))

    def split(mask: np.ndarray) -> dict[str, float]:
        queued, inference = _finite_mean(worker[mask, 0]), _finite_mean(worker[mask, 1])
        mean = float(e2e[mask].mean())
        return {
            "requests": int(mask.sum()),
            "e2e_ms": mean,
            "queued_ms": queued,
            "inference_ms": inference,
            "rest_ms": mean - queued - inference,
        }

    return {"all": split(np.ones(len(e2e), dtype=bool)), "slowest": split(e2e >= cut)}


def _finite_mean(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else 0.0


def batch_rows_summary(rows: Sequence[int]) -> dict[str, Any]:
    """The mean batch rows, and how many requests ran in a batch of each size (by size)."""
    counts = Counter(int(v) for v in rows)
    return {
        "mean": float(np.mean(rows)) if rows else 0.0,
        "histogram": {str(v): n for v, n in sorted(counts.items())},
    }


# ---------------------------------------------------------------------------------------------
# The load and its result


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
    bodies: tuple[bytes, ...] = ()  # encoded requests to send instead of rows drawn for inputs
    tags: tuple[str, ...] = ()  # the model's shard tags to spread over (none: its own tag)

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
class LoadResult:
    """All producers' tallies for one phase."""

    spec: LoadSpec
    producers: int
    tallies: list[ProducerTally]

    def shard_completed(self) -> Counter[str]:
        """Replies that arrived in the window, by shard tag."""
        return sum((t.shard_completed for t in self.tallies), Counter())

    def summary(self) -> dict[str, Any]:
        latencies = [v for t in self.tallies for v in t.latencies_ms]
        worker_ms = [v for t in self.tallies for v in t.worker_ms]
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
            "throughput_by_shard": {
                tag: n / self.spec.duration_s for tag, n in sorted(self.shard_completed().items())
            },
            "latency_ms": percentiles(latencies),
            "tail": tail_split(latencies, worker_ms),
            "batch_rows": batch_rows_summary(rows),
            "producer": {
                "processes": self.producers,
                "cpu_ms_per_request": 1000.0 * cpu_s / sent if sent else 0.0,
                "max_send_lag_ms": max(t.max_send_lag_ms for t in self.tallies),
            },
        }


# ---------------------------------------------------------------------------------------------
# Closed and open loops, inside one producer process


def _closed_loop(
    spec: LoadSpec,
    conn: redis.Redis,
    tally: ProducerTally,
    t0: float,
    shards: dict[str, redis.Redis] | None = None,
) -> None:
    """C callers: every reply is answered at once by a new request, until the window ends."""
    w0, w1 = t0 + spec.warmup_s, t0 + spec.warmup_s + spec.duration_s
    replies = Replies(conn, spec.prefix, spec.model, spec.timeout_s, tally, (w0, w1), shards)
    sender = Sender(conn, spec.prefix, spec.model, spec.inputs, spec.seed, spec.bodies, shards)
    try:
        while True:
            now = time.monotonic()
            want = spec.concurrency - replies.in_flight if now < w1 else 0
            if want > 0:
                for sent_as in sender.rids(want):
                    replies.add(sent_as, now, now)
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
        self.items: list[tuple[Sent, float, float]] = []  # (tag, rid), scheduled, send time
        self.done = False

    def put(self, rids: Sequence[Sent], scheduled: np.ndarray, sent: float) -> None:
        with self.cond:
            self.items += [(rid, float(t), sent) for rid, t in zip(rids, scheduled, strict=True)]
            self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify()


def _open_loop(
    spec: LoadSpec,
    conn: redis.Redis,
    tally: ProducerTally,
    t0: float,
    shards: dict[str, redis.Redis] | None = None,
) -> None:
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
    replies = Replies(recv_conn, spec.prefix, spec.model, spec.timeout_s, tally, (w0, w1), shards)
    inbox = _Inbox()
    failure: list[BaseException] = []
    receiver = threading.Thread(
        target=_receive, args=(replies, inbox, failure), name="replies", daemon=True
    )
    receiver.start()
    sender = Sender(conn, spec.prefix, spec.model, spec.inputs, spec.seed, spec.bodies, shards)
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


def _receive(replies: Replies, inbox: _Inbox, failure: list[BaseException]) -> None:
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


# ---------------------------------------------------------------------------------------------
# Producer processes


def _producer_main(spec: LoadSpec, conn: Any) -> None:
    """A producer process: connect, say ready, wait for the start time, drive, send the tally."""
    try:
        client = redis.Redis.from_url(spec.url, decode_responses=False, socket_timeout=30)
        client.ping()
        shards = _shard_clients(client, spec)
        conn.send(("ready", None))
        t0 = conn.recv()
        tally = ProducerTally()
        cpu0 = time.process_time()
        time.sleep(max(t0 - time.monotonic(), 0.0))
        if spec.concurrency or spec.mode != "closed":
            drive = _closed_loop if spec.mode == "closed" else _open_loop
            drive(spec, client, tally, t0, shards)
        tally.cpu_s = time.process_time() - cpu0
        client.close()
        conn.send(("done", tally))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _shard_clients(client: redis.Redis, spec: LoadSpec) -> dict[str, redis.Redis] | None:
    """Each shard tag's client, bound to its master (``producer.redisio.topology``); None for the
    model's own tag alone on a single Redis, which the loops then drive on ``client`` itself,
    exactly as before shards."""
    tags = spec.tags or (spec.model,)
    topology = Topology(client)
    if not topology.refresh():
        return None if tags == (spec.model,) else dict.fromkeys(tags, client)
    return {tag: topology.client(tag) for tag in tags}


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
