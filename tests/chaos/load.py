"""The load driver: XADD requests in pipelined, paced chunks, re-sending a chunk Redis did not
confirm, and recording which rids were confirmed and which re-sent."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tools.localredis import LocalRedis

from .common import STREAM, ScenarioTimeout
from .workload import Requests


def producer_client(url: str) -> redis.Redis:
    """A producer connection without redis-py's own retries: the load driver retries itself,
    so it knows which XADDs Redis confirmed and which it re-sent."""
    return redis.Redis.from_url(url, socket_timeout=10, retry=Retry(NoBackoff(), 0))


class LoadDriver:
    """The load half of ``Run``: sends its requests to its Redis."""

    redis: LocalRedis
    requests: Requests
    confirmed: set[str]
    resent: Counter[str]

    def send(
        self,
        rids: Sequence[str],
        *,
        rate_per_s: float | None = None,
        chunk: int = 16,
        retry_for_s: float = 60.0,
    ) -> None:
        """XADD ``rids`` in pipelined chunks, paced at ``rate_per_s`` if given. A chunk that fails
        (Redis down, connection killed) is re-sent whole with the same rids until it goes through:
        an XADD whose answer was lost may have been applied, so its rid may appear twice."""
        client = producer_client(self.redis.url)
        start = time.monotonic()
        try:
            for i in range(0, len(rids), chunk):
                part = rids[i : i + chunk]
                if rate_per_s:
                    due = start + i / rate_per_s
                    time.sleep(max(0.0, due - time.monotonic()))  # pacing, not synchronisation
                self._send_chunk(client, part, retry_for_s)
        finally:
            client.close()

    def _send_chunk(self, client: redis.Redis, rids: Sequence[str], retry_for_s: float) -> None:
        deadline = time.monotonic() + retry_for_s
        attempt = 0
        while True:
            pipe = client.pipeline(transaction=False)
            for rid in rids:
                pipe.xadd(STREAM, {"rid": rid, "body": self.requests.bodies[rid]})
            try:
                pipe.execute()
            except (redis.ConnectionError, redis.TimeoutError):
                attempt += 1
                if time.monotonic() > deadline:
                    raise
                self.resent.update(rids)
                time.sleep(min(0.5, 0.02 * 2**attempt))  # backoff while Redis is away
                continue
            self.confirmed.update(rids)
            return

    def send_in_background(self, rids: Sequence[str], **kw: Any) -> threading.Thread:
        failure: list[BaseException] = []

        def target() -> None:
            try:
                self.send(rids, **kw)
            except BaseException as exc:  # reported by join_sender, on the scenario's thread
                failure.append(exc)

        thread = threading.Thread(target=target, name="load", daemon=True)
        thread.failure = failure  # type: ignore[attr-defined]
        thread.start()
        return thread

    def join_sender(self, thread: threading.Thread, timeout_s: float = 120.0) -> None:
        thread.join(timeout_s)
        if thread.is_alive():
            raise ScenarioTimeout("the load driver did not finish")
        failure: list[BaseException] = thread.failure  # type: ignore[attr-defined]
        if failure:
            raise RuntimeError(f"the load driver failed: {failure[0]!r}") from failure[0]
