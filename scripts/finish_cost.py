#!/usr/bin/env python3
"""What the worker's finish step costs Redis per entry, and the worker per batch, by reply size.

Starts a private redis-server, then for each reply size adds entries, reads them as one
consumer, finishes them in batches with ``RequestStream.finish`` (the worker's own code), and
reads Redis's time from ``INFO commandstats`` (the script and any plain commands it is sent
with). Run it from two checkouts (``PYTHONPATH=/path/to/other/checkout``) to compare two
versions of the finish step in one sitting; docs/design.md has the figures.

    .venv/bin/python scripts/finish_cost.py [--batches 150] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after PYTHONPATH, so another checkout given there wins

from tools.localredis import LocalRedis  # noqa: E402
from worker.redisio.stream import Finish, RequestStream  # noqa: E402

STREAM = "redbatch:{demo}:requests"
_COMMANDS = ("evalsha", "eval", "rpush", "expire")


def measure(r: redis.Redis, reply_bytes: int, batches: int, size: int) -> tuple[float, float]:
    """Redis µs per finished entry, and the finish round trip in ms per batch."""
    r.flushall()
    stream = RequestStream(r, "redbatch", "demo", "me")
    stream.ensure_group()
    reply = b"x" * reply_bytes
    r.config_resetstat()
    spent_s = 0.0
    for b in range(batches):
        pipe = r.pipeline(transaction=False)
        for i in range(size):
            pipe.xadd(STREAM, {"rid": f"r{b}-{i}", "body": b"b" * 100})
        pipe.execute()
        [(_, entries)] = r.xreadgroup("workers", "me", {STREAM: ">"}, count=size)
        items = [Finish(eid, fields[b"rid"].decode(), reply, 3600) for eid, fields in entries]
        started = time.perf_counter()
        if stream.finish(items) != size:
            raise SystemExit("the finish step left entries unfinished")
        spent_s += time.perf_counter() - started
    stats = r.info("commandstats")
    redis_us = sum(stats.get(f"cmdstat_{c}", {}).get("usec", 0) for c in _COMMANDS)
    return redis_us / (batches * size), spent_s / batches * 1000


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=150, help="batches per size (150)")
    parser.add_argument("--batch-size", type=int, default=32, help="entries per batch (32)")
    parser.add_argument(
        "--sizes", default="256,4096,65536", help="reply sizes in bytes (256,4096,65536)"
    )
    args = parser.parse_args(argv)
    with LocalRedis() as server:
        r = redis.Redis.from_url(server.url)
        for reply_bytes in (int(x) for x in args.sizes.split(",")):
            batches = args.batches if reply_bytes < 65536 else max(args.batches // 3, 1)
            redis_us, batch_ms = measure(r, reply_bytes, batches, args.batch_size)
            print(
                f"reply {reply_bytes:>7} B: Redis {redis_us:7.2f} us per entry, "
                f"finish round trip {batch_ms:6.2f} ms per batch of {args.batch_size}"
            )
        r.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
