"""``python -m tools.demo``: the main job end to end on the bundled demo model.

Builds the demo model, uses REDIS_URL when it answers (or starts a throwaway redis-server on a
free port), starts a worker, sends a few thousand rows through ``redbatch run`` with a progress
bar, checks the answers against a direct ONNX Runtime run, prints the summary, and stops
everything it started. ``--external`` only produces: for compose, against workers already up.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import redis

from producer.keys import DEFAULT_PREFIX, workers_key
from tools.localredis import LocalRedis, RedisNotInstalled
from tools.synthetic import save

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo.toml"
MODEL = ROOT / "models" / "demo.onnx"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.demo",
        description="Run the redbatch demo job end to end and print its summary.",
    )
    parser.add_argument("--requests", type=int, default=5000, help="rows to send (default 5000)")
    parser.add_argument(
        "--rows-per-request", type=int, default=1, help="rows per request (default 1)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=256, help="requests in flight (default 256)"
    )
    parser.add_argument(
        "--external",
        action="store_true",
        help="only produce: use REDIS_URL and the workers already serving 'demo'",
    )
    parser.add_argument("--out", default=None, help="folder for the input and output files")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="redbatch-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    features = _features(args.requests)
    np.save(out / "features.npy", features)
    with contextlib.ExitStack() as stack:
        if args.external:
            url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
        else:
            save("demo", MODEL)
            url = stack.enter_context(_redis())
            stack.enter_context(_worker(url))
        code = _produce(url, out, args.rows_per_request, args.concurrency)
    if code in (0, 1) and not args.external:
        _check(out, features)
    return code


def _features(rows: int) -> np.ndarray:
    """Rows inside the demo config's [-10, 10] input range, from a fixed seed."""
    x = np.random.default_rng(2024).normal(scale=2.0, size=(rows, 16)).astype(np.float32)
    return np.clip(x, -9.9, 9.9)


@contextlib.contextmanager
def _redis() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url and _answers(url):
        print(f"demo: using Redis at REDIS_URL ({url.split('@')[-1]})", flush=True)
        yield url
        return
    why = "REDIS_URL does not answer" if url else "REDIS_URL is not set"
    try:
        server = LocalRedis()
    except RedisNotInstalled as exc:
        sys.exit(f"demo: {why}, and {exc}")
    with server:
        print(f"demo: {why}; started a throwaway redis-server on port {server.port}", flush=True)
        yield server.url
    print("demo: stopped the throwaway redis-server", flush=True)


def _answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        with contextlib.closing(client):
            return bool(client.ping())
    except redis.RedisError:
        return False


@contextlib.contextmanager
def _worker(url: str) -> Iterator[None]:
    env = dict(os.environ, REDIS_URL=url)
    cmd = [sys.executable, "-m", "worker", "--config", str(CONFIG), "--name", "demo-worker"]
    print(f"demo: starting a worker: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    try:
        _wait_ready(url, proc)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(f"demo: worker stopped (exit code {proc.returncode})", flush=True)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    """Wait until the worker's record appears in Redis (it registers once warm)."""
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    with contextlib.closing(client):
        while not client.scard(workers_key(DEFAULT_PREFIX, "demo")):
            if proc.poll() is not None:
                sys.exit(f"demo: the worker exited with code {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                sys.exit("demo: the worker did not become ready in time")
            time.sleep(0.1)  # a child process gives no readiness event to wait on


def _produce(url: str, out: Path, rows_per_request: int, concurrency: int) -> int:
    cmd = [
        sys.executable,
        "-m",
        "producer",
        "run",
        "--model",
        "demo",
        "--input",
        str(out / "features.npy"),
        "--output",
        str(out / "predictions.npz"),
        "--rows-per-request",
        str(rows_per_request),
        "--concurrency",
        str(concurrency),
    ]
    print(f"demo: redbatch {' '.join(cmd[3:])}", flush=True)
    return subprocess.run(cmd, env=dict(os.environ, REDIS_URL=url), check=False).returncode


def _check(out: Path, features: np.ndarray) -> None:
    """Compare the served answers with a bare onnxruntime session on the same rows."""
    import onnxruntime as ort

    served = np.load(out / "predictions.npz")
    session = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    probs, label = session.run(["probs", "label"], {"features": features})
    same = np.allclose(served["probs"], probs, atol=1e-6) and np.array_equal(served["label"], label)
    verdict = "match" if same else "DO NOT match"
    print(
        f"demo: served outputs {verdict} a direct onnxruntime run on all {len(features)} rows "
        f"(inputs and outputs in {out})",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
