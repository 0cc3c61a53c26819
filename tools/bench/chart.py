"""The report as a chart: latency (p50, p99) against throughput for each series of phases,
with the ceilings measured in the same run drawn as marks. matplotlib is optional
(``redbatch[plot]``) and imported only when a chart is drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.bench.errors import BenchError

__all__ = ["plot", "pyplot"]

_PLOT_HINT = "--plot needs matplotlib: pip install 'redbatch[plot]' (or pip install matplotlib)"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; BenchError saying how to install it if absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BenchError(_PLOT_HINT) from exc
    return plt


def plot(report: dict[str, Any], path: Path) -> None:
    """Latency (p50 and p99) against throughput for each series of phases (a sweep)."""
    series: dict[str, list[dict[str, Any]]] = {}
    for p in report["phases"]:
        if p.get("series") and p["latency_ms"]:
            series.setdefault(p["series"], []).append(p)
    if not series:
        raise BenchError(
            "--plot draws a sweep: use --scenario sweep (or all), or give several "
            "--concurrency or --rate values."
        )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, (name, phases) in enumerate(series.items()):
        points = sorted(phases, key=lambda p: p["load"]["concurrency"] or p["load"]["rate_per_s"])
        x = [p["throughput_per_s"] for p in points]
        color = colors[n % len(colors)]
        for key, style in (("p50", "o-"), ("p99", "s--")):
            y = [p["latency_ms"][key] for p in points]
            ax.plot(x, y, style, color=color, label=f"{name} {key}")
    # The ceilings of the models plotted, at the batch size their workers used.
    ceilings = report["ceilings"]
    for model, size in sorted(
        {(p["model"], p["worker"]["max_batch_size"]) for p in report["phases"] if p.get("series")}
    ):
        bare = ceilings["bare"].get(model, {}).get("batch", {}).get(str(size))
        marks = [(bare and bare["rows_per_s"], f"bare session.run {model}, batch {size}")]
        protocol = ceilings["protocol"].get(model)
        marks.append((protocol and protocol["throughput_per_s"], f"protocol only, {model}"))
        batcher = ceilings["asyncio"].get(model)
        if batcher and batcher["latency_ms"]:
            lat = batcher["latency_ms"]
            x = [batcher["throughput_per_s"]] * 2
            label = f"in-process asyncio batcher, {model} (p50, p99)"
            ax.plot(x, [lat["p50"], lat["p99"]], "k*", markersize=9, label=label)
        for x_ceiling, label in marks:
            if x_ceiling:
                ax.axvline(x_ceiling, color="grey", linestyle=":", linewidth=1)
                ax.annotate(
                    label,
                    (x_ceiling, 0.98),
                    xycoords=("data", "axes fraction"),
                    rotation=90,
                    va="top",
                    ha="right",
                    fontsize=8,
                )
    ax.set_xlim(left=0)
    ax.set_yscale("log")
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("end-to-end latency (ms)")
    m = report["machine"]
    ax.set_title(f"redbatch: latency vs throughput ({m['cpus_usable']} cores, {_device(report)})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _device(report: dict[str, Any]) -> str:
    """``CPU``, or the GPU the sessions ran on, for the chart's title."""
    m = report["machine"]
    if "CUDAExecutionProvider" in (m.get("providers") or []) and m.get("gpus"):
        return str(m["gpus"][0]).split(",")[0]
    return "CPU"
