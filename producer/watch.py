"""``redbatch status --watch``: one model's queue as a live view, redrawn every few seconds.

Each refresh takes a ``Snapshot`` (``take_snapshot``): the status ``producer.status`` gathers,
the stream's and group's counters (``XINFO STREAM`` entries-added, ``XINFO GROUPS``
entries-read), and, when asked, the workers' ``/metrics``. ``render`` turns two snapshots into
a frame of plain text: backlog and where it sits, requests in and out per second (counter
deltas, so they cover every worker, registered or not), dead letters, worker-side latency
percentiles and batch rows from the metrics histograms, and each live worker's model version,
providers and requests per second (from the ``served`` counters its heartbeat publishes every
5 s). Callers' end-to-end latency is not in Redis; ``redbatch run`` and ``redbatch bench``
measure it.

The view is plain ANSI (clear screen, redraw) on a terminal and plain frames otherwise.
Ctrl-C ends it with exit status 0; ``--iterations`` ends it after that many frames.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TextIO
from urllib.parse import urlsplit

import redis

from producer import argtypes, core, keys, status
from producer.errors import ConnectionFailed

__all__ = [
    "DEFAULT_INTERVAL_S",
    "Scrape",
    "Snapshot",
    "WorkerRates",
    "add_arguments",
    "render",
    "run_command",
    "take_snapshot",
]

DEFAULT_INTERVAL_S = 2.0
_CLEAR = "\x1b[H\x1b[2J"  # cursor home, erase screen
_SCRAPE_TIMEOUT_S = 2.0
# Worker stages with a seconds histogram, in the order a request meets them.
_STAGES = (
    ("queue wait", "redbatch_queue_wait_seconds"),
    ("decode", "redbatch_decode_validate_seconds"),
    ("inference", "redbatch_inference_seconds"),
    ("reply write", "redbatch_reply_write_seconds"),
)

SampleKey = tuple[str, tuple[tuple[str, str], ...]]


# ---------------------------------------------------------------------------------------------
# Snapshots


@dataclass(frozen=True, slots=True)
class Scrape:
    """One worker's /metrics: every sample by name and labels, or the error that stopped it."""

    url: str
    samples: Mapping[SampleKey, float] | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The model's queue at one moment; ``taken_s`` is monotonic, for rates."""

    taken_s: float
    status: status.ModelStatus
    entries_added: int | None
    entries_read: int | None
    scrapes: tuple[Scrape, ...] = ()


def take_snapshot(
    conn: redis.Redis,
    model: str,
    prefix: str = keys.DEFAULT_PREFIX,
    metrics_urls: Sequence[str] = (),
    *,
    clock: Callable[[], float] = time.monotonic,
) -> Snapshot:
    """Read the model's queue, counters and metrics; raises ConnectionFailed when Redis fails."""
    report = status.gather_status(conn, model, prefix, dead_limit=1)
    added = read = None
    if report.requests.exists:
        try:
            pipe = conn.pipeline(transaction=False)
            pipe.xinfo_stream(report.requests.key)
            pipe.xinfo_groups(report.requests.key)
            stream_info, groups = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:
            raise ConnectionFailed(str(exc) or type(exc).__name__) from exc
        if isinstance(stream_info, dict):
            added = _int_or_none(stream_info.get("entries-added"))
        for group in groups if isinstance(groups, list) else []:
            if _text(group.get("name")) == keys.CONSUMER_GROUP:
                read = _int_or_none(group.get("entries-read"))
                if read is None and _text(group.get("last-delivered-id")) == "0-0":
                    read = 0  # a group that has read nothing yet reports nil
    scrapes = tuple(_scrape(url) for url in metrics_urls)
    return Snapshot(clock(), report, added, read, scrapes)


