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
worker stopped with SIGTERM and started again. Beside them a third worker, ``p1``, serves the
same model under another name through a pipeline (``[pipeline]``: a preprocess that costs CPU
outside the GIL, a postprocess that turns scores into labels), with a load of its own that
turns from light to heavy for the last third of the run, so that the "Pipeline" row shows its
hook threads saturating while its model idles.

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
import json
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The parts live in scripts/dashboard/, found through this script's directory on sys.path.
from dashboard.common import DASHBOARD, MODEL, SCRAPE_S, progress  # noqa: E402
from dashboard.report import render  # noqa: E402
from dashboard.stack import PrometheusProc, WorkerProc, make_workers  # noqa: E402
from dashboard.timeline import drive  # noqa: E402

from producer.client.blocking import Client  # noqa: E402
from producer.protocol.errors import RedbatchError  # noqa: E402
from tools.localredis import LocalRedis, free_port  # noqa: E402
from tools.synthetic import save  # noqa: E402

PIPELINE_MODEL = "demo-pipeline"
PIPELINE_HANDLER = """\
import hashlib

import numpy as np


class Features:
    \"\"\"The demo model behind a pipeline: a preprocess that hashes a buffer (CPU outside the
    GIL, as decoding an image costs), a postprocess that names the best class.\"\"\"

    inputs = {"features": {"dtype": "float32", "shape": [-1, 16]}}
    outputs = {"label": {"dtype": "string", "shape": [-1]},
               "score": {"dtype": "float32", "shape": [-1]}}

    def __init__(self, work_bytes=4194304):
        self.buffer = bytes(work_bytes)

    def preprocess(self, inputs):
        hashlib.sha256(self.buffer).digest()
        return {"features": np.clip(inputs["features"], -10.0, 10.0)}

    def postprocess(self, outputs, inputs):
        probs = outputs["probs"]
        best = probs.argmax(axis=1)
        labels = np.array([f"class-{i}" for i in best], dtype=object)
        return {"label": labels, "score": probs.max(axis=1).astype(np.float32)}
"""
PIPELINE_CONFIG = """\
# Written by scripts/dashboard_snapshot.py: the demo model behind a pipeline, on one hook thread.
[redis]
url = "{url}"
prefix = "redbatch"

[model]
name = "{model}"
path = "demo.onnx"
version = "1"
providers = ["cpu"]

[batching]
max_batch_size = 32
max_wait_ms = 5

[pipeline]
handler = "snapshot_handler:Features"
threads = 1

[warmup]
runs = 2

[metrics]
port = {port}
"""


def make_pipeline_worker(work: Path, redis_url: str) -> WorkerProc:
    """``p1``: the demo model behind a pipeline, serving ``PIPELINE_MODEL``."""
    (work / "snapshot_handler.py").write_text(PIPELINE_HANDLER, encoding="utf-8")
    port = free_port()
    config = work / "p1.toml"
    config.write_text(
        PIPELINE_CONFIG.format(url=redis_url, model=PIPELINE_MODEL, port=port), encoding="utf-8"
    )
    return WorkerProc("p1", config, port, work / "p1.log")


class PipelineLoad(threading.Thread):
    """One-row requests to ``p1``, up to 16 in flight: paced for the first two thirds of the
    run, then as fast as the worker answers, which its single hook thread cannot keep up with.
    It runs until the last scrapes are in, so that the stat panels' last values are of it."""

    def __init__(self, url: str, duration_s: float) -> None:
        super().__init__(name="pipeline-load", daemon=True)
        self.url, self.duration_s = url, duration_s
        self.stop = threading.Event()
        self.codes: Counter[str] = Counter()

    def run(self) -> None:
        started = time.monotonic()
        rng = np.random.default_rng(3)
        with Client(PIPELINE_MODEL, self.url) as client:
            while not self.stop.is_set():
                heavy = time.monotonic() - started > self.duration_s * 2 / 3
                x = rng.uniform(-1, 1, (64 if heavy else 4, 16)).astype(np.float32)
                try:
                    chunks = client.map(
                        {"features": x}, rows_per_request=1, concurrency=16, timeout_s=60
                    )
                    for chunk in chunks:
                        self.codes["OK" if chunk.error is None else chunk.error.code] += 1
                except RedbatchError as exc:  # the Redis restart: go on once it is back
                    self.codes[type(exc).__name__] += 1
                    self.stop.wait(1.0)
                if not heavy:
                    self.stop.wait(0.25)


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
    # AOF: the mid-run restart keeps the stream; a maxmemory, so the memory panels have one
    server = LocalRedis(
        "--appendonly", "yes", "--maxmemory", "64mb", "--maxmemory-policy", "noeviction"
    )
    prom: PrometheusProc | None = None
    workers: list[WorkerProc] = []
    piped: WorkerProc | None = None
    pipeline_load: PipelineLoad | None = None
    try:
        server.start()
        progress(f"redis-server on port {server.port}")
        save(MODEL, work / "demo.onnx")
        workers = make_workers(work, server.url, ("w1", "w2"))
        piped = make_pipeline_worker(work, server.url)
        prom = PrometheusProc(binary, work, [w.instance for w in (*workers, piped)])
        prom.start()
        progress(f"prometheus {prom.version()} on {prom.url}, scraping every {SCRAPE_S}s")
        for w in (*workers, piped):
            w.start()
            progress(f"worker {w.name} ready, metrics on {w.instance}")
        time.sleep(4)  # a few scrapes of the idle workers before the load
        pipeline_load = PipelineLoad(server.url, args.duration_s)
        pipeline_load.start()
        result = drive(args, server, workers)
        time.sleep(3 * SCRAPE_S)  # the last scrapes
        pipeline_load.stop.set()
        pipeline_load.join(timeout=90)
        progress(f"pipeline worker p1: outcomes {dict(pipeline_load.codes)}")
        return render(args, dashboard, panels, prom, [*workers, piped], result)
    except RuntimeError as exc:
        progress(f"the run could not be done: {exc}")
        return 2
    finally:
        if pipeline_load is not None:
            pipeline_load.stop.set()
        for w in [*workers, *([piped] if piped else [])]:
            w.stop()
        if prom is not None:
            prom.stop()
        server.close()
        if args.keep:
            progress(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
