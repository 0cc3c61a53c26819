"""Drawing: the dashboard's panels with matplotlib in the JSON's own layout (gridPos)."""

from __future__ import annotations

import io
import math
import textwrap
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from .queries import TargetResult

BG, PANEL, BORDER = "#111217", "#181b1f", "#2c3235"
TEXT, MUTED, GRID = "#d8d9da", "#8e8e8e", "#2a2d31"
PALETTE = [
    "#73bf69",
    "#f2cc0c",
    "#8ab8ff",
    "#ff780a",
    "#f2495c",
    "#5794f2",
    "#b877d9",
    "#fade2a",
    "#96d98d",
    "#ff9830",
]
ROW_PX, HEADER_PX, WIDTH_PX, DPI = 34, 230, 1920, 100
HEADER_LINES, HEADER_CHARS = 8, 225  # caption lines that fit above the panels, chars per line


def fmt_value(v: float, unit: str, decimals: int | None = None) -> str:
    if v is None or math.isnan(v):
        return "-"
    if unit == "percentunit":
        return f"{v * 100:.{1 if decimals is None else decimals}f}%"
    if unit == "s":
        a = abs(v)
        if a == 0:
            return "0 s"
        if a < 1e-3:
            return f"{v * 1e6:.3g} µs"
        if a < 1:
            return f"{v * 1e3:.3g} ms"
        return f"{v:.3g} s"
    suffix = " req/s" if unit == "reqps" else ""
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g}M{suffix}"
    if a >= 1e4:
        return f"{v / 1e3:.3g}K{suffix}"
    if decimals is not None:
        return f"{v:.{decimals}f}{suffix}"
    if a >= 100 or v == int(v):
        return f"{v:.0f}{suffix}"
    return f"{v:.3g}{suffix}"


def _unit(panel: dict[str, Any]) -> tuple[str, int | None]:
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    return defaults.get("unit", "short"), defaults.get("decimals")


