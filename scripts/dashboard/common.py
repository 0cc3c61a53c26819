"""What every part of the snapshot run shares: the names, the intervals and the progress line."""

from __future__ import annotations

import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MODEL = "demo"
PREFIX = "redbatch"
JOB = "redbatch"
SCRAPE_S = 1
CLAIM_IDLE_MS = 3000
DASHBOARD = ROOT / "deploy" / "grafana" / "redbatch.json"

_T0 = time.monotonic()


def progress(message: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f}s] {message}", flush=True)
