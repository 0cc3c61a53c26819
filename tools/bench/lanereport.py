"""The lanes presets' figures in the report: their targets (issue 28's "Done when") and table.

``lanes.py`` and ``tenants.py`` keep what they measured under ``report["lanes"]``; the targets
here take the same shape as ``report.targets``'s (measured, reference, ratio, met), so that the
report lists them with the others.
"""

from __future__ import annotations

from typing import Any

__all__ = ["format_lanes", "lane_targets", "make_target"]


def make_target(
    target_id: str, what: str, measured: float, reference: float, op: str, threshold: float
) -> dict[str, Any]:
    """One target of the report: ``measured / reference`` held against ``threshold``."""
    ratio = measured / reference if reference else 0.0
    met = ratio >= threshold if op == ">=" else ratio <= threshold
    return {
        "id": target_id,
        "what": what,
        "measured": measured,
        "reference": reference,
        "ratio": ratio,
        "op": op,
        "threshold": threshold,
        "met": bool(met),
    }


def lane_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each lanes criterion the report has the figures for."""
    lanes = report.get("lanes") or {}
    found = []
    backlog = lanes.get("backlog")
    if backlog:
        rows = backlog["enqueue"]["low_rows"]
        found.append(
            make_target(
                "lanes-caller-p99",
                f"high caller behind {rows:,} low rows: p99 ms over max(3 x idle p99, idle p99 "
                "+ 3 x the backlog's mean batch run)",
                backlog["busy"]["p99"],
                backlog["p99_bound_ms"],
                "<=",
                1.0,
            )
        )
        found.append(
            make_target(
                "lanes-caller-p99-mixed-runs",
                "the same, the mean batch run taken over every run while the caller ran (its "
                "own one-row runs included)",
                backlog["busy"]["p99"],
                backlog["p99_bound_with_caller_runs_ms"],
                "<=",
                1.0,
            )
        )
        found.append(
            make_target(
                "lanes-drain",
                "backlog rows/s with the high caller over without it",
                backlog["drain_with_caller_rows_per_s"],
                backlog["drain_alone_rows_per_s"],
                ">=",
                0.9,
            )
        )
    for part in lanes.get("tenants") or []:
        label = ":".join(map(str, part["weights"]))
        found.append(
            make_target(
                f"lanes-tenants-{label}",
                f"tenants at {label}: worst rows ratio over 100 batches off the weights' "
                "(1 + error)",
                1.0 + part["worst_error"],
                1.0,
                "<=",
                1.10,
            )
        )
    share = lanes.get("min_share")
    if share:
        found.append(
            make_target(
                "lanes-min-share",
                "low class's share of rows under a saturating high backlog over min_share_low "
                "(within 20%: 0.8 to 1.2)",
                share["low_share"],
                share["min_share_low"],
                "<=" if share["low_share"] > share["min_share_low"] else ">=",
                1.2 if share["low_share"] > share["min_share_low"] else 0.8,
            )
        )
    return found


def format_lanes(report: dict[str, Any]) -> list[str]:
    """The lanes presets' figures as lines (none when they did not run)."""
    lanes = report.get("lanes") or {}
    lines: list[str] = []
    backlog = lanes.get("backlog")
    if backlog:
        idle, busy, e = backlog["idle"], backlog["busy"], backlog["enqueue"]
        lines += [
            "",
            f"lanes-backlog  {e['low_rows']:,} low + {e['normal_rows']:,} normal rows "
            f"({e['rows_per_request']} a request) queued in {e['seconds']:.1f} s",
            f"  high caller idle: p50 {idle['p50']:.2f} ms, p99 {idle['p99']:.2f} ms; behind "
            f"the backlog: p50 {busy['p50']:.2f} ms, p99 {busy['p99']:.2f} ms "
            f"({backlog['busy_requests']} requests), bound {backlog['p99_bound_ms']:.2f} ms "
            f"(the backlog's mean batch run {backlog['mean_run_ms']:.2f} ms; every run's while "
            f"the caller ran {backlog['mean_run_with_caller_ms']:.2f} ms: bound "
            f"{backlog['p99_bound_with_caller_runs_ms']:.2f} ms); the caller's mean queue wait "
            f"on the worker {backlog['high_wait_ms']:.2f} ms",
            f"  backlog drain: {backlog['drain_alone_rows_per_s']:,.0f} rows/s alone, "
            f"{backlog['drain_with_caller_rows_per_s']:,.0f} with the caller "
            f"= {backlog['drain_ratio']:.3f}",
        ]
    for part in lanes.get("tenants") or []:
        label = ":".join(map(str, part["weights"]))
        lines.append(
            f"lanes-tenants {label}: {part.get('windows', 0)} windows of 100 batches over "
            f"{part.get('batches_contended', 0)} contended batches: ratio "
            f"{part['ratio_min']:.3f} to {part['ratio_max']:.3f} (want {part['want']:.2f}), "
            f"worst {100 * part['worst_error']:.1f}% off"
        )
    share = lanes.get("min_share")
    if share:
        lines.append(
            f"lanes min share: low got {100 * share['low_share']:.2f}% of the rows "
            f"(configured {100 * share['min_share_low']:g}%), {share['rows_per_s']:,.0f} rows/s"
        )
    return lines
