#!/usr/bin/env python3
"""Draw deploy/grafana/redbatch.json from a real run: the nearest thing to a Grafana screenshot.

Grafana cannot be installed where this was written, but Prometheus can. So this script runs the
real pieces (a throwaway redis-server, two real workers as subprocesses with ``[metrics] port``
set, and a real ``prometheus`` scraping them every second), drives a varied load for
``--duration-s`` seconds, then evaluates every panel's own PromQL through Prometheus' HTTP API
with the dashboard's template variables filled in the way Grafana fills them, and draws the
panels with matplotlib in the JSON's own layout (gridPos). The image says on itself that it was
drawn with matplotlib, not Grafana.

The load: steady closed-loop traffic (``Client.map``) whose request size changes twice, a few
percent invalid requests (wrong shape, wrong dtype, out of range: INVALID_INPUT; a body that is
not msgpack: MALFORMED), two cancelled requests, a burst queued at once that builds a backlog,
two dead letters (entries whose rid cannot name a reply key), a worker killed with SIGKILL during
the burst while it holds entries and started again under a new name (the workers run with
``claim_idle_ms = 3000``, so its entries are reclaimed about 3 s later and its consumer removed
about 6 s after that), a Redis restart (AOF on, so nothing is lost: one outage per worker) and a
worker stopped with SIGTERM and started again.

It also lists counter series whose first sample was already above zero: rate() and increase()
never see the increments made before Prometheus first scraped a series (workers export every
known label at 0 from the start, so there should be none).

Every query that fails or returns no series is printed and marked on its panel, so the run is
also a check that the dashboard's queries are valid PromQL on the metrics the worker exports.
Exit status: 0 when every query returned data, 1 when any failed or came back empty, 2 when the
run itself could not be done (no prometheus or redis-server binary, a worker did not start).

Needs redis-server and prometheus on PATH (Debian: apt-get install redis-server prometheus).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import redis  # noqa: E402

from producer.client import Client  # noqa: E402
from producer.codec import encode_request  # noqa: E402
from producer.keys import CONSUMER_GROUP, request_stream  # noqa: E402
from worker.localredis import LocalRedis, free_port  # noqa: E402
from worker.synthetic import save  # noqa: E402

MODEL = "demo"
PREFIX = "redbatch"
JOB = "redbatch"
SCRAPE_S = 1
CLAIM_IDLE_MS = 3000
DASHBOARD = ROOT / "deploy" / "grafana" / "redbatch.json"

_T0 = time.monotonic()


def progress(message: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f}s] {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# The processes: Redis, workers, Prometheus


WORKER_CONFIG = """\
# Written by scripts/dashboard_snapshot.py: configs/demo.toml with a metrics port, CPU only, and
# a short claim_idle_ms so that a killed worker's entries are reclaimed within the run.
[redis]
url = "{url}"
prefix = "{prefix}"

[model]
name = "{model}"
path = "demo.onnx"
version = "1"
providers = ["cpu"]

[batching]
max_batch_size = 32
max_wait_ms = 5

[limits]
max_request_bytes = 1048576
reject_non_finite = true

[inputs.features]
min = -10.0
max = 10.0

[warmup]
runs = 5

[delivery]
claim_idle_ms = {claim_idle_ms}

[metrics]
port = {port}
"""

PROMETHEUS_CONFIG = """\
# Written by scripts/dashboard_snapshot.py.
global:
  scrape_interval: {scrape}s
  evaluation_interval: {scrape}s
scrape_configs:
  - job_name: {job}
    metrics_path: /metrics
    static_configs:
      - targets: [{targets}]
"""


def http_get(url: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    """GET ``url``: the status and body, also for an HTTP error status."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_http_ok(url: str, what: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} while starting")
        with contextlib.suppress(OSError):
            if http_get(url, timeout_s=1.0)[0] == 200:
                return
        time.sleep(0.2)  # polling a process that gives no readiness event
    raise RuntimeError(f"{what} did not answer {url} within {timeout_s:.0f}s")