def _scrape(url: str) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=_SCRAPE_TIMEOUT_S) as response:
            text = response.read().decode("utf-8", "replace")
        samples: dict[SampleKey, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                samples[key] = samples.get(key, 0.0) + float(s.value)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        return Scrape(url, None, " ".join(str(exc).split()) or type(exc).__name__)
    return Scrape(url, samples)


# ---------------------------------------------------------------------------------------------
# Per-worker rates from the registry


@dataclass(frozen=True, slots=True)
class _Served:
    heartbeat_s: float
    requests: int
    batches: int


class WorkerRates:
    """Requests/s and requests per batch of each live worker, from its registry record.

    A record's ``served`` counters change only with its heartbeat (every 5 s), so a rate is
    taken between two different heartbeats and kept until the next one.
    """

    def __init__(self) -> None:
        self._base: dict[str, _Served] = {}
        self.rates: dict[str, tuple[float, float | None]] = {}

    def update(self, workers: Iterable[status.WorkerInfo]) -> None:
        """Take in this refresh's live workers; forget the ones that are gone."""
        seen = set()
        for worker in workers:
            served = _served(worker)
            if served is None:
                continue
            seen.add(worker.name)
            base = self._base.get(worker.name)
            if base is None or served.requests < base.requests:
                self._base[worker.name] = served
            elif served.heartbeat_s > base.heartbeat_s:
                seconds = served.heartbeat_s - base.heartbeat_s
                batches = served.batches - base.batches
                self.rates[worker.name] = (
                    (served.requests - base.requests) / seconds,
                    (served.requests - base.requests) / batches if batches > 0 else None,
                )
                self._base[worker.name] = served
        for name in set(self._base) - seen:
            del self._base[name]
            self.rates.pop(name, None)


def _served(worker: status.WorkerInfo) -> _Served | None:
    requests, batches = worker.get("served", "requests"), worker.get("served", "batches")
    beat = _epoch_s(worker.get("heartbeat_at"))
    if not isinstance(requests, int) or not isinstance(batches, int) or beat is None:
        return None
    return _Served(beat, requests, batches)


# ---------------------------------------------------------------------------------------------
# Rendering


def render(
    before: Snapshot | None,
    now: Snapshot,
    *,
    rates: WorkerRates | None = None,
    redis_url: str | None = None,
    interval_s: float = DEFAULT_INTERVAL_S,
    problem: str | None = None,
) -> str:
    """One frame of the view: ``before`` is the previous snapshot (None on the first frame)."""
    s = now.status
    where = f" at {redis_url}" if redis_url else ""
    stamp = datetime.fromtimestamp(s.observed_at).strftime("%H:%M:%S")
    lines = [
        f"redbatch status --watch: model {s.model!r}, prefix {s.prefix!r}{where}",
        f"{stamp}, every {interval_s:g} s; Ctrl-C quits",
    ]
    if problem:
        lines.append(f"!! {problem}")
    lines.append("")
    lines += _queue_lines(before, now)
    lines += _dead_lines(before, now)
    lines += _metrics_lines(before, now)
    lines.append("")
    lines += _worker_lines(now, rates)
    return "\n".join(lines)


def _queue_lines(before: Snapshot | None, now: Snapshot) -> list[str]:
    req = now.status.requests
    if not req.exists:
        return [f"queue       no stream {req.key} yet (no request sent, no worker started)"]
    group = req.group
    held = group.pending if group else 0
    oldest = (
        "" if req.oldest_entry_age_s is None else f", oldest {_seconds(req.oldest_entry_age_s)}"
    )
    lines = [
        f"queue       backlog {req.backlog:,} (waiting {max(req.backlog - held, 0):,}, "
        f"held by workers {held:,}){oldest}"
    ]
    if group is None:
        lines.append(f"            no consumer group {keys.CONSUMER_GROUP!r} yet")
    flow = _flow(before, now)
    if flow is None:
        lines.append("flow        in and out per second from the next refresh on")
    else:
        added_s, finished_s, seconds = flow
        parts = []
        if added_s is not None:
            parts.append(f"in {added_s:,.0f}/s")
        if finished_s is not None:
            parts.append(f"out {finished_s:,.0f}/s")
        trend = (req.backlog - before.status.requests.backlog) / seconds if before else 0.0
        parts.append(f"backlog {trend:+,.0f}/s")
        if finished_s and trend < 0 and req.backlog:
            parts.append(f"drains in about {_seconds(req.backlog / -trend)}")
        lines.append(f"flow        {', '.join(parts)} (last {seconds:.1f} s)")
    return lines


def _flow(
    before: Snapshot | None, now: Snapshot
) -> tuple[float | None, float | None, float] | None:
    """Requests added and answered per second between two snapshots."""
    if before is None or now.taken_s <= before.taken_s:
        return None
    seconds = now.taken_s - before.taken_s
    added = None
    if now.entries_added is not None and before.entries_added is not None:
        added = max(now.entries_added - before.entries_added, 0) / seconds
    finished = None
    g_now, g_before = now.status.requests.group, before.status.requests.group
    if now.entries_read is not None and before.entries_read is not None and g_now and g_before:
        # Every entry read is either still pending or answered.
        answered = (now.entries_read - before.entries_read) - (g_now.pending - g_before.pending)
        finished = max(answered, 0) / seconds
    return added, finished, seconds


def _dead_lines(before: Snapshot | None, now: Snapshot) -> list[str]:
    dead = now.status.dead
    new = ""
    if before is not None and dead.count != before.status.dead.count:
        new = f" ({dead.count - before.status.dead.count:+,} since last refresh)"
    noun = "dead letter" if dead.count == 1 else "dead letters"
    line = f"dead        {dead.count:,} {noun}{new}"
    if dead.recent:
        d = dead.recent[0]
        line += f"; newest {_seconds(d.age_s)} ago, rid {d.rid or '-'}: {d.reason}"
    if dead.count:
        line += " (redbatch replay --from-dead re-sends)"
    return [line]


def _metrics_lines(before: Snapshot | None, now: Snapshot) -> list[str]:
    if not now.scrapes:
        return [
            "latency     not in Redis: pass --metrics-url http://HOST:9100/metrics (once per "
            "worker) for worker-side percentiles and batch rows"
        ]
    ok = [sc for sc in now.scrapes if sc.samples is not None]
    lines = [f"metrics     {sc.url}: {sc.error}" for sc in now.scrapes if sc.samples is None]
    if not ok:
        return lines
    window, samples = _window(before, now)
    lines.insert(0, f"worker-side {window}, {len(ok)} of {len(now.scrapes)} workers scraped")
    parts = []
    for label, metric in _STAGES:
        buckets = _buckets(samples, metric)
        p50, p99 = _quantile(buckets, 0.5), _quantile(buckets, 0.99)
        if p50 is not None and p99 is not None:
            parts.append(f"{label} p50 {p50} p99 {p99}")
    lines.append("latency     " + ("; ".join(parts) if parts else "no requests answered"))
    rows_sum = _total(samples, "redbatch_batch_rows_sum")
    runs = _total(samples, "redbatch_batch_rows_count")
    answered = _total(samples, "redbatch_requests_total")
    if runs:
        lines.append(
            f"batches     mean {rows_sum / runs:.1f} rows per model run, {runs:,.0f} runs, "
            f"{answered:,.0f} requests answered"
        )
    return lines


def _window(before: Snapshot | None, now: Snapshot) -> tuple[str, dict[SampleKey, float]]:
    """Samples summed over workers: deltas since ``before`` when it has them, else totals."""
    earlier = {sc.url: sc.samples for sc in before.scrapes} if before else {}
    total: dict[SampleKey, float] = {}
    deltas = True
    for sc in now.scrapes:
        if sc.samples is None:
            continue
        old = earlier.get(sc.url)
        restarted = old is not None and any(v < old.get(k, 0.0) for k, v in sc.samples.items())
        if old is None or restarted:
            deltas = False
        for key, value in sc.samples.items():
            base = old.get(key, 0.0) if old is not None and not restarted else 0.0
            total[key] = total.get(key, 0.0) + value - base
    if before is not None and deltas:
        return f"last {now.taken_s - before.taken_s:.1f} s", total
    return "since the workers started", total


def _buckets(samples: Mapping[SampleKey, float], metric: str) -> list[tuple[float, float]]:
    by_bound: dict[float, float] = {}
    for (name, labels), value in samples.items():
        if name == f"{metric}_bucket":
            bound = float(dict(labels).get("le", "nan"))
            by_bound[bound] = by_bound.get(bound, 0.0) + value
    return sorted(by_bound.items())


def _quantile(buckets: Sequence[tuple[float, float]], q: float) -> str | None:
    """The q-quantile of cumulative buckets, interpolated as Prometheus' histogram_quantile."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return f"> {_seconds(lower_bound)}"
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return _seconds(lower_bound + (bound - lower_bound) * share)
        lower_bound, lower_count = bound, count
    return None


def _total(samples: Mapping[SampleKey, float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def _worker_lines(now: Snapshot, rates: WorkerRates | None) -> list[str]:
    s = now.status
    lines = [f"workers     {len(s.workers)} live"]
    if not s.workers:
        return [*lines, "            no live worker has registered for this model"]
    held = {c.name: c for c in s.requests.group.consumers} if s.requests.group else {}
    header = ["NAME", "STATE", "VERSION", "SHA256", "PROVIDERS", "HELD", "REQ/S", "REQ/BATCH"]
    rows = [[*header, "SERVED", "HEARTBEAT"]]
    for w in s.workers:
        providers = w.get("runtime", "providers") or []
        rate = rates.rates.get(w.name) if rates else None
        served, batches = w.get("served", "requests"), w.get("served", "batches")
        per_batch = rate[1] if rate else None
        if per_batch is None and isinstance(served, int) and isinstance(batches, int) and batches:
            per_batch = served / batches  # since the worker started, until a rate is known
        consumer = held.get(w.name)
        rows.append(
            [
                w.name,
                _show(w.get("state")),
                _show(w.get("model", "version")),
                _show(w.get("model", "sha256"))[:12],
                ",".join(str(p).removesuffix("ExecutionProvider") for p in providers) or "-",
                "-" if consumer is None else f"{consumer.pending:,}",
                "-" if rate is None else f"{rate[0]:,.0f}",
                "-" if per_batch is None else f"{per_batch:.1f}",
                f"{served:,}" if isinstance(served, int) else "-",
                _age(_epoch_s(w.get("heartbeat_at")), s.observed_at),
            ]
        )
    return lines + _table(rows)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]


def _seconds(seconds: float) -> str:
    if seconds < 1.0:
        return f"{seconds * 1000:.1f} ms" if seconds < 0.1 else f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.0f} min"


def _age(epoch_s: float | None, now_s: float) -> str:
    return "-" if epoch_s is None else f"{_seconds(max(now_s - epoch_s, 0.0))} ago"


def _show(value: Any) -> str:
    return "-" if value is None else str(value)


def _epoch_s(stamp: Any) -> float | None:
    if not isinstance(stamp, str):
        return None
    try:
        when = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when.timestamp() if when.tzinfo is not None else None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


# ---------------------------------------------------------------------------------------------
# The command


def _metrics_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an http:// URL of a worker's /metrics, "
            "such as http://127.0.0.1:9100/metrics"
        )
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--watch`` options of ``redbatch status`` (``producer.cli`` registers them)."""
    add = parser.add_argument
    add("--watch", action="store_true", help="redraw a live view until Ctrl-C")
    add(
        "--interval-s",
        type=argtypes.positive_float,
        default=DEFAULT_INTERVAL_S,
        metavar="S",
        help=f"with --watch: seconds between refreshes (default: {DEFAULT_INTERVAL_S:g})",
    )
    add(
        "--iterations",
        type=argtypes.positive_int,
        metavar="N",
        help="with --watch: stop after N refreshes (default: until Ctrl-C)",
    )
    add(
        "--metrics-url",
        type=_metrics_url,
        action="append",
        default=[],
        metavar="URL",
        help="with --watch: a worker's /metrics, for latency percentiles and batch rows "
        "(repeat for each worker)",
    )


def run_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``redbatch status --watch``: redraw until Ctrl-C or ``--iterations``; returns 0."""
    from producer.job import UsageError

    if getattr(args, "json", False):
        raise UsageError("--watch draws a live view; leave out --json (or drop --watch).")
    stream = sys.stdout if out is None else out
    where = core.redact_url(args.redis_url)
    clear = stream.isatty()
    conn = redis.Redis.from_url(args.redis_url, socket_connect_timeout=5, socket_timeout=10)
    rates = WorkerRates()
    before: Snapshot | None = None
    frames = 0
    try:
        while args.iterations is None or frames < args.iterations:
            if frames:
                time.sleep(args.interval_s)
            problem = None
            try:
                now = take_snapshot(conn, args.model, args.prefix, args.metrics_url)
            except ConnectionFailed as exc:
                if before is None:
                    raise ConnectionFailed(f"Could not talk to Redis at {where}: {exc}") from exc
                problem = f"Redis unreachable ({exc}); showing the last view, retrying"
                now = before
            else:
                rates.update(now.status.workers)
            frame = render(
                None if problem else before,
                now,
                rates=rates,
                redis_url=where,
                interval_s=args.interval_s,
                problem=problem,
            )
            stream.write((_CLEAR if clear else ("\n" if frames else "")) + frame + "\n")
            stream.flush()
            before = now
            frames += 1
    except KeyboardInterrupt:
        stream.write("\n")
        stream.flush()
    finally:
        conn.close()
    return 0
