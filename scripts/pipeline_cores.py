"""The image example against its stages alone, with the cores split between the stages or shared.

Issue 19's target: the image pipeline served through Redis does at least 0.8 of the lesser of
its preprocessing alone (same threads) and bare ``session.run`` at ``max_batch_size``, measured
in the same run. On a CPU-only machine the two stages draw on the same cores, so the target
depends on how they are given them; this script measures both ways, alternating, in one run:

- ``split``: one core each, ``pipeline.threads = 1`` and ``model.intra_op_threads = 1``; each
  reference gets the one core its stage has.
- ``shared``: the shipped config, ``pipeline.threads = 2`` and onnxruntime's default threads;
  each reference gets the whole machine, which the served pipeline can never have for both.

Usage: ``.venv/bin/python scripts/pipeline_cores.py [--rounds 2] [--seconds 8]`` after
``python scripts/fetch_models.py image``. Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from producer import Client  # noqa: E402
from producer.protocol.keys import workers_key  # noqa: E402
from tools.localredis import LocalRedis  # noqa: E402

EXAMPLE = ROOT / "examples" / "image"
LAYOUTS = {"split": (1, 1), "shared": (2, 0)}  # (pipeline.threads, model.intra_op_threads)


def _handler() -> tuple[Any, dict[str, Any], dict[str, Any]]:
    config = tomllib.loads((EXAMPLE / "config.toml").read_text(encoding="utf-8"))
    spec = importlib.util.spec_from_file_location("handler", EXAMPLE / "handler.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    handler = module.OrientationPipeline(**config["pipeline"]["options"])
    return handler, handler.warmup_inputs(), config


def preprocess_alone(handler: Any, raw: dict[str, Any], threads: int, seconds: float) -> float:
    """Images per second through ``preprocess`` alone on ``threads`` threads."""
    done, started = 0, time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        while time.perf_counter() - started < seconds:
            list(pool.map(lambda _: handler.preprocess(raw), range(threads * 8)))
            done += threads * 8
    return done / (time.perf_counter() - started)


def bare(model: Path, x: np.ndarray, intra_op: int, batch: int, seconds: float) -> float:
    """Rows per second through bare ``session.run`` at ``batch`` rows."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the worker
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    feeds = {session.get_inputs()[0].name: np.concatenate([x] * batch)}
    for _ in range(3):
        session.run(None, feeds)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        session.run(None, feeds)
        done += batch
    return done / (time.perf_counter() - started)


def served(url: str, image: bytes, threads: int, intra_op: int, seconds: float) -> float:
    """Images per second through a worker on the example's config, 64 requests in flight."""
    text = (EXAMPLE / "config.toml").read_text(encoding="utf-8")
    text = text.replace("threads = 2 ", f"threads = {threads} ")
    text = text.replace(
        'providers = ["cuda", "cpu"]', f'providers = ["cpu"]\nintra_op_threads = {intra_op}'
    )
    config = (
        EXAMPLE / f".cores-{threads}-{intra_op}.toml"
    )  # next to handler.py, as the worker wants
    config.write_text(text, encoding="utf-8")
    env = dict(os.environ, REDIS_URL=url, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "worker", "--config", str(config), "--name", "cores"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    r = redis.Redis.from_url(url)
    key = workers_key("redbatch", "orientation")
    try:
        ready_by = time.monotonic() + 120
        while not r.scard(key):  # a child process gives no readiness event to wait on
            if proc.poll() is not None:
                raise SystemExit(f"the worker exited with code {proc.returncode}")
            if time.monotonic() > ready_by:
                raise SystemExit("the worker was not ready within 120 s")
            time.sleep(0.2)
        with Client("orientation", url) as client:
            rows = (image for _ in range(10**7))
            done, started = 0, None
            for chunk in client.map({"image": rows}, rows_per_request=1, concurrency=64):
                chunk.raise_for_error()
                if started is None:  # from the first reply: the window is full by then
                    started = time.perf_counter()
                    continue
                done += 1
                if time.perf_counter() - started > seconds:
                    break
            return done / (time.perf_counter() - (started or time.perf_counter()))
    finally:
        proc.terminate()
        proc.wait(30)
        config.unlink()
        while r.scard(key):
            time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    handler, raw, config = _handler()
    model = (EXAMPLE / config["model"]["path"]).resolve()
    batch = int(config["batching"]["max_batch_size"])
    x = handler.preprocess(raw)["x"]
    with LocalRedis() as server:
        for round_ in range(args.rounds):
            for layout, (threads, intra_op) in LAYOUTS.items():
                alone = preprocess_alone(handler, raw, threads, args.seconds / 2)
                bare_rows = bare(model, x, intra_op, batch, args.seconds / 2)
                got = served(server.url, raw["image"][0], threads, intra_op, args.seconds)
                line = {
                    "round": round_,
                    "layout": layout,
                    "pipeline_threads": threads,
                    "intra_op_threads": intra_op,
                    "preprocess_alone_per_s": round(alone, 1),
                    f"bare_at_{batch}_per_s": round(bare_rows, 1),
                    "served_per_s": round(got, 1),
                    "over_lesser": round(got / min(alone, bare_rows), 3),
                }
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
