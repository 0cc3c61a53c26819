"""The workers' part of a ``redbatch status --watch`` frame: each live worker's throughput and
identity, and where its time goes, in lines of at most 80 columns.

Each worker gets a table row of numbers (held, requests/s, requests per batch, served) and a
line under it saying what it is (state, model version and hash, providers, heartbeat), so that
neither a pod's long name nor a version string pushes the row past the terminal's edge. Workers
whose record has ``stages`` get a second table, of the hooks' cost per request, each row with
its verdict under it (``producer.ops.stages``).

A verdict is taken between two heartbeats, five seconds apart, so it lags the queue: a worker
that served nothing between its last two heartbeats is ``idle``, not "bound by" anything, and
one that holds nothing while the whole queue answered nothing over the last refresh is ``idle
now`` whatever its last heartbeats said.
"""

from __future__ import annotations

from producer.ops import stages
from producer.ops.status import WorkerInfo
from producer.ops.textformat import narrow_table, worker_cells
from producer.ops.watchstats import (
    Snapshot,
    StageWatch,
    WorkerRates,
    epoch_s,
    format_seconds,
)

__all__ = [
    "RATE_PENDING",
    "STAGE_WINDOW",
    "WORKER_WINDOW",
    "stage_lines",
    "verdict_now",
    "worker_lines",
]

Flow = tuple[float | None, float | None, float] | None

# Each table says which window its numbers cover, so that the workers' REQ/S (replies written),
# the stages' REQ/S (requests through the hooks) and ``flow`` (the stream's counters over the
# last refresh) are not read as three answers to one question.
#: The workers table's window: the ``served`` counters change with each heartbeat.
WORKER_WINDOW = "REQ/S: replies between their last two heartbeats (every 5 s)"
#: The stages table's window.
STAGE_WINDOW = "hooks' wall/CPU time per request, REQ/S into them: between heartbeats"
#: Under a workers table with a rate not known yet (a watch sees two heartbeats first).
RATE_PENDING = "REQ/S -: rates after the next heartbeat (a rate needs two, 5 s apart)"


def worker_lines(now: Snapshot, rates: WorkerRates | None) -> list[str]:
    """``workers  N live`` and the window its rates cover, then per worker a row of numbers and
    a line of what it is; a ``-`` for a rate not known yet is explained once, under the table."""
    s = now.status
    if not s.workers:
        return [
            f"workers  {len(s.workers)} live",
            "         no live worker has registered for this model",
        ]
    lines = [f"workers  {len(s.workers)} live; {WORKER_WINDOW}"]
    held = {c.name: c for c in s.requests.group.consumers} if s.requests.group else {}
    rows = [["NAME", "HELD", "REQ/S", "REQ/BATCH", "SERVED"]]
    about = []
    for w in s.workers:
        rate = rates.rates.get(w.name) if rates else None
        served, batches = w.get("served", "requests"), w.get("served", "batches")
        per_batch = rate[1] if rate else None
        if per_batch is None and isinstance(served, int) and isinstance(batches, int) and batches:
            per_batch = served / batches  # since the worker started, until a rate is known
        consumer = held.get(w.name)
        rows.append(
            [
                w.name,
                "-" if consumer is None else f"{consumer.pending:,}",
                "-" if rate is None else f"{rate[0]:,.0f}",
                "-" if per_batch is None else f"{per_batch:.1f}",
                f"{served:,}" if isinstance(served, int) else "-",
            ]
        )
        about.append(_identity(w, s.observed_at))
    table = narrow_table(rows, indent="  ", right=frozenset({1, 2, 3, 4}))
    lines.append(table[0])
    for row, line in zip(table[1:], about, strict=True):
        lines += [row, line]
    if any(row[2] == "-" for row in rows[1:]):
        lines.append(f"  {RATE_PENDING}")
    return lines


def _identity(worker: WorkerInfo, now_s: float) -> str:
    """``    ready, version 2 (sha256 0123456789ab), CUDA,CPU, heartbeat 1.2 s ago``."""
    _, state, version, sha, providers = worker_cells(worker)
    beat = epoch_s(worker.get("heartbeat_at"))
    heard = "-" if beat is None else f"{format_seconds(max(now_s - beat, 0.0))} ago"
    return f"    {state}, version {version} (sha256 {sha}), {providers}, heartbeat {heard}"


def stage_lines(now: Snapshot, watched: StageWatch | None, flow: Flow = None) -> list[str]:
    """Per worker whose record has ``stages``: the hooks' wall and CPU time per request and the
    requests per second between its last two heartbeats, and under it the verdict."""
    sampled = [w for w in now.status.workers if isinstance(w.get("stages"), dict)]
    if not sampled:
        return []
    found = watched.rates if watched else {}
    lines = [
        "",
        f"stages   {STAGE_WINDOW}",
    ]
    held = _held(now)
    rows = [["NAME", "PRE/REQ", "PRE CPU", "POST/REQ", "POST CPU", "REQ/S"]]
    verdicts = []
    for w in sampled:
        r = found.get(w.name)
        if r is None:
            continue
        rows.append(
            [
                w.name,
                _ms(r.pre_ms),
                _ms(r.pre_cpu_ms),
                _ms(r.post_ms),
                _ms(r.post_cpu_ms),
                f"{r.requests_per_s if r.threads else r.rows_per_s:,.0f}",
            ]
        )
        verdicts.append(f"    {verdict_now(r, held.get(w.name, 0), flow)}")
    if len(rows) == 1:
        return [*lines, "         from the workers' next heartbeats on (every 5 s)"]
    table = narrow_table(rows, indent="  ", right=frozenset(range(1, 6)))
    lines.append(table[0])
    for row, verdict in zip(table[1:], verdicts, strict=True):
        lines += [row, verdict]
    return lines


def verdict_now(r: stages.StageRates, held: int, flow: Flow) -> str:
    """The verdict on a worker's last two heartbeats, unless it was idle then or is now: no
    request served between them, or none held by it while the queue answered none over the
    last refresh (``flow``: ``flow_per_s`` of the last two snapshots)."""
    if r.requests_per_s <= 0 and r.rows_per_s <= 0:
        return f"idle: served nothing in the {r.seconds:.1f} s between its last two heartbeats"
    if flow is not None and flow[1] == 0 and held == 0:
        return (
            f"idle now: nothing answered in the last {flow[2]:.1f} s and nothing held (the "
            "figures above are from its last heartbeats)"
        )
    return stages.verdict(r)


def _held(now: Snapshot) -> dict[str, int]:
    group = now.status.requests.group
    return {c.name: c.pending for c in group.consumers} if group else {}


def _ms(value: float | None) -> str:
    return "-" if value is None else format_seconds(value / 1000.0)
