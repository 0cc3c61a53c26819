"""The cost of lanes on the tensor path: how fast one worker drains the same backlog of tiny
requests queued in one lane (version 2's stream) and spread over N tenant lanes, alternating,
each drain timed from the worker's start to its ``--burst`` exit (warmup excluded: the worker
logs when it is ready). Issue 28: with 64 tenant lanes at least 0.9 of one lane's rate.

    .venv/bin/python scripts/lanes_drain.py --requests 20000 --lanes 64 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ is not installed

from producer.protocol import keys
from producer.protocol.codec import encode_request
from producer.protocol.lanes import lane_stream, lanes_key
from tools.localredis import LocalRedis
from tools.synthetic import save

ROOT = Path(__file__).resolve().parents[1]
MODEL = "demo"
P = keys.DEFAULT_PREFIX


def _fill(r: redis.Redis, requests: int, lanes: int) -> None:
    """``requests`` one-row requests, round-robin over ``lanes`` tenant lanes (1: v2's stream)."""
    body = encode_request({"features": np.zeros((1, 16), np.float32)})
    streams = (
        [keys.request_stream(P, MODEL)]
        if lanes == 1
        else [lane_stream(P, MODEL, "normal", f"t{i:02d}") for i in range(lanes)]
    )
    pipe = r.pipeline(transaction=False)
    for i in range(requests):
        stream = streams[i % len(streams)]
        if lanes > 1 and i < lanes:
            pipe.sadd(lanes_key(P, MODEL), stream)
        pipe.xadd(stream, {"rid": f"t{i % lanes:02d}.r{i}" if lanes > 1 else f"r{i}", "body": body})
        if i % 2000 == 1999:
            pipe.execute()
    pipe.execute()


def _drain(config: Path, url: str) -> float:
    """Seconds from the worker's ready line to its ``--burst`` exit."""
    cmd = [sys.executable, "-m", "worker", "--config", str(config), "--burst", "--name", "d"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True, env={"REDIS_URL": url}
    )
    assert proc.stderr is not None
    ready = None
    for line in proc.stderr:
        if ready is None and " ready " in line:
            ready = time.perf_counter()
    proc.wait()
    if proc.returncode != 0 or ready is None:
        raise SystemExit(f"worker failed (exit {proc.returncode}, ready seen: {ready is not None})")
    return time.perf_counter() - ready


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--lanes", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder, LocalRedis() as server:
        model = save(MODEL, Path(folder) / "demo.onnx")
        config = Path(folder) / "demo.toml"
        config.write_text(
            f'[redis]\nurl = "{server.url}"\n[model]\nname = "{MODEL}"\npath = "{model}"\n'
            'providers = ["cpu"]\n[batching]\nmax_batch_size = 32\nmax_wait_ms = 2\n'
            f"[scheduling]\nmax_lanes = {max(args.lanes + 1, 2)}\n"
        )
        r = redis.Redis.from_url(server.url)
        rates: dict[int, list[float]] = {1: [], args.lanes: []}
        for _ in range(args.rounds):
            for lanes in (1, args.lanes):
                r.flushall()
                _fill(r, args.requests, lanes)
                rates[lanes].append(args.requests / _drain(config, server.url))
        one, many = statistics.median(rates[1]), statistics.median(rates[args.lanes])
        print(f"1 lane:     {', '.join(f'{x:,.0f}' for x in rates[1])} requests/s")
        print(
            f"{args.lanes} lanes:   {', '.join(f'{x:,.0f}' for x in rates[args.lanes])} requests/s"
        )
        ratios = [m / o for o, m in zip(rates[1], rates[args.lanes], strict=True)]
        print(f"ratio (median of pairs): {statistics.median(ratios):.3f}")
        cost_us = (1 / many - 1 / one) * 1e6
        print(f"cost: {cost_us:.2f} us per request with {args.lanes} lanes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
