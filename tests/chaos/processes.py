"""Worker subprocesses (``python -m worker``), their config, and the pool that restarts them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from producer.protocol.keys import worker_key

from .common import MODEL, PREFIX, ROOT, ScenarioTimeout, wait_for

if TYPE_CHECKING:
    from .run import Run


@dataclass(frozen=True, slots=True)
class Settings:
    """One scenario's worker config and model cost."""

    claim_idle_ms: int = 1000
    max_deliveries: int = 3
    max_batch_size: int = 32
    max_wait_ms: int = 5
    work_width: int = 256
    work_depth: int = 0


def write_config(workdir: Path, redis_url: str, model: Path, s: Settings) -> Path:
    """A worker config for the chaos model, one intra-op thread: several workers share 2 cores."""
    path = workdir / "worker.toml"
    path.write_text(
        f"""[redis]
url = "{redis_url}"
prefix = "{PREFIX}"

[model]
name = "{MODEL}"
path = "{model.name}"
version = "1"
providers = ["cpu"]
intra_op_threads = 1

[batching]
max_batch_size = {s.max_batch_size}
max_wait_ms = {s.max_wait_ms}

[delivery]
claim_idle_ms = {s.claim_idle_ms}
max_deliveries = {s.max_deliveries}
reply_ttl_s = 3600

[warmup]
runs = 1
"""
    )
    return path


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class WorkerProcess:
    """One ``python -m worker`` subprocess, its log file and its peak RSS (VmHWM, sampled)."""

    def __init__(self, config: Path, name: str, logdir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.faults = env.get("REDBATCH_FAULTS", "")
        self.log_path = logdir / f"{name}.{time.monotonic_ns()}.log"
        self.expected_exit = False  # set before a deliberate SIGKILL or SIGTERM
        self.peak_rss_kb = 0
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "worker", "--config", str(config), "--name", name],
                cwd=ROOT,
                env={**os.environ, **env},
                stdout=subprocess.DEVNULL,
                stderr=log,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def sample_rss(self) -> None:
        self.peak_rss_kb = max(self.peak_rss_kb, _status_kb(self.pid, "VmHWM"))

    def is_ready(self, r: redis.Redis) -> bool:
        """Registered and warm: its record in Redis names this process."""
        raw = r.get(worker_key(PREFIX, MODEL, self.name))
        if not raw:
            return False
        record = json.loads(raw)
        return bool(record.get("pid") == self.pid and record.get("state") == "ready")

    def kill(self) -> None:
        self.sample_rss()
        self.expected_exit = True
        self.proc.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.sample_rss()
        self.expected_exit = True
        self.proc.send_signal(signal.SIGTERM)

    def log_tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


Restart = Callable[["WorkerProcess"], "tuple[str, str] | None"]


class Pool:
    """Workers kept running like an orchestrator would: one that dies is restarted.

    ``restart`` decides, for a dead worker, the (name, REDBATCH_FAULTS) of its replacement, or
    None to leave it dead. Exits are seen by one waiting thread per process, not by polling.
    """

    def __init__(self, run: Run, restart: Restart | None = None) -> None:
        self.run = run
        self.restart = restart or (lambda w: (w.name, ""))
        self.workers: list[WorkerProcess] = []
        self.exits: list[tuple[str, int, bool]] = []  # (name, returncode, expected)
        self.restarts = 0
        self.peak_rss_kb = 0
        self._lock = threading.Lock()
        self._closing = False
        self._changed = threading.Condition(self._lock)
        self._sampler = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._sampler.start()

    def start(self, name: str, faults: str = "") -> WorkerProcess:
        env = {
            "REDBATCH_EXEC_LOG": str(self.run.exec_log),
            "REDBATCH_FAULTS_SEED": str(self.run.seed),
        }
        if faults:
            env["REDBATCH_FAULTS"] = faults
        worker = WorkerProcess(self.run.config, name, self.run.logdir, env)
        with self._lock:
            self.workers.append(worker)
        threading.Thread(target=self._watch, args=(worker,), daemon=True).start()
        return worker

    def _watch(self, worker: WorkerProcess) -> None:
        rc = worker.proc.wait()
        with self._lock:
            self.exits.append((worker.name, rc, worker.expected_exit))
            self.peak_rss_kb = max(self.peak_rss_kb, worker.peak_rss_kb)
            self.workers.remove(worker)
            closing = self._closing
        replacement = None if closing or rc == 0 else self.restart(worker)
        if replacement is not None:
            self.start(*replacement)
            with self._lock:
                self.restarts += 1
        with self._lock:
            self._changed.notify_all()

    def _sample(self) -> None:
        while True:
            with self._lock:
                if self._closing and not self.workers:
                    return
                for w in self.workers:
                    w.sample_rss()
                    self.peak_rss_kb = max(self.peak_rss_kb, w.peak_rss_kb)
            time.sleep(0.1)  # a sampling period: VmHWM keeps the peak between samples

    def live(self) -> list[WorkerProcess]:
        with self._lock:
            return [w for w in self.workers if w.alive()]

    def wait_ready(self, timeout_s: float = 60.0, count: int | None = None) -> list[WorkerProcess]:
        """Wait until ``count`` (default: all live) workers are registered and warm."""
        r = self.run.r

        def ready() -> bool:
            live = self.live()
            need = len(live) if count is None else count
            return sum(w.is_ready(r) for w in live) >= need > 0

        wait_for(ready, timeout_s, "workers to be ready")
        return [w for w in self.live() if w.is_ready(r)]

    def wait_exits(self, count: int, timeout_s: float) -> None:
        """Block until ``count`` worker exits have been seen in all."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while len(self.exits) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ScenarioTimeout(f"timed out waiting for {count} worker exits")
                self._changed.wait(left)

    @property
    def kills(self) -> int:
        return sum(1 for _, rc, _ in self.exits if rc == -signal.SIGKILL)

    @property
    def crashes(self) -> list[str]:
        """Exits nobody asked for: anything but a SIGKILL (ours or a fault point's) or exit 0."""
        return [f"{n} exited {rc}" for n, rc, _ in self.exits if rc not in (0, -signal.SIGKILL)]

    def stop(self, timeout_s: float = 30.0) -> list[tuple[str, int]]:
        """SIGTERM every worker and wait; returns (name, returncode) of those stopped."""
        with self._lock:
            self._closing = True
            workers = list(self.workers)
        for w in workers:
            w.terminate()
        stopped = []
        for w in workers:
            try:
                stopped.append((w.name, w.proc.wait(timeout=timeout_s)))
            except subprocess.TimeoutExpired:
                w.kill()
                stopped.append((w.name, w.proc.wait()))
        return stopped
