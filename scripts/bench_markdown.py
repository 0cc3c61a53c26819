"""Render a ``python -m tools.bench --json`` report as the Markdown tables of docs/benchmarks.md.

    python scripts/bench_markdown.py docs/bench.json > /tmp/tables.md

The page's tables are this script's output for the report it names, so that they match the
JSON digit for digit; the prose around them is written by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

_REDIS_COLUMNS = ("evalsha", "xreadgroup", "xadd", "exec", "rpush", "lpop", "blpop")
_STAGES = ("queue_wait", "decode_validate", "inference", "reply_write")


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], left: int = 1) -> list[str]:
    """A Markdown table: the first ``left`` columns flush left, the rest right."""
    align = ["---"] * left + ["---:"] * (len(header) - left)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _n(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def ceilings(report: dict[str, Any]) -> list[str]:
    """What every ratio is set against: bare runs, the protocol alone, the asyncio batcher."""
    c = report["ceilings"]
    rows = []
    for model, bare in sorted(c["bare"].items()):
        sizes = sorted(bare["batch"].items(), key=lambda kv: int(kv[0]))
        text = "; ".join(
            f"batch {size}: {_n(b['rows_per_s'])} rows/s ({b['run_ms']['p50']:.2f} ms per run, p50)"
            for size, b in sizes
        )
        rows.append((f"bare `session.run`, {model}", text))
    for model, p in sorted(c["protocol"].items()):
        p50 = p["latency_ms"]["p50"]
        text = f"{_n(p['throughput_per_s'])} requests/s, 64 in flight (p50 {p50:.1f} ms)"
        rows.append((f"Redis protocol alone, {model}-sized requests", text))
    for model, a in sorted(c["asyncio"].items()):
        text = (
            f"{_n(a['throughput_per_s'])} requests/s, mean batch {a['mean_batch_rows']:.1f} "
            f"(p50 {a['latency_ms']['p50']:.1f} ms)"
        )
        rows.append((f"in-process asyncio batcher, {model}", text))
    return _table(("ceiling", "figure"), rows, left=2)


def phases(report: dict[str, Any]) -> list[str]:
    """Each phase's throughput, its ratios to the ceilings, and its latency percentiles."""
    rows = []
    for p in report["phases"]:
        lat, vs = p["latency_ms"], p["vs_ceiling"]
        bare, proto = vs.get("throughput_over_bare"), vs.get("throughput_over_protocol")
        rows.append(
            (
                p["id"],
                p["load"]["label"],
                str(p["worker"]["max_batch_size"]),
                _n(p["throughput_per_s"]),
                "-" if bare is None else f"{bare:.{3 if bare < 0.01 else 2}f}",
                "-" if proto is None else f"{proto:.2f}",
                *(f"{lat[k]:.1f}" for k in ("p50", "p90", "p99", "p99.9")),
                f"{p['batch_rows']['mean']:.1f}",
            )
        )
    header = ("phase", "load", "max batch", "req/s", "/ bare", "/ protocol", "p50", "p90", "p99")
    return _table((*header, "p99.9", "mean batch"), rows, left=2)


def stages(report: dict[str, Any]) -> list[str]:
    """The worker's own timings of each stage, beside the cores each process kept busy."""
    rows = []
    for p in report["phases"]:
        side, cores = p.get("worker_side"), p.get("cpu_cores") or {}
        if not side:
            continue
        s = side["stages"]
        rows.append(
            (
                p["id"],
                f"{p['latency_ms']['mean']:.2f}",
                *(
                    f"{s[k]['mean_ms']:.{3 if k == 'decode_validate' else 2}f}" if k in s else "-"
                    for k in _STAGES
                ),
                f"{side['outside_ms']:.2f}",
                *(f"{cores.get(k, 0.0):.2f}" for k in ("worker", "redis", "producers")),
            )
        )
    header = ("phase", "e2e mean", "queue wait", "decode+validate", "inference", "reply write")
    return _table((*header, "outside", "worker cores", "Redis cores", "producer cores"), rows)


def cpu(report: dict[str, Any]) -> list[str]:
    """Core-ms per request by process, and the throughput every core busy would give."""
    rows = []
    for p in report["phases"]:
        b = p.get("cpu_budget")
        if not b:
            continue
        rows.append(
            (
                p["id"],
                *(
                    f"{b[k]:.3f}"
                    for k in ("model_ms", "worker_other_ms", "redis_ms", "producers_ms", "total_ms")
                ),
                _n(b["bound_per_s"]),
                f"{b['bound_over_bare']:.{3 if b['bound_over_bare'] < 0.01 else 2}f}",
                f"{p['throughput_per_s'] / b['bound_per_s']:.2f}",
            )
        )
    header = ("phase", "model", "worker, other", "Redis", "producer", "total", "bound req/s")
    return _table((*header, "bound / bare", "measured / bound"), rows)


