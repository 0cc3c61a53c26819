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
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The parts live in scripts/dashboard/, found through this script's directory on sys.path.
from dashboard.common import DASHBOARD, MODEL, SCRAPE_S, progress  # noqa: E402
from dashboard.report import render  # noqa: E402
from dashboard.stack import PrometheusProc, WorkerProc, make_workers  # noqa: E402
from dashboard.timeline import drive  # noqa: E402

from tools.localredis import LocalRedis  # noqa: E402
from tools.synthetic import save  # noqa: E402


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
    try:
        server.start()
        progress(f"redis-server on port {server.port}")
        save(MODEL, work / "demo.onnx")
        workers = make_workers(work, server.url, ("w1", "w2"))
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


if __name__ == "__main__":
    sys.exit(main())
