"""The pipeline part of the report: each pipeline phase's stages and verdict, and the reference
the image example's target is set against. Reads the report dict only, as ``report.py`` does."""

from __future__ import annotations

from typing import Any

__all__ = ["format_pipelines", "image_reference"]

IMAGE_PHASE = "pipeline/image"


def image_reference(report: dict[str, Any]) -> float | None:
    """Requests/s the image phase is set against: the lesser of its preprocessing alone on the
    same threads and bare ``session.run`` at its max_batch_size (None without both)."""
    phase = next((p for p in report["phases"] if p["id"] == IMAGE_PHASE), None)
    if phase is None:
        return None
    ceilings = report["ceilings"]
    alone = (ceilings.get("preprocess") or {}).get(phase["model"])
    size = str(phase["worker"]["max_batch_size"])
    bare = ceilings["bare"].get(phase["model"], {}).get("batch", {}).get(size)
    if not alone or not bare:
        return None
    rows = max(int(alone.get("rows_per_request", 1)), 1)
    return min(float(alone["requests_per_s"]), float(bare["rows_per_s"]) / rows)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_pipelines(report: dict[str, Any]) -> list[str]:
    """Per pipeline phase: hook ms per request, busy shares, CPU, the verdict; and for the
    image example its stages alone and the shared-cores bound."""
    rows = [p for p in report["phases"] if p.get("pipeline")]
    if not rows:
        return []
    lines = [
        "",
        "pipelines (ms per request in the hooks, wall and CPU; busy: share of the hook "
        "threads' time, and of the model's (one run at a time); cpu: cores the worker used; "
        "verdict: producer.ops.stages, as redbatch status --watch says it)",
        f"{'phase':<24} {'threads':>7} {'pre ms':>7} {'pre cpu':>7} {'post ms':>7} "
        f"{'post cpu':>8} {'hooks':>6} {'model':>6} {'cpu':>5} {'req/s':>7}",
    ]
    for p in rows:
        v = p["pipeline"]
        ms, busy = v["per_request_ms"], v["busy"]
        lines.append(
            f"{p['id']:<24} {v['threads']:>7} {_ms(ms['preprocess']):>7} "
            f"{_ms(ms['preprocess_cpu']):>7} {_ms(ms['postprocess']):>7} "
            f"{_ms(ms['postprocess_cpu']):>8} {busy['hooks']:>6.0%} {busy['model']:>6.0%} "
            f"{v['cpu_cores']['worker']:>5.2f} {p['throughput_per_s']:>7,.0f}"
        )
        lines.append(f"  {v['verdict']}")
        b = v.get("bounds")
        if b:
            lines.append(
                f"  over the lesser of preprocessing alone ({b['preprocess_alone_per_s']:,.0f}"
                f"/s) and bare session.run ({b['bare_per_s']:,.0f}/s): {b['over_lesser']:.2f};"
                f" over the shared-cores bound ({b['shared_cores_per_s']:,.0f}/s, the cores "
                f"doing both stages' CPU for every request): {b['over_shared_cores']:.2f}"
            )
    return lines