def redis_time(report: dict[str, Any]) -> list[str]:
    """Redis's own time per request by command: what bounds scaling out to more workers."""
    rows = []
    for p in report["phases"]:
        cmds, cores = p.get("redis_commands") or {}, p.get("cpu_cores") or {}
        if not cmds or not p["throughput_per_s"]:
            continue
        total = 1e6 * cores.get("redis", 0.0) / p["throughput_per_s"]
        cells = [
            f"{cmds[c]['us_per_request']:.1f}"
            if c in cmds and cmds[c]["calls_per_request"]
            else "-"
            for c in _REDIS_COLUMNS
        ]
        rows.append((p["id"], f"{total:.1f}", *cells))
    header = ("phase", "Redis CPU µs / request", "finish script (`evalsha`)", "`xreadgroup`")
    return _table(
        (*header, "`xadd`", "`exec` (submits)", "`rpush` (replies)", "`lpop`", "`blpop`"),
        rows,
    )


def drain(report: dict[str, Any]) -> list[str]:
    """The backlog drain as one paragraph: its rate, and the worker's memory idle and peak."""
    d = report.get("drain")
    if not d:
        return []
    rss, side, cores = d["rss_kib"], d.get("worker_side") or {}, d.get("cpu_cores") or {}
    s = side.get("stages", {})
    return [
        f"{d['requests']:,} tiny requests enqueued in {d['enqueue_s']:.1f} s, then a fresh worker "
        f"started: drained in {d['drain_s']:.1f} s, {_n(d['drain_per_s'])} requests/s, mean batch "
        f"{d['batch_rows']['mean']:.1f}, {d['ok']:,} answered OK, {d['missing']} missing. The "
        f"worker used {cores.get('worker', 0.0):.2f} core and Redis {cores.get('redis', 0.0):.2f}; "
        f"per batch it spent {s.get('inference', {}).get('mean_ms', 0.0):.2f} ms in inference, "
        f"{s.get('reply_write', {}).get('mean_ms', 0.0):.2f} ms writing, and "
        f"{s.get('decode_validate', {}).get('mean_ms', 0.0):.3f} ms a request decoding and "
        f"validating. Worker RSS: {rss['idle'] / 1024:.1f} MiB idle, "
        f"{rss['drain_peak'] / 1024:.1f} MiB peak while draining (`VmHWM`), "
        f"{rss['drain_end'] / 1024:.1f} MiB at the end."
    ]


def targets(report: dict[str, Any]) -> list[str]:
    """Each target of the performance issue, met or missed, with its rounds when it had any."""
    rows = []
    for t in report["targets"]:
        ms = "ms" in t["what"].split(":")[1]
        unit = " ms" if ms else ""
        digits = 2 if ms else 0
        rounds = t.get("round_ratios")
        rows.append(
            (
                t["what"],
                f"{_n(t['measured'], digits)}{unit}",
                f"{_n(t['reference'], digits)}{unit}",
                f"{t['ratio']:.2f}",
                f"{t['op']} {t['threshold']:g}",
                ", ".join(f"{r:.2f}" for r in rounds) if rounds else "-",
                "met" if t["met"] else "missed",
            )
        )
    header = ("target", "measured", "reference", "ratio", "needs", "rounds")
    return _table((*header, ""), rows)


SECTIONS = {
    "Ceilings": ceilings,
    "Phases": phases,
    "Where the time goes": stages,
    "CPU per request": cpu,
    "Redis per request": redis_time,
    "Drain": drain,
    "Targets": targets,
}


def render(report: dict[str, Any]) -> str:
    """Every section the report has figures for, each under its heading."""
    out = []
    for title, section in SECTIONS.items():
        lines = section(report)
        if lines:
            out += [f"### {title}", "", *lines, ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Render a python -m tools.bench --json report as the Markdown tables of "
        "docs/benchmarks.md.",
        epilog="example: python scripts/bench_markdown.py docs/bench.json > /tmp/tables.md",
    )
    parser.add_argument(
        "report", type=Path, help="a report written by python -m tools.bench --json"
    )
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.report.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        parser.error(f"cannot read {args.report}: {exc}")
    sys.stdout.write(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
