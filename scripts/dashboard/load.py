"""The load: steady closed-loop traffic, invalid and cancelled requests, dead letters, a burst."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import redis

from producer.client.blocking import Client
from producer.protocol.codec import encode_request
from producer.protocol.keys import request_stream

from .common import MODEL, PREFIX, progress


class Load:
    """Traffic from a few threads; counts the outcome codes the callers saw."""

    def __init__(self, url: str, duration_s: float, burst_n: int) -> None:
        self.url = url
        self.duration_s = duration_s
        self.burst_n = burst_n
        self._burst: list[tuple[str, bytes]] = []
        self.stop = threading.Event()
        self.codes: Counter[str] = Counter()
        self.client_errors: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def count(self, code: str, n: int = 1) -> None:
        with self._lock:
            self.codes[code] += n

    def spawn(self, target: Callable[[], None], name: str) -> None:
        def guarded() -> None:
            try:
                target()
            except Exception as exc:  # a load thread failing must not hide the rest of the run
                progress(f"load thread {name} failed: {type(exc).__name__}: {exc}")
                with self._lock:
                    self.client_errors[type(exc).__name__] += 1

        thread = threading.Thread(target=guarded, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def join(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=90)

    def _shape(self) -> tuple[int, float]:
        """Rows per request and the pause between rounds: three steady phases."""
        f = self.elapsed() / self.duration_s
        if f < 0.35:
            return 1, 0.30
        if f < 0.72:
            return 4, 0.20
        return 8, 0.12

    def steady(self) -> None:
        """Closed loop: 40 requests in flight at most 8 at a time, then a pause, repeated."""
        rng = np.random.default_rng(1)
        with Client(MODEL, self.url) as client:
            while not self.stop.is_set():
                rows, pause_s = self._shape()
                x = rng.uniform(-1, 1, (rows * 40, 16)).astype(np.float32)
                for chunk in client.map(
                    {"features": x}, rows_per_request=rows, concurrency=8, timeout_s=60
                ):
                    self.count("OK" if chunk.error is None else chunk.error.code)
                self.stop.wait(pause_s)

    def invalid(self) -> None:
        """One bad request every 0.25 s, four kinds in turn; each reply is read and counted."""
        good = np.zeros((2, 16), np.float32)
        kinds: list[tuple[str, Any]] = [
            ("wrong shape", {"features": np.zeros((2, 15), np.float32)}),
            ("wrong dtype", {"features": good.astype(np.float64)}),
            ("out of range", {"features": good + 50.0}),
            ("not msgpack", b"\xc1 this is not msgpack"),
        ]
        raw = redis.Redis.from_url(self.url)
        stream = request_stream(PREFIX, MODEL)
        n = 0
        with Client(MODEL, self.url) as client:
            while not self.stop.wait(0.25):
                _, payload = kinds[n % len(kinds)]
                rid = f"snapshot-bad-{n}"
                n += 1
                try:
                    if isinstance(payload, bytes):
                        raw.xadd(stream, {"rid": rid, "body": payload})
                    else:
                        client.submit(payload, rid=rid)
                    result = client.wait(rid, 60)
                except (redis.RedisError, OSError) as exc:  # the Redis restart: counted, skipped
                    with self._lock:
                        self.client_errors[f"invalid sender: {type(exc).__name__}"] += 1
                    continue
                except Exception as exc:  # WaitTimeout and friends from the client
                    with self._lock:
                        self.client_errors[f"invalid sender: {type(exc).__name__}"] += 1
                    continue
                self.count("OK" if result.error is None else result.error.code)
        raw.close()

    def cancelled(self, how_many: int = 2) -> None:
        """Requests whose cancel key is set before they are queued: answered CANCELLED."""
        with Client(MODEL, self.url) as client:
            for i in range(how_many):
                rid = f"snapshot-cancel-{i}"
                client.cancel(rid)
                client.submit({"features": np.zeros((1, 16), np.float32)}, rid=rid)
                result = client.wait(rid, 60)
                self.count("OK" if result.error is None else result.error.code)

    def dead_letter(self, n: int) -> None:
        """An entry whose rid cannot name a reply key: the worker dead-letters it."""
        raw = redis.Redis.from_url(self.url)
        body = encode_request({"features": np.zeros((1, 16), np.float32)})
        raw.xadd(request_stream(PREFIX, MODEL), {"rid": f"not a valid rid #{n}", "body": body})
        raw.close()

    def prepare_burst(self) -> None:
        """Encode the burst before it is due, so sending it is only pipelined XADDs."""
        rng = np.random.default_rng(2)
        x = rng.uniform(-1, 1, (self.burst_n, 1, 16)).astype(np.float32)
        self._burst = [
            (f"snapshot-burst-{i}", encode_request({"features": row})) for i, row in enumerate(x)
        ]

    def burst(self) -> None:
        """Queue ``burst_n`` requests as fast as Redis takes them: a backlog builds, then drains.

        The demo model is so small that the workers answer a few thousand requests a second on
        two CPU cores, faster than a Python producer encodes them; so the burst is encoded
        beforehand and sent in pipelines of 2,000 (the same fields Client.submit sends).
        """
        raw = redis.Redis.from_url(self.url)
        stream = request_stream(PREFIX, MODEL)
        began = time.monotonic()
        for i in range(0, len(self._burst), 2000):
            pipe = raw.pipeline(transaction=False)
            for rid, body in self._burst[i : i + 2000]:
                pipe.xadd(stream, {"rid": rid, "body": body})
            pipe.execute()
        raw.close()
        rids = [rid for rid, _ in self._burst]
        progress(f"burst: {len(rids)} requests queued in {time.monotonic() - began:.1f}s")
        with Client(MODEL, self.url) as client:
            for i in range(0, len(rids), 500):
                for result in client.wait_many(rids[i : i + 500], 300):
                    self.count("OK" if result.error is None else result.error.code)
        progress(f"burst: all {len(rids)} answered, {time.monotonic() - began:.1f}s after start")
