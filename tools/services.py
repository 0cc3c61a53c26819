"""What the demo and the examples start and stop: a Redis (REDIS_URL when it answers, else a
throwaway redis-server) and a worker process, each announced on stdout under ``label``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import redis

from producer.protocol.keys import DEFAULT_PREFIX, workers_key
from producer.redisio.topology import Topology
from tools.localredis import LocalRedis, RedisNotInstalled

__all__ = ["answers", "redis_url", "worker_process"]

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def redis_url(label: str) -> Iterator[str]:
    """REDIS_URL when it answers, else a throwaway redis-server's URL, stopped on exit."""
    url = os.environ.get("REDIS_URL")
    if url and answers(url):
        print(f"{label}: using Redis at REDIS_URL ({url.split('@')[-1]})", flush=True)
        yield url
        return
    why = "REDIS_URL does not answer" if url else "REDIS_URL is not set"
    try:
        server = LocalRedis()
    except RedisNotInstalled as exc:
        _fail(label, f"{why}, and {exc}")
    with server:
        print(f"{label}: {why}; started a throwaway redis-server on port {server.port}", flush=True)
        yield server.url
    print(f"{label}: stopped the throwaway redis-server", flush=True)


def answers(url: str) -> bool:
    """Whether a Redis answers PING at ``url`` within a second."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        with contextlib.closing(client):
            return bool(client.ping())
    except redis.RedisError:
        return False


@contextlib.contextmanager
def worker_process(
    label: str, url: str, config: Path, model: str, name: str, ready_within_s: float = 180.0
) -> Iterator[None]:
    """``python -m worker`` on ``config`` as ``name``, ready (registered, so warm) before this
    yields; stopped with SIGTERM, as an orchestrator stops it, on exit."""
    cmd = [sys.executable, "-m", "worker", "--config", str(config), "--name", name]
    print(f"{label}: starting a worker: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, env=dict(os.environ, REDIS_URL=url), cwd=ROOT)
    try:
        _wait_ready(label, url, model, proc, ready_within_s)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(f"{label}: worker stopped (exit code {proc.returncode})", flush=True)


def _wait_ready(
    label: str, url: str, model: str, proc: subprocess.Popen[bytes], timeout_s: float
) -> None:
    """Wait until the worker's record appears in Redis (it registers once warm); on a cluster,
    on the master of the model's slot, wherever ``url`` points."""
    seed = redis.Redis.from_url(url)
    topology = Topology(seed)
    deadline = time.monotonic() + timeout_s
    with contextlib.closing(seed), contextlib.closing(topology):
        topology.refresh()
        client = topology.client(model)
        while not client.scard(workers_key(DEFAULT_PREFIX, model)):
            if proc.poll() is not None:
                _fail(label, f"the worker exited with code {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                _fail(label, f"the worker was not ready within {timeout_s:.0f} s")
            time.sleep(0.1)  # a child process gives no readiness event to wait on


def _fail(label: str, message: str) -> NoReturn:
    print(f"{label}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)
