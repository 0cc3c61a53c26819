#!/usr/bin/env python3
"""A worker's resident memory against entries with big extra fields (issue 26, point 4).

Starts a private redis-server and a worker process (``python -m worker``) on the synthetic
``demo`` model, serves a few honest requests, then ``XADD``s ``--entries`` entries, each with
a valid ``rid``, an honest ``body`` and an extra field of ``--field-mib`` MiB, and samples the
worker's ``VmRSS`` (``/proc/PID/status``) every 10 ms. Prints the worker's RSS before the flood,
its peak while the flood is answered, and ``--settle-s`` seconds after, and the codes the
flooded entries were answered with. Exit status 1 when the RSS after the flood is more than
``--slack-mib`` over the RSS before it, or when a flooded entry was not answered ``MALFORMED``.

    python scripts/hostile_memory.py                        # 8 entries of 60 MiB
    python scripts/hostile_memory.py --entries 4 --field-mib 20 --rounds 2

``--rounds`` floods that many times in a row; ``--honest-after`` serves honest requests after
the flood (before issue 26 the last read's entries stayed held until the next read brought
something: 8 x 60 MiB left the worker at 383 MiB from 82 while idle, 82 once served again).
Measured on the 2-core development machine after the fix: 8 x 60 MiB, before 82, peak 203,
after 83; 4 x 20 MiB twice, 82 / 121 / 102; 16 x 8 MiB twice, 82 / 98 / 90.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402
import redis  # noqa: E402

from producer.protocol.codec import decode_reply, encode_request  # noqa: E402
from producer.protocol.keys import reply_key, request_stream  # noqa: E402
from tools.localredis import LocalRedis  # noqa: E402

MIB = 1 << 20
MODEL = "demo"


def rss_kib(pid: int) -> int:
    """The process's resident memory now, in KiB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Sampler(threading.Thread):
    """The peak of a process's RSS, sampled every 10 ms until ``done`` is set."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_kib = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.01):
            self.peak_kib = max(self.peak_kib, rss_kib(self.pid))


def write_config(folder: Path, url: str, max_request_bytes: int | None) -> Path:
    """The synthetic demo model and a worker config for it."""
    from tools.synthetic import save

    model = save(MODEL, folder / f"{MODEL}.onnx")
    limits = f"[limits]\nmax_request_bytes = {max_request_bytes}\n" if max_request_bytes else ""
    config = folder / "worker.toml"
    config.write_text(
        f'[redis]\nurl = "{url}"\nprefix = "redbatch"\n\n'
        f'[model]\nname = "{MODEL}"\npath = "{model.name}"\nproviders = ["cpu"]\n\n'
        f"[batching]\nmax_batch_size = 32\nmax_wait_ms = 5\n\n[warmup]\nruns = 1\n{limits}"
    )
    return config


def body() -> bytes:
    return encode_request({"features": np.zeros((1, 16), np.float32)})


def answer(r: redis.Redis, rid: str, timeout_s: float = 60.0) -> str:
    """The code ``rid`` was answered with ("OK" when it ran)."""
    got = r.blpop([reply_key("redbatch", MODEL, rid)], timeout=timeout_s)
    if got is None:
        raise SystemExit(f"no reply for {rid} within {timeout_s} s")
    reply = decode_reply(got[1])
    return "OK" if reply.ok else str(reply.error.code if reply.error else "?")


def honest(r: redis.Redis, label: str, count: int = 5) -> None:
    stream = request_stream("redbatch", MODEL)
    rids = [f"{label}-{i}" for i in range(count)]
    for rid in rids:
        r.xadd(stream, {"rid": rid, "body": body()})
    codes = {answer(r, rid) for rid in rids}
    if codes != {"OK"}:
        raise SystemExit(f"honest requests answered {codes}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=8)
    parser.add_argument("--field-mib", type=float, default=60.0)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--slack-mib", type=float, default=100.0)
    parser.add_argument("--max-request-bytes", type=int, default=None)
    parser.add_argument(
        "--honest-after", action="store_true", help="serve honest requests after the flood"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="floods in a row (each one read at a time)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as server:
        config = write_config(Path(tmp), server.url, args.max_request_bytes)
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "--config", str(config), "--name", "hostile"],
            cwd=ROOT,
            stderr=(Path(tmp) / "worker.log").open("w"),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        r = redis.Redis.from_url(server.url, socket_timeout=120)
        try:
            honest(r, "warm")
            before = rss_kib(proc.pid)
            sampler = Sampler(proc.pid)
            sampler.start()
            junk = os.urandom(int(args.field_mib * MIB))
            stream = request_stream("redbatch", MODEL)
            started = time.monotonic()
            codes = []
            for n in range(args.rounds):
                rids = [f"big-{n}-{i}" for i in range(args.entries)]
                pipe = r.pipeline(transaction=False)
                for rid in rids:
                    pipe.xadd(stream, {"rid": rid, "body": body(), "junk": junk})
                pipe.execute()
                codes += [answer(r, rid) for rid in rids]
            del junk, pipe
            answered_s = time.monotonic() - started
            if args.honest_after:
                honest(r, "after")
            time.sleep(args.settle_s)
            sampler.done.set()
            sampler.join()
            after = rss_kib(proc.pid)
        except BaseException:
            sys.stderr.write((Path(tmp) / "worker.log").read_text()[-3000:])
            raise
        finally:
            proc.terminate()
            proc.wait(30)
            r.close()
    size = args.entries * args.field_mib
    print(f"flood: {args.entries} entries x {args.field_mib:g} MiB extra field ({size:g} MiB)")
    print(f"answered: {sorted(set(codes))} in {answered_s:.2f} s")
    print(
        f"worker RSS MiB: before {before / 1024:.0f}, peak {sampler.peak_kib / 1024:.0f}, "
        f"{args.settle_s:g} s after {after / 1024:.0f}"
    )
    bad = set(codes) != {"MALFORMED"} or (after - before) / 1024 > args.slack_mib
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
