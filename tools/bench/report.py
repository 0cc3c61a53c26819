"""What a run tells: progress lines, the report's tables and JSON, its targets, and the chart.

The report is a plain dict (``runner.Bench`` builds it) so that it can be written as JSON and
read back; everything here reads that dict and nothing else. ``targets`` sets the figures
against the goals of the performance issue, ``format_report`` is the table ``python -m tools.bench``
prints, and ``say`` the progress lines on stderr while a run goes. ``plot``, the
latency-throughput chart of a sweep, is ``chart.py``'s, re-exported here.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.bench.chart import plot, pyplot
from tools.bench.lanereport import format_lanes, lane_targets, make_target
from tools.bench.load import CALLERS
from tools.bench.pipereport import format_pipelines, image_reference

__all__ = [
    "CELERY_REQUESTS_PER_S",
    "ISSUE_ASYNCIO_REQUESTS_PER_S",
    "format_report",
    "plot",
    "pyplot",
    "say",
    "targets",
    "write_json",
]

#: The Celery figure from the performance issue: 210 to 260 requests/s on the heavy model.
CELERY_REQUESTS_PER_S = (210.0, 260.0)
#: The issue's in-process asyncio batcher on the heavy model, on these 2 cores.
ISSUE_ASYNCIO_REQUESTS_PER_S = 6000.0


def say(message: str) -> None:
    """One progress line on stderr, while a run goes."""
    print(f"bench: {message}", file=sys.stderr, flush=True)


def write_json(report: dict[str, Any], path: Path) -> None:
    """The full report as indented JSON."""
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Targets (the performance issue's goals)


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal the report has the figures for: measured, reference, ratio, and whether met.

    ``ratio`` is measured / reference; a goal is met when it is ``>=`` (or ``<=``) ``threshold``.
    A goal measured in rounds (``--rounds``) is judged by the round of median ratio (the lower
    middle one of an even count), and lists every round's ratio.
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
        ("pipeline-threads", "preprocessing-bound pipeline: req/s at threads 2 over threads 1",
         rate("pipeline/cpu-t2"), rate("pipeline/cpu-t1"), ">=", 1.5),
        ("pipeline-image", "image example: req/s over the lesser of preprocessing alone (same "
         "threads) and bare session.run at max_batch_size",
         rate("pipeline/image"), image_reference(report), ">=", 0.8),
    ]  # fmt: skip
    found = []
    for target_id, what, once, once_reference, op, threshold in rows:
        rounds = (report.get("rounds") or {}).get(target_id)
        middle = _median_round(rounds) if rounds else None
        measured = middle["measured"] if middle else once
        reference = middle["reference"] if middle else once_reference
        if measured is None or not reference:
            continue
        target = make_target(target_id, what, measured, reference, op, threshold)
        if rounds:
            target["round_ratios"] = [r["ratio"] for r in rounds]
        found.append(target)
    return found + lane_targets(report)


def _rounds_note(target: dict[str, Any]) -> str:
    ratios = target.get("round_ratios")
    if not ratios:
        return ""
    each = ", ".join(f"{r:.2f}" for r in ratios)
    return f"; median of {len(ratios)} rounds, ceiling then worker back to back: {each}"


def _median_round(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The round whose ratio is the median (the lower middle one of an even count)."""
    middle = statistics.median_low(r["ratio"] for r in rounds)
    return next(r for r in rounds if r["ratio"] == middle)


# ---------------------------------------------------------------------------------------------
# The report as a table

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
        _providers_line(report),
        f"each phase: {s['warmup_s']:g} s warmup, then {s['duration_s']:g} s measured; "
        f"{s['producers']} producer process(es)",
        "",
    ]
    lines += _format_ceilings(report["ceilings"])
    if report["phases"]:
        lines += ["", *_format_phases(report["phases"]), "", *_format_stages(report["phases"])]
        lines += ["", *_format_cpu(report), *_format_budget(report["phases"])]
        lines += _format_redis(report["phases"])
        lines += _format_redis_cpu(report["phases"])
        lines += _format_tail(report["phases"])
        lines += format_pipelines(report)
        lines += ["", *_format_batches(report["phases"])]
    if report.get("drain"):
        lines += ["", *_format_drain(report["drain"])]
    lines += format_lanes(report)
    if report["targets"]:
        lines += ["", "targets (ratio = measured / reference)"]
        for t in report["targets"]:
            mark = "met " if t["met"] else "MISS"
            lines.append(
                f"  [{mark}] {t['what']}: {t['ratio']:.2f} (needs {t['op']} {t['threshold']:g};"
                f" {t['measured']:,.2f} vs {t['reference']:,.2f}{_rounds_note(t)})"
            )
    return "\n".join(lines)


