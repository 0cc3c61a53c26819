"""The report: every panel's targets evaluated and drawn, with the run told in the caption."""

from __future__ import annotations

import argparse
import contextlib
from datetime import datetime
from pathlib import Path
from typing import Any

from .canvas import Canvas
from .common import CLAIM_IDLE_MS, ROOT, SCRAPE_S, progress
from .queries import counter_births, run_target, template_variables
from .stack import PrometheusProc, WorkerProc
from .timeline import RunResult


def dashboard_name(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(ROOT))
    return str(path)


def draw_panels(
    canvas: Canvas,
    panels: list[dict[str, Any]],
    prom: PrometheusProc,
    variables: dict[str, str],
    window: tuple[float, float, float],
    marks: list[float],
) -> tuple[list[str], int]:
    """Evaluate every target of every panel and draw it; returns the problems and the count."""
    problems: list[str] = []
    n_queries = 0
    for panel in panels:
        if panel["type"] == "row":
            canvas.row(panel)
            continue
        results = []
        for target in panel.get("targets", []):
            n_queries += 1
            r = run_target(
                prom,
                target["expr"],
                target.get("legendFormat", ""),
                variables,
                window,
                instant=panel["type"] == "stat",
            )
            results.append(r)
            what = f"{panel['title']!r} [{target.get('refId', '?')}]"
            if r.error:
                problems.append(f"QUERY ERROR {what}: {r.error}\n    {r.query}")
                progress(f"QUERY ERROR {what}: {r.error}")
            elif not r.series:
                problems.append(f"NO DATA {what}: {r.query}")
                progress(f"NO DATA {what}")
            else:
                progress(f"ok {what}: {len(r.series)} series")
        if panel["type"] == "stat":
            canvas.stat(panel, results)
        else:
            canvas.timeseries(panel, results, (window[0], window[1]), marks)
    return problems, n_queries


def render(
    args: argparse.Namespace,
    dashboard: dict[str, Any],
    panels: list[dict[str, Any]],
    prom: PrometheusProc,
    workers: list[WorkerProc],
    run: RunResult,
) -> int:
    start, end = run.start - 10, run.end + 2
    variables = template_variables(dashboard, prom, (start, end), args.rate_interval)
    rate_interval = variables["__rate_interval"]
    window = (start, end, float(SCRAPE_S))
    canvas = Canvas(panels)
    marks = [e.wall for e in run.events if e.wall]
    problems, n_queries = draw_panels(canvas, panels, prom, variables, window, marks)
    births = counter_births(prom, window)
    for note in births:
        progress(f"counter born above 0: {note}")
    unseen = sorted({n.split(" first")[0] for n in births if "all of them unseen" in n})
    stamp = datetime.fromtimestamp(run.start).strftime("%Y-%m-%d %H:%M:%S")
    events = ", ".join(
        f"{datetime.fromtimestamp(e.wall).strftime('%H:%M:%S')} {e.label}"
        for e in run.events
        if e.wall
    )
    codes = ", ".join(f"{k} {v}" for k, v in sorted(run.codes.items(), key=lambda kv: -kv[1]))
    instances = ", ".join(f"{w.label} = {w.instance}" for w in workers)
    group = ", ".join(f"{name} ({n} pending)" for name, n in sorted(run.consumers.items()))
    lines = [
        f"Run {stamp}, {run.end - run.start:.0f}s of load on the CPU demo model "
        f"(scripts/dashboard_snapshot.py); scrape interval {SCRAPE_S}s; "
        f"$job = All (.*), $__rate_interval = {rate_interval}. Workers: {instances}.",
        f"Events (dotted lines): {events}.",
        f"Outcomes the callers saw: {codes}. Consumers left in the group: {group}. "
        f"claim_idle_ms = {CLAIM_IDLE_MS}. Dashboard time zone: browser (local time).",
        f"{n_queries} queries, {len(problems)} with an error or no data"
        + (": see the panels marked." if problems else "."),
    ]
    if births:
        lines.append(
            f"{len(births)} counter series were first scraped above 0 (a labelled child exists "
            "from its first increment), so rate()/increase() miss their first counts"
            + (f"; wholly unseen: {', '.join(unseen)}" if unseen else "")
        )
    canvas.header(
        [
            f"redbatch dashboard ({dashboard_name(args.dashboard)}): every panel's own PromQL "
            f"evaluated by Prometheus {prom.version()} on a real run of {len(workers)} workers",
            "— drawn with matplotlib, not Grafana (Grafana is not installable here)",
        ],
        lines,
    )
    canvas.save(args.out)
    size_kb = args.out.stat().st_size / 1024
    progress(f"wrote {args.out} ({size_kb:.0f} KB)")
    print(f"\n{n_queries} queries in {len(panels)} panels: {len(problems)} problem(s)")
    for p in problems:
        print(f"  {p}")
    return 1 if problems else 0
