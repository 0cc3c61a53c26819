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
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tools.services import redis_url, worker_process
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
    parser.add_argument(
        "--out",
        default=None,
        help="keep the input and output files in this folder (default: a temporary folder, "
        "removed at the end)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        return _demo(args, out, kept=True)
    with tempfile.TemporaryDirectory(prefix="redbatch-demo-") as folder:
        return _demo(args, Path(folder), kept=False)


def _demo(args: argparse.Namespace, out: Path, kept: bool) -> int:
    """The job in ``out``; ``kept``: the caller chose the folder, so it stays."""
    features = _features(args.requests)
    np.save(out / "features.npy", features)
    with contextlib.ExitStack() as stack:
        if args.external:
            url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
        else:
            save("demo", MODEL)
            url = stack.enter_context(redis_url("demo"))
            stack.enter_context(worker_process("demo", url, CONFIG, "demo", "demo-worker"))
        code = _produce(url, out, args.rows_per_request, args.concurrency)
    if code in (0, 1) and not args.external:
        _check(out, features, kept)
    return code


def _features(rows: int) -> np.ndarray:
    """Rows inside the demo config's [-10, 10] input range, from a fixed seed."""
    x = np.random.default_rng(2024).normal(scale=2.0, size=(rows, 16)).astype(np.float32)
    return np.clip(x, -9.9, 9.9)


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
    ]  # class low, a batch job's default: the worker learns its lane within lane_watch_ms
    print(f"demo: redbatch {' '.join(cmd[3:])}", flush=True)
    return subprocess.run(cmd, env=dict(os.environ, REDIS_URL=url), check=False).returncode


def _check(out: Path, features: np.ndarray, kept: bool) -> None:
    """Compare the served answers with a bare onnxruntime session on the same rows."""
    import onnxruntime as ort

    served = np.load(out / "predictions.npz")
    session = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    probs, label = session.run(["probs", "label"], {"features": features})
    same = np.allclose(served["probs"], probs, atol=1e-6) and np.array_equal(served["label"], label)
    verdict = "match" if same else "DO NOT match"
    where = f"inputs and outputs in {out}" if kept else "pass --out DIR to keep the files"
    print(
        f"demo: served outputs {verdict} a direct onnxruntime run on all {len(features)} rows "
        f"({where})",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