@dataclass
class WorkerProc:
    name: str
    config: Path
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    names: list[str] = field(default_factory=list)  # every --name it ran under, in order

    @property
    def instance(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def label(self) -> str:
        return ", then ".join(self.names or [self.name])

    def start(self) -> None:
        self.starts += 1
        if self.name not in self.names:
            self.names.append(self.name)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "worker", "--config", str(self.config), "--name", self.name],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_http_ok(f"http://{self.instance}/readyz", f"worker {self.name}", self.proc, 90)

    def stop(self) -> int | None:
        """SIGTERM and wait: the worker answers what it has read and exits 0."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> int | None:
        """SIGKILL and reap: whatever it had read stays pending on its consumer name."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.kill()
        return self.proc.wait()


@dataclass
class PrometheusProc:
    binary: str
    workdir: Path
    targets: list[str]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        config = self.workdir / "prometheus.yml"
        config.write_text(
            PROMETHEUS_CONFIG.format(
                scrape=SCRAPE_S, job=JOB, targets=", ".join(f"'{t}'" for t in self.targets)
            ),
            encoding="utf-8",
        )
        with (self.workdir / "prometheus.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_http_ok(f"{self.url}/-/ready", "prometheus", self.proc, 60)

    def version(self) -> str:
        status, body = http_get(f"{self.url}/api/v1/status/buildinfo")
        return json.loads(body)["data"]["version"] if status == 200 else "?"

    def api(self, path: str, **params: Any) -> dict[str, Any]:
        status, body = http_get(f"{self.url}{path}?{urllib.parse.urlencode(params, doseq=True)}")
        try:
            return json.loads(body)
        except ValueError:
            return {"status": "error", "error": f"HTTP {status}: {body[:200]!r}"}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------------------------------
# The load


class Load:
    """Traffic from a few threads; counts the outcome codes the callers saw."""

    def __init__(self, url: str, duration_s: float, burst_n: int) -> None:
        self.url = url
        self.duration_s = duration_s
        self.burst_n = burst_n
        self._burst: list[tuple[str, bytes]] = []
        self.stop = threading.Event()
        self.codes: Counter[str] = Counter()
        self.client_errors: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def count(self, code: str, n: int = 1) -> None:
        with self._lock:
            self.codes[code] += n

    def spawn(self, target: Callable[[], None], name: str) -> None:
        def guarded() -> None:
            try:
                target()
            except Exception as exc:  # a load thread failing must not hide the rest of the run
                progress(f"load thread {name} failed: {type(exc).__name__}: {exc}")
                with self._lock:
                    self.client_errors[type(exc).__name__] += 1

        thread = threading.Thread(target=guarded, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def join(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=90)

    def _shape(self) -> tuple[int, float]:
        """Rows per request and the pause between rounds: three steady phases."""
        f = self.elapsed() / self.duration_s
        if f < 0.35:
            return 1, 0.30
        if f < 0.72:
            return 4, 0.20
        return 8, 0.12

    def steady(self) -> None:
        """Closed loop: 40 requests in flight at most 8 at a time, then a pause, repeated."""
        rng = np.random.default_rng(1)
        with Client(MODEL, self.url) as client:
            while not self.stop.is_set():
                rows, pause_s = self._shape()
                x = rng.uniform(-1, 1, (rows * 40, 16)).astype(np.float32)
                for chunk in client.map(
                    {"features": x}, rows_per_request=rows, concurrency=8, timeout_s=60
                ):
                    self.count("OK" if chunk.error is None else chunk.error.code)
                self.stop.wait(pause_s)

    def invalid(self) -> None:
        """One bad request every 0.25 s, four kinds in turn; each reply is read and counted."""
        good = np.zeros((2, 16), np.float32)
        kinds: list[tuple[str, Any]] = [
            ("wrong shape", {"features": np.zeros((2, 15), np.float32)}),
            ("wrong dtype", {"features": good.astype(np.float64)}),
            ("out of range", {"features": good + 50.0}),
            ("not msgpack", b"\xc1 this is not msgpack"),
        ]
        raw = redis.Redis.from_url(self.url)
        stream = request_stream(PREFIX, MODEL)
        n = 0
        with Client(MODEL, self.url) as client:
            while not self.stop.wait(0.25):
                _, payload = kinds[n % len(kinds)]
                rid = f"snapshot-bad-{n}"
                n += 1
                try:
                    if isinstance(payload, bytes):
                        raw.xadd(stream, {"rid": rid, "body": payload})
                    else:
                        client.submit(payload, rid=rid)
                    result = client.wait(rid, 60)
                except (redis.RedisError, OSError) as exc:  # the Redis restart: counted, skipped
                    with self._lock:
                        self.client_errors[f"invalid sender: {type(exc).__name__}"] += 1
                    continue
                except Exception as exc:  # WaitTimeout and friends from the client
                    with self._lock:
                        self.client_errors[f"invalid sender: {type(exc).__name__}"] += 1
                    continue
                self.count("OK" if result.error is None else result.error.code)
        raw.close()

    def cancelled(self, how_many: int = 2) -> None:
        """Requests whose cancel key is set before they are queued: answered CANCELLED."""
        with Client(MODEL, self.url) as client:
            for i in range(how_many):
                rid = f"snapshot-cancel-{i}"
                client.cancel(rid)
                client.submit({"features": np.zeros((1, 16), np.float32)}, rid=rid)
                result = client.wait(rid, 60)
                self.count("OK" if result.error is None else result.error.code)

    def dead_letter(self, n: int) -> None:
        """An entry whose rid cannot name a reply key: the worker dead-letters it."""
        raw = redis.Redis.from_url(self.url)
        body = encode_request({"features": np.zeros((1, 16), np.float32)})
        raw.xadd(request_stream(PREFIX, MODEL), {"rid": f"not a valid rid #{n}", "body": body})
        raw.close()

    def prepare_burst(self) -> None:
        """Encode the burst before it is due, so sending it is only pipelined XADDs."""
        rng = np.random.default_rng(2)
        x = rng.uniform(-1, 1, (self.burst_n, 1, 16)).astype(np.float32)
        self._burst = [
            (f"snapshot-burst-{i}", encode_request({"features": row})) for i, row in enumerate(x)
        ]

    def burst(self) -> None:
        """Queue ``burst_n`` requests as fast as Redis takes them: a backlog builds, then drains.

        The demo model is so small that the workers answer a few thousand requests a second on
        two CPU cores, faster than a Python producer encodes them; so the burst is encoded
        beforehand and sent in pipelines of 2,000 (the same fields Client.submit sends).
        """
        raw = redis.Redis.from_url(self.url)
        stream = request_stream(PREFIX, MODEL)
        began = time.monotonic()
        for i in range(0, len(self._burst), 2000):
            pipe = raw.pipeline(transaction=False)
            for rid, body in self._burst[i : i + 2000]:
                pipe.xadd(stream, {"rid": rid, "body": body})
            pipe.execute()
        raw.close()
        rids = [rid for rid, _ in self._burst]
        progress(f"burst: {len(rids)} requests queued in {time.monotonic() - began:.1f}s")
        with Client(MODEL, self.url) as client:
            for i in range(0, len(rids), 500):
                for result in client.wait_many(rids[i : i + 500], 300):
                    self.count("OK" if result.error is None else result.error.code)
        progress(f"burst: all {len(rids)} answered, {time.monotonic() - began:.1f}s after start")


# ---------------------------------------------------------------------------------------------
# The dashboard's queries


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


# ---------------------------------------------------------------------------------------------
# Drawing


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


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class Event:
    at: float  # fraction of the duration
    label: str
    action: Callable[[], None]
    wall: float | None = None


def dashboard_name(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(ROOT))
    return str(path)


def flatten(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(
            "Run 2 real workers, a throwaway Redis and a real Prometheus under a varied load, "
            "evaluate every panel of the Grafana dashboard through Prometheus and draw it with "
            "matplotlib (a stand-in for a Grafana screenshot)."
        ),
        epilog="Needs redis-server and prometheus on PATH. Exit 1 when a query failed or was "
        "empty, 2 when the run could not be done.",
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs" / "dashboard.png", help="PNG to write"
    )
    parser.add_argument(
        "--duration-s", type=float, default=150.0, help="load duration (default 150)"
    )
    parser.add_argument(
        "--burst",
        type=int,
        default=60000,
        help="requests queued at once, a fifth of the way in (default 60000)",
    )
    parser.add_argument(
        "--dashboard", type=Path, default=DASHBOARD, help="Grafana dashboard JSON to draw"
    )
    parser.add_argument(
        "--rate-interval",
        default=None,
        help="value for $__rate_interval (default: what Grafana computes for a 1 s scrape "
        "interval and this range, i.e. 4 x scrape interval)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the temporary directory (logs, TSDB)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    binary = shutil.which("prometheus")
    if binary is None:
        print("prometheus is not on PATH (Debian: apt-get install prometheus)", file=sys.stderr)
        return 2
    dashboard = json.loads(args.dashboard.read_text(encoding="utf-8"))
    panels = flatten(dashboard)
    work = Path(tempfile.mkdtemp(prefix="redbatch-dashboard-"))
    progress(f"working directory {work}")
    server = LocalRedis("--appendonly", "yes")  # AOF: the mid-run restart keeps the stream
    prom: PrometheusProc | None = None
    workers: list[WorkerProc] = []
    try:
        server.start()
        progress(f"redis-server on port {server.port}")
        save(MODEL, work / "demo.onnx")
        for name in ("w1", "w2"):
            port = free_port()
            config = work / f"{name}.toml"
            config.write_text(
                WORKER_CONFIG.format(
                    url=server.url,
                    prefix=PREFIX,
                    model=MODEL,
                    port=port,
                    claim_idle_ms=CLAIM_IDLE_MS,
                ),
                encoding="utf-8",
            )
            workers.append(WorkerProc(name, config, port, work / f"{name}.log"))
        prom = PrometheusProc(binary, work, [w.instance for w in workers])
        prom.start()
        progress(f"prometheus {prom.version()} on {prom.url}, scraping every {SCRAPE_S}s")
        for w in workers:
            w.start()
            progress(f"worker {w.name} ready, metrics on {w.instance}")
        time.sleep(4)  # a few scrapes of the idle workers before the load
        result = drive(args, server, workers)
        time.sleep(3 * SCRAPE_S)  # the last scrapes
        return render(args, dashboard, panels, prom, workers, result)
    except RuntimeError as exc:
        progress(f"the run could not be done: {exc}")
        return 2
    finally:
        for w in workers:
            w.stop()
        if prom is not None:
            prom.stop()
        server.close()
        if args.keep:
            progress(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


@dataclass
class RunResult:
    start: float
    end: float
    events: list[Event]
    codes: Counter[str]
    client_errors: Counter[str]
    consumers: dict[str, int]  # the group's consumers at the end, with their pending counts


def group_state(url: str) -> tuple[int, dict[str, int]]:
    """XLEN of the request stream and the group's consumers with their pending entries."""
    raw = redis.Redis.from_url(url)
    try:
        stream = request_stream(PREFIX, MODEL)
        consumers = {}
        for c in raw.xinfo_consumers(stream, CONSUMER_GROUP):
            name = c["name"]
            consumers[name.decode() if isinstance(name, bytes) else str(name)] = int(c["pending"])
        return int(raw.xlen(stream)), consumers
    finally:
        raw.close()


def scheduled_events(
    args: argparse.Namespace, load: Load, server: LocalRedis, workers: list[WorkerProc]
) -> list[Event]:
    """The run's events, at fractions of the duration; each runs on the main thread."""
    w1, w2 = workers

    def restart_redis() -> None:
        server.restart()
        progress(f"redis-server restarted on port {server.port} (AOF kept the data)")

    def restart_worker() -> None:
        status = w2.stop()
        progress(f"{w2.name} stopped by SIGTERM, exit status {status}; starting it again in 6s")
        time.sleep(6)
        w2.start()
        progress(f"{w2.name} ready again")

    def kill_worker() -> None:
        """SIGKILL w1 while the burst keeps it busy, then start it again under a new name: the
        entries it held stay pending on the old name until a worker reclaims them (after
        claim_idle_ms), and the old name is removed once idle and empty (2 x claim_idle_ms)."""
        old, new = w1.name, f"{w1.name}b"
        status = w1.kill()
        backlog, consumers = group_state(server.url)
        held = consumers.get(old, 0)
        kill.label = f"{old} SIGKILL holding {held} entries, back as {new}"
        progress(
            f"{old} killed by SIGKILL (status {status}) holding {held} entries, backlog "
            f"{backlog}; starting it again as {new}"
        )
        time.sleep(1)
        w1.name = new
        w1.start()
        progress(f"{new} ready on {w1.instance}")

    kill = Event(0.26, f"{w1.name} SIGKILL + restart as {w1.name}b", kill_worker)
    return [
        Event(0.10, "2 cancelled requests", load.cancelled),
        Event(0.22, f"burst of {args.burst}", lambda: load.spawn(load.burst, "burst")),
        kill,
        Event(0.40, "dead letter", lambda: load.dead_letter(1)),
        Event(0.50, "Redis restart", restart_redis),
        Event(0.62, "w2 SIGTERM + restart", restart_worker),
        Event(0.82, "dead letter", lambda: load.dead_letter(2)),
    ]


def drive(args: argparse.Namespace, server: LocalRedis, workers: list[WorkerProc]) -> RunResult:
    duration = args.duration_s
    load = Load(server.url, duration, args.burst)
    load.prepare_burst()
    events = scheduled_events(args, load, server, workers)
    wall_start = time.time()
    load.started = time.monotonic()
    progress(f"load for {duration:.0f}s: steady closed loop + ~4 invalid requests/s")
    load.spawn(load.steady, "steady")
    load.spawn(load.invalid, "invalid")
    for ev in events:
        wait_s = ev.at * duration - load.elapsed()
        if wait_s > 0:
            time.sleep(wait_s)
        ev.wall = time.time()
        progress(f"event at {load.elapsed():.0f}s: {ev.label}")
        ev.action()
    last = 0.0
    while (left := duration - load.elapsed()) > 0:
        time.sleep(min(left, 10.0))
        if load.elapsed() - last >= 20:
            last = load.elapsed()
            with load._lock:
                seen = dict(load.codes)
            progress(f"{load.elapsed():.0f}s: outcomes so far {seen}")
    wall_end = time.time()
    progress("stopping the load")
    load.join()
    progress(f"outcomes seen by the callers: {dict(load.codes)}")
    if load.client_errors:
        progress(f"client-side errors (the Redis restart): {dict(load.client_errors)}")
    backlog, consumers = group_state(server.url)
    progress(f"at the end: backlog {backlog}, group consumers (pending) {consumers}")
    return RunResult(wall_start, wall_end, events, load.codes, load.client_errors, consumers)


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
    interval, rate_interval = grafana_intervals(end - start, 1000, SCRAPE_S)
    rate_interval = args.rate_interval or rate_interval
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
            f"evaluated by Prometheus {prom.version()} on a real run of 2 workers",
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


if __name__ == "__main__":
    sys.exit(main())