class Canvas:
    def __init__(self, panels: list[dict[str, Any]]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt = plt
        rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
        self.height_px = HEADER_PX + rows * ROW_PX + 12
        self.fig = plt.figure(figsize=(WIDTH_PX / DPI, self.height_px / DPI), dpi=DPI)
        self.fig.patch.set_facecolor(BG)
        self.col_px = (WIDTH_PX - 16) / 24

    def box(self, pos: dict[str, int], pad: float = 4) -> tuple[float, float, float, float]:
        """A gridPos as (left, bottom, width, height) in pixels from the bottom left."""
        left = 8 + pos["x"] * self.col_px + pad
        top = HEADER_PX + pos["y"] * ROW_PX + pad
        width = pos["w"] * self.col_px - 2 * pad
        height = pos["h"] * ROW_PX - 2 * pad
        return left, self.height_px - top - height, width, height

    def axes(self, left: float, bottom: float, width: float, height: float) -> Any:
        w, h = WIDTH_PX, self.height_px
        return self.fig.add_axes((left / w, bottom / h, width / w, height / h))

    def text(self, x: float, y: float, s: str, **kw: Any) -> None:
        # "$" would start matplotlib mathtext; the dashboard's variables are plain text here.
        self.fig.text(x / WIDTH_PX, y / self.height_px, s.replace("$", r"\$"), **kw)

    def header(self, title: list[str], lines: list[str]) -> None:
        for i, line in enumerate(title):
            self.text(
                16, self.height_px - 32 - 24 * i, line, color=TEXT, fontsize=16, weight="bold"
            )
        top = self.height_px - 40 - 24 * len(title)
        wrapped = [w for line in lines for w in textwrap.wrap(line, HEADER_CHARS)]
        if len(wrapped) > HEADER_LINES:
            wrapped = [*wrapped[: HEADER_LINES - 1], wrapped[HEADER_LINES - 1] + " …"]
        for i, line in enumerate(wrapped):
            self.text(16, top - 18 * i, line, color=MUTED, fontsize=10.5)

    def panel_frame(self, panel: dict[str, Any]) -> tuple[float, float, float, float]:
        left, bottom, width, height = self.box(panel["gridPos"])
        ax = self.axes(left, bottom, width, height)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_facecolor(PANEL)
        for spine in ax.spines.values():
            spine.set_color(BORDER)
        self.text(left + 10, bottom + height - 20, panel["title"], color=TEXT, fontsize=11.5)
        return left, bottom, width, height

    def row(self, panel: dict[str, Any]) -> None:
        left, bottom, _, _ = self.box(panel["gridPos"], pad=0)
        self.text(left + 12, bottom + 6, "⌄ " + panel["title"], color=TEXT, fontsize=13)

    def message(self, box: tuple[float, float, float, float], text: str, color: str) -> None:
        left, bottom, width, height = box
        self.text(
            left + width / 2, bottom + height / 2, text, color=color, fontsize=12, ha="center"
        )

    def stat(self, panel: dict[str, Any], results: list[TargetResult]) -> None:
        box = self.panel_frame(panel)
        left, bottom, width, height = box
        unit, decimals = _unit(panel)
        result = results[0]
        if result.error:
            self.message(box, "query error", PALETTE[4])
            return
        if not result.series:
            self.message(box, "no data", MUTED)
            return
        series = result.series[0]
        ax = self.axes(left + 1, bottom + 1, width - 2, height * 0.45)
        ax.set_axis_off()
        ok = ~np.isnan(series.v)
        ax.fill_between(series.t[ok], series.v[ok], color=PALETTE[0], alpha=0.18, linewidth=0)
        ax.plot(series.t[ok], series.v[ok], color=PALETTE[0], linewidth=1)
        ax.set_xlim(series.t[0], series.t[-1])
        lo, hi = float(np.nanmin(series.v)), float(np.nanmax(series.v))
        ax.set_ylim(min(0.0, lo), hi * 1.05 if hi > 0 else 1)
        value = result.instant
        if value is None:
            value = float(series.v[ok][-1]) if ok.any() else float("nan")
        self.text(
            left + width / 2,
            bottom + height * 0.42,
            fmt_value(value, unit, decimals),
            color=PALETTE[0],
            fontsize=30,
            weight="bold",
            ha="center",
        )

    def timeseries(
        self,
        panel: dict[str, Any],
        results: list[TargetResult],
        span: tuple[float, float],
        events: list[float],
    ) -> None:
        import matplotlib.dates as mdates
        from matplotlib.ticker import FuncFormatter

        box = self.panel_frame(panel)
        left, bottom, width, height = box
        unit, decimals = _unit(panel)
        series = [s for r in results for s in r.series]
        errors = [r for r in results if r.error]
        empty = [r for r in results if not r.error and not r.series]
        if not series:
            self.message(
                box, "query error" if errors else "no data", PALETTE[4] if errors else MUTED
            )
            return
        line_px = 14.5
        legend_px = line_px * (len(series) + 1) + 6
        ax = self.axes(left + 74, bottom + legend_px + 24, width - 86, height - legend_px - 54)
        ax.set_facecolor(PANEL)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.grid(color=GRID, linewidth=0.8)
        ax.tick_params(colors=MUTED, labelsize=8.5, length=0)
        ax.tick_params(axis="x", pad=7)
        t0, t1 = span
        for ev in events:
            ax.axvline(datetime.fromtimestamp(ev), color="#5a5f66", linewidth=0.8, linestyle=":")
        for i, s in enumerate(series):
            color = PALETTE[i % len(PALETTE)]
            times = [datetime.fromtimestamp(t) for t in s.t]
            ax.plot(times, s.v, color=color, linewidth=1.2)
            ax.fill_between(times, s.v, color=color, alpha=0.08, linewidth=0)
        ax.set_xlim(datetime.fromtimestamp(t0), datetime.fromtimestamp(t1))
        ymin = min(0.0, float(np.nanmin([np.nanmin(s.v) for s in series])))
        ymax = float(np.nanmax([np.nanmax(s.v) for s in series]))
        ax.set_ylim(ymin, ymax * 1.08 if ymax > 0 else 1)
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
        ax.xaxis.set_major_locator(mdates.SecondLocator(bysecond=[0, 30]))
        whole = all(np.allclose(s.v[~np.isnan(s.v)] % 1, 0) for s in series)
        ax.yaxis.set_major_locator(self.plt.MaxNLocator(4, integer=whole))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_value(v, unit, None)))
        # Grafana's legend table: name, then mean, max and last (not null).
        cols = [("Mean", np.nanmean), ("Max", np.nanmax), ("Last *", None)]
        top = bottom + legend_px
        col_x = [left + width - 270 + 95 * j for j in range(len(cols))]
        for j, (label, _) in enumerate(cols):
            self.text(col_x[j], top - line_px, label, color=PALETTE[5], fontsize=9, ha="right")
        for i, s in enumerate(series):
            y = top - line_px * (i + 2)
            color = PALETTE[i % len(PALETTE)]
            self.text(left + 12, y, "▬", color=color, fontsize=9)
            self.text(left + 28, y, s.name[:70], color=TEXT, fontsize=9)
            ok = s.v[~np.isnan(s.v)]
            for j, (_, fn) in enumerate(cols):
                v = (fn(ok) if fn else ok[-1]) if ok.size else float("nan")
                self.text(
                    col_x[j], y, fmt_value(v, unit, decimals), color=TEXT, fontsize=9, ha="right"
                )
        notes = [f"query error: {r.error[:60]}" for r in errors]
        notes += [f"no data: {r.legend or r.expr[:40]}" for r in empty]
        if notes:
            self.text(
                left + width - 10,
                bottom + height - 20,
                "; ".join(notes),
                color=PALETTE[4] if errors else MUTED,
                fontsize=8.5,
                ha="right",
            )

    def save(self, out: Path) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        from PIL import Image

        buffer = io.BytesIO()
        self.fig.savefig(buffer, dpi=DPI, facecolor=BG, format="png")
        self.plt.close(self.fig)
        # 256 colours are plenty for flat panels and thin lines, at a third of the bytes.
        image = Image.open(buffer).convert("RGB").quantize(colors=256)
        image.save(out, optimize=True)
