"""``redbatch status --watch``: one model's queue as a live view, redrawn every few seconds.

Each refresh takes a ``Snapshot`` (``producer.ops.watchstats.take_snapshot``): the model's status,
the stream's and group's counters and, when asked, the workers' ``/metrics``. ``render`` turns two
snapshots into a frame of plain text: backlog and where it sits, requests in and out per second,
Redis memory against ``maxmemory`` (and whether producers are refused), dead letters, worker-side
latency percentiles and batch rows from the metrics histograms, each live worker's model
version, providers and requests per second, and, from its record's running totals, how long its
pipeline's hooks take per request, how busy its hook threads and its model are, and the verdict
``producer.ops.stages`` gives (bound by preprocessing, or by the model); ``producer.ops.watchstats``
does the maths. Callers'
end-to-end latency is not in Redis; ``redbatch run`` and ``python -m tools.bench`` measure it.

A model with several shards (``P:{M}:shards``) gets the same lines summed over its shards, and a
table with each shard's backlog, what workers hold, dead letters and requests in and out per
second, so that a shard left behind (its master slow, its workers gone) shows.

The command that redraws it (``--interval-s``, ``--iterations``, Ctrl-C) is
``producer/cli/status.py``.
"""

from __future__ import annotations

from datetime import datetime

