"""The dashboard's queries: its PromQL with the template variables filled in as Grafana does,
evaluated through Prometheus' HTTP API."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .common import SCRAPE_S, progress
from .stack import PrometheusProc


@dataclass
class Series:
    labels: dict[str, str]
    t: np.ndarray
    v: np.ndarray
    name: str = ""


@dataclass
class TargetResult:
    expr: str
    query: str
    legend: str
    series: list[Series] = field(default_factory=list)
    error: str | None = None
    instant: float | None = None  # stat panels: the value at the end


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Replace ``$name`` and ``${name}`` (longest names first), as Grafana does before sending."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    return expr


def legend_name(fmt: str, labels: dict[str, str]) -> str:
    if not fmt:
        inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
        return f"{labels.get('__name__', '')}{{{inner}}}"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def with_gaps(values: list[list[Any]], step: float) -> tuple[np.ndarray, np.ndarray]:
    """Samples on a step grid with NaN where Prometheus returned none: Grafana draws a gap."""
    t = np.array([float(t) for t, _ in values])
    v = np.array([float(v) for _, v in values])
    grid = np.arange(t[0], t[-1] + step / 2, step)
    out = np.full(grid.shape, np.nan)
    out[np.rint((t - t[0]) / step).astype(int)] = v
    return grid, out


def run_target(
    prom: PrometheusProc,
    expr: str,
    legend: str,
    variables: dict[str, str],
    window: tuple[float, float, float],
    instant: bool,
) -> TargetResult:
    start, end, step = window
    query = substitute(expr, variables)
    out = TargetResult(expr, query, legend)
    if "$" in query:
        out.error = f"unsubstituted variable in {query!r}"
        return out
    got = prom.api("/api/v1/query_range", query=query, start=start, end=end, step=step)
    if got.get("status") != "success":
        out.error = str(got.get("error", got))
        return out
    for item in got["data"]["result"]:
        t, v = with_gaps(item["values"], step)
        series = Series(item["metric"], t, v)
        series.name = legend_name(legend, item["metric"])
        out.series.append(series)
    out.series.sort(key=lambda s: s.name)
    if instant:
        now = prom.api("/api/v1/query", query=query, time=end)
        if now.get("status") != "success":
            out.error = str(now.get("error", now))
        elif now["data"]["result"]:
            out.instant = float(now["data"]["result"][0]["value"][1])
    return out


def counter_births(prom: PrometheusProc, window: tuple[float, float, float]) -> list[str]:
    """Counter series first scraped above zero: rate() and increase() miss those increments."""
    start, end, step = window
    query = '{__name__=~"redbatch_.*_total"}'
    got = prom.api("/api/v1/query_range", query=query, start=start, end=end, step=step)
    notes = []
    for item in got.get("data", {}).get("result", []):
        first, last = float(item["values"][0][1]), float(item["values"][-1][1])
        if first <= 0:
            continue
        labels = item["metric"]
        name = labels.pop("__name__").removeprefix("redbatch_")
        what = ",".join(
            f"{k}={v}" for k, v in sorted(labels.items()) if k not in {"job", "instance"}
        )
        unseen = "all of them unseen" if last == first else f"ended at {last:g}"
        where = labels.get("instance", "?")
        notes.append(f"{name}{{{what}}} first scraped at {first:g} on {where} ({unseen})")
    return sorted(notes)


def grafana_intervals(range_s: float, width_px: int, scrape_s: float) -> tuple[str, str]:
    """``$__interval`` and ``$__rate_interval`` as Grafana computes them for this range.

    $__interval is the range over the panel's width in pixels, at least the data source's scrape
    interval; $__rate_interval is max($__interval + scrape interval, 4 x scrape interval).
    """
    interval = max(range_s / width_px, scrape_s)
    rate = max(interval + scrape_s, 4 * scrape_s)
    return f"{math.ceil(interval)}s", f"{math.ceil(rate)}s"


def template_variables(
    dashboard: dict[str, Any],
    prom: PrometheusProc,
    span: tuple[float, float],
    rate_interval_override: str | None,
) -> dict[str, str]:
    """The values Grafana would send for the dashboard's variables over ``span`` (start, end)."""
    start, end = span
    interval, rate_interval = grafana_intervals(end - start, 1000, SCRAPE_S)
    rate_interval = rate_interval_override or rate_interval
    # The $job variable: its own query, then "All" (allValue) as Grafana sends it.
    variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "job")
    match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
    jobs: list[str] = []
    if match:
        got = prom.api(f"/api/v1/label/{match.group(2)}/values", **{"match[]": match.group(1)})
        jobs = got.get("data", []) if got.get("status") == "success" else []
    progress(f"$job: {variable['definition']} -> {jobs}; using All = {variable['allValue']!r}")
    variables = {
        "job": variable.get("allValue") or "|".join(jobs),
        "__rate_interval": rate_interval,
        "__interval": interval,
        "__range": f"{math.ceil(end - start)}s",
        "datasource": "",
    }
    progress(f"$__interval = {interval}, $__rate_interval = {rate_interval}")
    return variables
