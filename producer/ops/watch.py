"""``redbatch status --watch``: one model's queue as a live view, redrawn every few seconds.

Each refresh takes a ``Snapshot`` (``producer.ops.watchstats.take_snapshot``): the model's status,
the stream's and group's counters and, when asked, the workers' ``/metrics``. ``render`` turns two
snapshots into a frame of plain text: backlog and where it sits, requests in and out per second,
Redis memory against ``maxmemory`` (and whether producers are refused), dead letters, worker-side
latency percentiles and batch rows from the metrics histograms, and (``producer.ops.watchworkers``)
each live worker's model version, providers and requests per second, how long its pipeline's
hooks take per request and the verdict ``producer.ops.stages`` gives (bound by preprocessing, or
by the model). ``producer.ops.watchstats`` does the maths. Callers' end-to-end latency is not in
Redis; ``redbatch run`` and ``python -m tools.bench`` measure it.

Every line of a frame fits 80 columns (``producer.ops.words.fit`` folds what text from Redis
makes longer), so the view reads the same in any terminal, a narrow one included.

A model with several shards (``P:{M}:shards``) gets the same lines summed over its shards, and a
table with each shard's backlog, what workers hold, dead letters and requests in and out per
second, so that a shard left behind (its master slow, its workers gone) shows.

The command that redraws it (``--interval-s``, ``--iterations``, Ctrl-C) is
``producer/cli/status.py``.
"""

from __future__ import annotations

from datetime import datetime

from producer.ops.damage import damage_lines
from producer.ops.lanetotals import has_lanes, model_lanes, queue_total
from producer.ops.reportlanes import WATCH_ROWS, class_line, lane_notes, lane_table
from producer.ops.textformat import (
    INFO_REFUSED,
    memory_notes,
    memory_summary,
    narrow_table,
    printable,
)
from producer.ops.watchstats import (
    Scrape,
    Snapshot,
    StageWatch,
    WorkerRates,
    flow_per_s,
    format_seconds,
    histogram_buckets,
    memory_per_s,
    metrics_window,
    quantile,
    sample_total,
    shard_flow_per_s,
    take_snapshot,
)
from producer.ops.watchworkers import stage_lines, worker_lines
from producer.ops.words import WIDTH, count, fit
from producer.protocol import keys

__all__ = [
    "DEFAULT_INTERVAL_S",
    "Scrape",
    "Snapshot",
    "StageWatch",
    "WorkerRates",
    "render",
    "take_snapshot",
]

DEFAULT_INTERVAL_S = 2.0
# Worker stages with a seconds histogram, in the order a request meets them.
_STAGES = (
    ("queue wait", "redbatch_queue_wait_seconds"),
    ("decode", "redbatch_decode_validate_seconds"),
    ("inference", "redbatch_inference_seconds"),
    ("reply write", "redbatch_reply_write_seconds"),
)


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
    stage_rates: StageWatch | None = None,
) -> str:
    """One frame of the view, every line at most ``WIDTH`` (80) columns: ``before`` is the
    previous snapshot (None on the first frame)."""
    s = now.status
    stamp = datetime.fromtimestamp(s.observed_at).strftime("%H:%M:%S")
    lines = [f"watch    {s.model!r} at {stamp}, every {interval_s:g} s; Ctrl-C quits"]
    where = f"{redis_url}, " if redis_url else ""
    lines.append(f"redis    {where}prefix {s.prefix!r}")
    if problem:
        lines.append(f"!! {problem}")
    lines.append("")
    lines += damage_lines(s.damage, s.observed_at)  # first: the queue below may be lying
    lines += _queue_lines(before, now)
    lines += _lane_lines(now)
    lines += _shard_lines(before, now)
    lines += _memory_lines(before, now)
    lines += _dead_lines(before, now)
    lines += _metrics_lines(before, now)
    lines.append("")
    lines += worker_lines(now, rates)
    lines += stage_lines(now, stage_rates, flow_per_s(before, now))
    return "\n".join(fit(map(printable, lines), WIDTH))


def _queue_lines(before: Snapshot | None, now: Snapshot) -> list[str]:
    """The whole queue (every lane of every shard), by class, and how it flows."""
    req = now.status.requests
    if not req.exists and not has_lanes(now.status):
        return [f"queue    no stream {req.key} yet (no request sent, no worker started)"]
    backlog, pending, oldest_s = queue_total(now.status)
    # XLEN and XPENDING are read a moment apart: an entry answered and deleted in between is
    # still counted as held; the stream cannot hold fewer entries than its held ones.
    held = min(pending, backlog)
    oldest = "" if oldest_s is None else f", oldest {format_seconds(oldest_s)}"
    lines = [
        f"queue    backlog {backlog:,} (waiting {max(backlog - held, 0):,}, held {held:,}){oldest}"
    ]
    if req.group is None and req.exists:
        lines.append(f"         no consumer group {keys.CONSUMER_GROUP!r} yet")
    lines += class_line(now.status, "classes  ", format_seconds)
    flow = flow_per_s(before, now)
    if flow is None:
        lines.append("flow     in and out per second from the next refresh on")
        return lines
    added_s, finished_s, seconds = flow
    parts = []
    if added_s is not None:
        parts.append(f"in {added_s:,.0f}/s")
    if finished_s is not None:
        parts.append(f"out {finished_s:,.0f}/s")
    trend = (backlog - queue_total(before.status)[0]) / seconds if before else 0.0
    parts.append(f"backlog {trend:+,.0f}/s")
    lines.append(f"flow     {', '.join(parts)} (last {seconds:.1f} s)")
    if finished_s and trend < 0 and backlog:
        lines.append(f"         drains in about {format_seconds(backlog / -trend)} at this rate")
    return lines


