"""The processes: a real worker per ``WorkerProc`` and a real ``prometheus`` scraping them.

The throwaway redis-server is ``tools.localredis.LocalRedis``; the workers' configs point at it.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.localredis import free_port

from .common import CLAIM_IDLE_MS, JOB, MODEL, PREFIX, ROOT, SCRAPE_S

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


def make_workers(work: Path, redis_url: str, names: tuple[str, ...]) -> list[WorkerProc]:
    """One ``WorkerProc`` per name, each with its own config and metrics port in ``work``."""
    workers = []
    for name in names:
        port = free_port()
        config = work / f"{name}.toml"
        config.write_text(
            WORKER_CONFIG.format(
                url=redis_url,
                prefix=PREFIX,
                model=MODEL,
                port=port,
                claim_idle_ms=CLAIM_IDLE_MS,
            ),
            encoding="utf-8",
        )
        workers.append(WorkerProc(name, config, port, work / f"{name}.log"))
    return workers