def _providers_line(report: dict[str, Any]) -> str:
    """The providers asked for, those the sessions ran with (a missing GPU shows here), GPUs."""
    m = report["machine"]
    ran = [", ".join(m["providers"])] if m.get("providers") else []
    for p in report["phases"]:
        serving = ", ".join(p["worker"].get("providers") or [])
        if serving and serving not in ran:
            ran.append(serving)
    asked = ",".join(report["settings"].get("providers", ("cpu",)))
    gpus = "; ".join(m.get("gpus") or []) or "none listed"
    bound = {p["worker"].get("binding", "off") for p in report["phases"]} - {"off"}
    binding = f"; worker binding: {', '.join(sorted(bound))}" if bound else ""
    return (
        f"providers asked for: {asked}; sessions ran with: {' | '.join(ran) or '?'}{binding}; "
        f"GPU: {gpus}"
    )


def _format_ceilings(ceilings: dict[str, Any]) -> list[str]:
    lines = ["ceilings (measured in this run)"]
    for model, c in ceilings["bare"].items():
        parts = [
            f"batch {size}: {b['rows_per_s']:,.0f} rows/s, {b['run_ms']['p50']:.2f} ms/run"
            for size, b in sorted(c["batch"].items(), key=lambda kv: int(kv[0]))
        ]
        lines.append(f"  bare session.run  {model:<8} " + "; ".join(parts))
    for model, c in ceilings["protocol"].items():
        lines.append(
            f"  protocol only     {model:<8} {c['throughput_per_s']:,.0f} req/s "
            f"({CALLERS} in flight, p50 {c['latency_ms'].get('p50', 0):.1f} ms; no model, "
            "no decoding)"
        )
    for model, c in (ceilings.get("preprocess") or {}).items():
        lines.append(
            f"  preprocess alone  {model:<8} {c['requests_per_s']:,.0f} req/s ({c['threads']} "
            f"threads, {c['call_ms'].get('p50', 0):.2f} ms per call p50, "
            f"{c['cpu_ms_per_request']:.2f} CPU ms per request; {c['handler']}, no Redis)"
        )
    for model, c in ceilings["asyncio"].items():
        lines.append(
            f"  asyncio batcher   {model:<8} {c['throughput_per_s']:,.0f} req/s "
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


_REDIS_TOP = 6  # commands shown per phase


def _format_cpu(report: dict[str, Any]) -> list[str]:
    columns = ("machine", "worker", "redis", "producers", "benchkit", "other")
    lines = [
        f"cores busy during each measurement (of {report['machine']['cpus_usable']}; other: "
        "the machine less everything the bench started, i.e. a neighbour's load)",
        f"{'measurement':<24} " + " ".join(f"{c:>9}" for c in columns),
    ]
    kinds = ("bare", "protocol", "asyncio", "preprocess")
    ceilings = [(kind, model, c) for kind in kinds for model, c in
                report["ceilings"].get(kind, {}).items()]  # fmt: skip
    short = {"preprocess": "pre"}  # the column is 24 wide
    rows = [(f"ceiling {short.get(k, k)} {m}", c.get("cpu_cores")) for k, m, c in ceilings]
    rows += [(p["id"], p.get("cpu_cores")) for p in report["phases"]]
    if report.get("drain"):
        rows.append(("drain", report["drain"].get("cpu_cores")))
    for name, cores in rows:
        if cores:
            cells = [f"{cores[c]:>9.2f}" if c in cores else f"{'-':>9}" for c in columns]
            lines.append(f"{name:<24} " + " ".join(cells))
    return lines


def _format_budget(phases: Sequence[dict[str, Any]]) -> list[str]:
    """CPU ms per request by process, and the throughput all cores busy would allow."""
    rows = [p for p in phases if p.get("cpu_budget")]
    if not rows:
        return []
    keys = ("model_ms", "worker_other_ms", "redis_ms", "producers_ms", "total_ms")
    lines = [
        "",
        "CPU per request (core-ms; model: bare session.run's CPU per row at the worker's max "
        "batch size; worker other: the rest of the worker process; bound: the req/s that every "
        "core busy with this work would give, the most this setup can reach on this machine)",
        f"{'phase':<24} {'model':>7} {'worker':>7} {'redis':>7} {'prod.':>7} {'total':>7} "
        f"{'bound':>8} {'/bare':>5} {'got/bound':>9}",
    ]
    for p in rows:
        b = p["cpu_budget"]
        got = p["throughput_per_s"] / b["bound_per_s"]
        lines.append(
            f"{p['id']:<24} "
            + " ".join(f"{b[k]:>7.3f}" for k in keys)
            + f" {b['bound_per_s']:>8,.0f} {_ratio(b['bound_over_bare']):>5} {got:>9.2f}"
        )
    return lines


def _format_redis(phases: Sequence[dict[str, Any]]) -> list[str]:
    """Where Redis's one thread went per request, by command: what bounds many workers."""
    rows = [p for p in phases if p.get("redis_commands")]
    if not rows:
        return []
    lines = [
        "",
        "Redis per request, by command (us of Redis's thread, INFO commandstats over the window; "
        "a script's own time includes the commands it runs, which are also listed; evalsha: "
        "the worker's scripts; calls per request in brackets)",
    ]
    for p in rows:
        top = list(p["redis_commands"].items())[:_REDIS_TOP]
        cells = ", ".join(
            f"{name} {c['us_per_request']:.1f} ({c['calls_per_request']:.2g})" for name, c in top
        )
        lines.append(f"  {p['id']:<24} {cells}")
    return lines


def _format_redis_cpu(phases: Sequence[dict[str, Any]]) -> list[str]:
    """Redis CPU per request by master and its replicas: the cost that scales with masters."""
    rows = [p for p in phases if p.get("redis_cpu")]
    if not rows:
        return []
    lines = [
        "",
        "Redis CPU per request, by master (us of CPU per request its shards answered in the "
        "window; replicas: its replicas' CPU over the same requests; cores: busy over the window; "
        "total: every server's CPU over every request)",
        f"{'phase':<24} {'master':<16} {'shards':<20} {'req/s':>8} {'us/req':>7} "
        f"{'replica':>7} {'cores':>5} {'repl.':>5}",
    ]
    for p in rows:
        cpu = p["redis_cpu"]
        for i, m in enumerate(cpu["masters"]):
            name = p["id"] if i == 0 else ""
            lines.append(
                f"{name:<24} {m['address']:<16} {','.join(m['shards']) or '-':<20} "
                f"{m['requests_per_s']:>8,.0f} {_us(m['master_us_per_request']):>7} "
                f"{_us(m['replica_us_per_request']):>7} {m['master_cores']:>5.2f} "
                f"{m['replica_cores']:>5.2f}"
            )
        total = cpu["total"]
        lines.append(
            f"{'':<24} total: {_us(total['us_per_request'])} us per request, "
            f"{total['cores']:.2f} cores, {len(cpu['masters'])} master(s)"
        )
    return lines


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _format_tail(phases: Sequence[dict[str, Any]]) -> list[str]:
    """Every request against the slowest 1%: did the tail wait on the worker, or elsewhere?"""
    rows = [p for p in phases if p.get("tail")]
    if not rows:
        return []
    parts = ("e2e_ms", "queued_ms", "inference_ms", "rest_ms")
    lines = [
        "",
        "all requests against the slowest 1% (ms, means; queued and inference from each "
        "reply's timings_ms: enqueue to its batch's start, its batch's run; rest: sending, "
        "writing the reply, the way back)",
        f"{'phase':<24} {'all: e2e':>9} {'queued':>7} {'infer':>7} {'rest':>7}   "
        f"{'1%: e2e':>8} {'queued':>7} {'infer':>7} {'rest':>7}",
    ]
    for p in rows:
        every, slow = p["tail"]["all"], p["tail"]["slowest"]
        lines.append(
            f"{p['id']:<24} {every['e2e_ms']:>9.2f} "
            + " ".join(f"{every[k]:>7.2f}" for k in parts[1:])
            + f"   {slow['e2e_ms']:>8.2f} "
            + " ".join(f"{slow[k]:>7.2f}" for k in parts[1:])
        )
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