def _lane_lines(now: Snapshot) -> list[str]:
    """With lanes besides the defaults: a row per lane (the first ``WATCH_ROWS``)."""
    title = (
        f"lanes    {count(len(model_lanes(now.status)), 'lane')} (oldest: how long its head waited)"
    )
    table = lane_table(now.status, title=title, held="HELD", limit=WATCH_ROWS)
    return table + lane_notes(now.status, indent="         ")


def _shard_lines(before: Snapshot | None, now: Snapshot) -> list[str]:
    """With several shards: one row each (the lines above are their sums); a retiring shard's
    tag ends in ``*``."""
    s = now.status
    if len(s.shards) < 2:
        return []
    retiring = sum(shard.state == "retiring" for shard in s.shards)
    title = f"shards   {len(s.shards)}"
    if retiring:
        title += f", {retiring} retiring (*: no longer sent to, served until drained)"
    where = ["MASTER"] if s.cluster else []
    rows = [["SHARD", *where, "BACKLOG", "HELD", "DEAD", "IN/S", "OUT/S"]]
    for shard in s.shards:
        req = shard.requests
        held = min(req.group.pending if req.group else 0, req.backlog)
        flow = shard_flow_per_s(before, now, shard.tag)
        added_s, finished_s = (flow[0], flow[1]) if flow else (None, None)
        rows.append(
            [
                shard.tag + ("*" if shard.state == "retiring" else ""),
                *([shard.node or "-"] if s.cluster else []),
                f"{req.backlog:,}",
                f"{held:,}",
                f"{shard.dead.count:,}",
                "-" if added_s is None else f"{added_s:,.0f}",
                "-" if finished_s is None else f"{finished_s:,.0f}",
            ]
        )
    first = 2 if s.cluster else 1
    return [title, *narrow_table(rows, indent="  ", right=frozenset(range(first, first + 5)))]


def _memory_lines(before: Snapshot | None, now: Snapshot) -> list[str]:
    reading = now.status.memory
    if reading is None:
        return [f"memory   {INFO_REFUSED}"]
    summary = memory_summary(reading, change_bytes_per_s=memory_per_s(before, now))
    used, cut, rest = summary.partition(", headroom ")  # the same words, on two lines
    lines = [f"memory   {used}"]
    second = f"headroom {rest.replace('; policy', ', policy')}" if cut else ""
    if now.status.memory_node:
        second += f"{', ' if second else ''}fullest master {now.status.memory_node}"
    if second:
        lines.append(f"         {second}")
    return lines + [f"         !! {note}" for note in memory_notes(reading)]


def _dead_lines(before: Snapshot | None, now: Snapshot) -> list[str]:
    dead = now.status.dead
    new = ""
    if before is not None and dead.count != before.status.dead.count:
        new = f" ({dead.count - before.status.dead.count:+,} since last refresh)"
    lines = [f"dead     {count(dead.count, 'dead letter')}{new}"]
    if dead.recent:
        d = dead.recent[0]
        lines.append(
            f"         newest {format_seconds(d.age_s)} ago, rid {d.rid or '-'}: {d.reason}"
        )
    if dead.count:
        lines.append("         redbatch replay --from-dead re-sends them")
    return lines


def _metrics_lines(before: Snapshot | None, now: Snapshot) -> list[str]:
    if not now.scrapes:
        return [
            "latency  not in Redis: pass --metrics-url http://HOST:9100/metrics (once per",
            "         worker) for worker-side percentiles and batch rows",
        ]
    ok = [sc for sc in now.scrapes if sc.samples is not None]
    failed = [f"         {sc.url}: {sc.error}" for sc in now.scrapes if sc.samples is None]
    if not ok:
        return ["metrics  no worker's /metrics could be read", *failed]
    window, samples = metrics_window(before, now)
    lines = [
        f"metrics  worker-side {window}, {len(ok)} of {count(len(now.scrapes), 'worker')} scraped",
        *failed,
    ]
    parts = []
    for label, metric in _STAGES:
        buckets = histogram_buckets(samples, metric)
        p50, p99 = quantile(buckets, 0.5), quantile(buckets, 0.99)
        if p50 is not None and p99 is not None:
            parts.append(f"{label} p50 {p50} p99 {p99}")
    if not parts:
        parts = ["no requests answered"]
    lines += [f"{'latency' if i == 0 else '':9}{part}" for i, part in enumerate(parts)]
    rows_sum = sample_total(samples, "redbatch_batch_rows_sum")
    runs = sample_total(samples, "redbatch_batch_rows_count")
    answered = sample_total(samples, "redbatch_requests_total")
    if runs:
        lines.append(
            f"batches  mean {rows_sum / runs:.1f} rows per model run, {count(round(runs), 'run')}, "
            f"{count(round(answered), 'request')} answered"
        )
    return lines