from producer.ops import stages
from producer.ops.damage import damage_lines
from producer.ops.textformat import (
    INFO_REFUSED,
    WORKER_COLUMNS,
    memory_notes,
    memory_summary,
    printable,
    table,
    worker_cells,
)
from producer.ops.watchstats import (
    Scrape,
    Snapshot,
    StageWatch,
    WorkerRates,
    epoch_s,
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
    lines += damage_lines(s.damage, s.observed_at)  # first: the queue below may be lying
    lines += _queue_lines(before, now)
    lines += _shard_lines(before, now)
    lines += _memory_lines(before, now)
    lines += _dead_lines(before, now)
    lines += _metrics_lines(before, now)
    lines.append("")
    lines += _worker_lines(now, rates)
    lines += _stage_lines(now, stage_rates)
    return "\n".join(map(printable, lines))


def _queue_lines(before: Snapshot | None, now: Snapshot) -> list[str]:
    req = now.status.requests
    if not req.exists:
        return [f"queue       no stream {req.key} yet (no request sent, no worker started)"]
    group = req.group
    # XLEN and XPENDING are read a moment apart: an entry answered and deleted in between is
    # still counted as held; the stream cannot hold fewer entries than its held ones.
    held = min(group.pending if group else 0, req.backlog)
    oldest = (
        ""
        if req.oldest_entry_age_s is None
        else f", oldest {format_seconds(req.oldest_entry_age_s)}"
    )
    lines = [
        f"queue       backlog {req.backlog:,} (waiting {max(req.backlog - held, 0):,}, "
        f"held by workers {held:,}){oldest}"
    ]
    if group is None:
        lines.append(f"            no consumer group {keys.CONSUMER_GROUP!r} yet")
    flow = flow_per_s(before, now)
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
            parts.append(f"drains in about {format_seconds(req.backlog / -trend)}")
        lines.append(f"flow        {', '.join(parts)} (last {seconds:.1f} s)")
    return lines


def _shard_lines(before: Snapshot | None, now: Snapshot) -> list[str]:
    """With several shards: one row each (the lines above are their sums)."""
    s = now.status
    if len(s.shards) < 2:
        return []
    retiring = sum(shard.state == "retiring" for shard in s.shards)
    title = f"shards      {len(s.shards)}" + (f", {retiring} retiring" if retiring else "")
    where = ["MASTER"] if s.cluster else []
    rows = [["SHARD", "STATE", *where, "BACKLOG", "HELD", "DEAD", "IN/S", "OUT/S"]]
    for shard in s.shards:
        req = shard.requests
        held = min(req.group.pending if req.group else 0, req.backlog)
        flow = shard_flow_per_s(before, now, shard.tag)
        added_s, finished_s = (flow[0], flow[1]) if flow else (None, None)
        rows.append(
            [
                shard.tag,
                shard.state,
                *([shard.node or "-"] if s.cluster else []),
                f"{req.backlog:,}",
                f"{held:,}",
                f"{shard.dead.count:,}",
                "-" if added_s is None else f"{added_s:,.0f}",
                "-" if finished_s is None else f"{finished_s:,.0f}",
            ]
        )
    first = 3 if s.cluster else 2
    return [title, *table(rows, indent=" " * 12, right=frozenset(range(first, first + 5)))]


def _memory_lines(before: Snapshot | None, now: Snapshot) -> list[str]:
    reading = now.status.memory
    if reading is None:
        return [f"memory      {INFO_REFUSED}"]
    summary = memory_summary(reading, change_bytes_per_s=memory_per_s(before, now))
    if now.status.memory_node:
        summary += f" (fullest master, {now.status.memory_node})"
    notes = [f"            !! {note}" for note in memory_notes(reading)]
    return [f"memory      {summary}", *notes]


def _dead_lines(before: Snapshot | None, now: Snapshot) -> list[str]:
    dead = now.status.dead
    new = ""
    if before is not None and dead.count != before.status.dead.count:
        new = f" ({dead.count - before.status.dead.count:+,} since last refresh)"
    noun = "dead letter" if dead.count == 1 else "dead letters"
    line = f"dead        {dead.count:,} {noun}{new}"
    if dead.recent:
        d = dead.recent[0]
        line += f"; newest {format_seconds(d.age_s)} ago, rid {d.rid or '-'}: {d.reason}"
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
    window, samples = metrics_window(before, now)
    lines.insert(0, f"worker-side {window}, {len(ok)} of {len(now.scrapes)} workers scraped")
    parts = []
    for label, metric in _STAGES:
        buckets = histogram_buckets(samples, metric)
        p50, p99 = quantile(buckets, 0.5), quantile(buckets, 0.99)
        if p50 is not None and p99 is not None:
            parts.append(f"{label} p50 {p50} p99 {p99}")
    lines.append("latency     " + ("; ".join(parts) if parts else "no requests answered"))
    rows_sum = sample_total(samples, "redbatch_batch_rows_sum")
    runs = sample_total(samples, "redbatch_batch_rows_count")
    answered = sample_total(samples, "redbatch_requests_total")
    if runs:
        lines.append(
            f"batches     mean {rows_sum / runs:.1f} rows per model run, {runs:,.0f} runs, "
            f"{answered:,.0f} requests answered"
        )
    return lines


def _worker_lines(now: Snapshot, rates: WorkerRates | None) -> list[str]:
    s = now.status
    lines = [f"workers     {len(s.workers)} live"]
    if not s.workers:
        return [*lines, "            no live worker has registered for this model"]
    held = {c.name: c for c in s.requests.group.consumers} if s.requests.group else {}
    rows = [[*WORKER_COLUMNS, "HELD", "REQ/S", "REQ/BATCH", "SERVED", "HEARTBEAT"]]
    for w in s.workers:
        rate = rates.rates.get(w.name) if rates else None
        served, batches = w.get("served", "requests"), w.get("served", "batches")
        per_batch = rate[1] if rate else None
        if per_batch is None and isinstance(served, int) and isinstance(batches, int) and batches:
            per_batch = served / batches  # since the worker started, until a rate is known
        consumer = held.get(w.name)
        rows.append(
            [
                *worker_cells(w),
                "-" if consumer is None else f"{consumer.pending:,}",
                "-" if rate is None else f"{rate[0]:,.0f}",
                "-" if per_batch is None else f"{per_batch:.1f}",
                f"{served:,}" if isinstance(served, int) else "-",
                _age(epoch_s(w.get("heartbeat_at")), s.observed_at),
            ]
        )
    return lines + table(rows, indent="  ")


def _stage_lines(now: Snapshot, watched: StageWatch | None) -> list[str]:
    """Per worker whose record has ``stages``: hook time per request, how busy its pipeline
    threads and model were between its last two heartbeats, and the verdict."""
    sampled = [w for w in now.status.workers if isinstance(w.get("stages"), dict)]
    if not sampled:
        return []
    found = watched.rates if watched else {}
    header = ["NAME", "THREADS", "BUSY", "PRE/REQ", "PRE CPU", "POST/REQ", "POST CPU"]
    rows = [[*header, "MODEL BUSY", "CPU", "REQ/S"]]
    verdicts = []
    for w in sampled:
        r = found.get(w.name)
        if r is None:
            continue
        rows.append(
            [
                w.name,
                str(r.threads) if r.threads else "-",
                f"{r.hooks:.0%}" if r.threads else "-",
                _ms(r.pre_ms),
                _ms(r.pre_cpu_ms),
                _ms(r.post_ms),
                _ms(r.post_cpu_ms),
                f"{r.model:.0%}",
                f"{r.cpu:.2f}",
                f"{r.requests_per_s if r.threads else r.rows_per_s:,.0f}",
            ]
        )
        verdicts.append(f"  {w.name}: {stages.verdict(r)}")
    lines = [
        "",
        "stages      per request (PRE, POST: wall and CPU ms in the pipeline's hooks), busy "
        "share of the hook threads and the model, worker CPU in cores; between heartbeats",
    ]
    if len(rows) == 1:
        return [*lines, "            from the workers' next heartbeats on (every 5 s)"]
    return lines + table(rows, indent="  ", right=frozenset(range(1, 10))) + verdicts


def _ms(value: float | None) -> str:
    return "-" if value is None else format_seconds(value / 1000.0)


def _age(at_s: float | None, now_s: float) -> str:
    return "-" if at_s is None else f"{format_seconds(max(now_s - at_s, 0.0))} ago"
