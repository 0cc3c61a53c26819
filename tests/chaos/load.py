"""The load driver: XADD requests in pipelined, paced chunks, re-sending a chunk Redis did not
confirm, and recording which rids were confirmed (and by which node) and which re-sent.

On a Redis Cluster each rid goes to its shard's stream (``shard_of``), on the master that owns
the shard's slot (``producer.redisio.topology``), and the driver follows the cluster as a cluster
client does: ``MOVED`` repoints the slot, ``ASK`` sends the refused XADDs once more to the importing
node after ``ASKING``, ``TRYAGAIN`` and ``CLUSTERDOWN`` wait and retry, and a lost connection
(a master that died) reads the slot map again. Redirected XADDs were not applied, so they are
not counted as re-sent; ``redirects`` counts them by kind.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import AskError, ExecAbortError, MovedError
from redis.retry import Retry

from producer.redisio.topology import Topology, is_redirect

from .common import MODEL, ScenarioTimeout
from .workload import Requests


def producer_client(url: str) -> redis.Redis:
    """A producer connection without redis-py's own retries: the load driver retries itself,
    so it knows which XADDs Redis confirmed and which it re-sent."""
    return redis.Redis.from_url(url, socket_timeout=10, retry=Retry(NoBackoff(), 0))


def _port(client: redis.Redis) -> int:
    return int(client.connection_pool.connection_kwargs.get("port", 0))


def _first_error(replies: Sequence[object]) -> redis.ResponseError | None:
    """The error that refused one request's commands: a queued command's (a redirect) before
    the ``EXECABORT`` it causes; None when they went through."""
    errors = [r for r in replies if isinstance(r, redis.ResponseError)]
    if not errors:
        return None
    return next((e for e in errors if not isinstance(e, ExecAbortError)), errors[0])


class Producer:
    """One sender's connections: the seed's alone on a single Redis, one per master on a
    cluster. ``xadd`` returns the port of the node that answered and the XADDs it refused with
    a cluster redirect (by rid); ``redirected`` acts on those before the next try."""

    def __init__(self, url: str, cluster: bool, tags: Sequence[str] = ()) -> None:
        self.seed = producer_client(url)
        self.topology = Topology(self.seed) if cluster else None
        if self.topology is not None:
            self.topology.refresh()
            for tag in tags:  # a client knows every shard of its model, so every master of
                self.topology.client(tag)  # them: one of those answers when the seed is gone
        self._ask: tuple[str, int] | None = None  # the next try goes there, after ASKING
        self._nodes: dict[tuple[str, int], redis.Redis] = {}

    def _client(self, tag: str) -> tuple[redis.Redis, bool]:
        asking, self._ask = self._ask, None
        if asking is not None:
            if asking not in self._nodes:
                host, port = asking
                self._nodes[asking] = producer_client(f"redis://{host}:{port}/0")
            return self._nodes[asking], True
        return (self.seed if self.topology is None else self.topology.client(tag)), False

    def xadd(
        self, items: Sequence[tuple[str, bytes, str, str | None]], tag: str
    ) -> tuple[int, dict[str, redis.ResponseError]]:
        """XADD each ``(rid, body, stream, lane_set)`` of shard ``tag`` in one pipeline: a
        request of the default lane (``lane_set`` None) as version 2 does, any other as version
        3 does, ``MULTI; SADD lane_set stream; XADD stream ...; EXEC``."""
        client, asking = self._client(tag)
        pipe = client.pipeline(transaction=False)
        sizes = []
        for rid, body, stream, lane_set in items:
            if asking:  # in a MULTI the flag holds until EXEC
                pipe.execute_command("ASKING")
            if lane_set is None:
                pipe.xadd(stream, {"rid": rid, "body": body})
            else:
                pipe.execute_command("MULTI")
                pipe.sadd(lane_set, stream)
                pipe.xadd(stream, {"rid": rid, "body": body})
                pipe.execute_command("EXEC")
            sizes.append(asking + (1 if lane_set is None else 4))
        replies = pipe.execute(raise_on_error=False)
        refused: dict[str, redis.ResponseError] = {}
        at = 0
        for (rid, *_), size in zip(items, sizes, strict=True):
            error = _first_error(replies[at : at + size])
            at += size
            if error is not None:
                if not is_redirect(error):
                    raise error
                refused[rid] = error
        return _port(client), refused

    def redirected(self, errors: Iterable[redis.ResponseError]) -> None:
        """Follow the first MOVED or ASK; wait a moment on TRYAGAIN or CLUSTERDOWN."""
        for exc in errors:
            if isinstance(exc, MovedError) and self.topology is not None:
                self.topology.follow(exc)
                return
            if isinstance(exc, AskError):
                self._ask = (exc.host, int(exc.port))
                return
        time.sleep(0.05)  # a slot half moved or a failover under way: nothing to wait on

    def lost_connection(self) -> None:
        """The node went away: on a cluster, read the slot map again (a failover moves it)."""
        if self.topology is None:
            return
        with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
            self.topology.refresh()  # when every known node is away, the next try asks again

    def close(self) -> None:
        for client in self._nodes.values():
            client.close()
        if self.topology is not None:
            self.topology.close()
        self.seed.close()


class LoadDriver:
    """The load half of ``Run``: sends its requests to its Redis (or cluster)."""

    url: str
    cluster: bool
    tags: list[str]  # the model's shard tags
    requests: Requests
    confirmed: set[str]
    resent: Counter[str]
    acked_by: dict[str, int]  # rid -> port of the node that confirmed its XADD (the last time)
    redirects: Counter[str]  # cluster redirects met, by kind (MovedError, AskError, ...)
    # (rid's lane stream, its lane set key or None for the default lane): ``LaneBook``'s
    stream_of: Callable[[str], tuple[str, str | None]]

    def shard_of(self, rid: str) -> str:
        """The shard tag ``rid`` is sent to (``Run`` spreads rids over shards)."""
        return MODEL

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
        producer = Producer(self.url, self.cluster, self.tags)
        start = time.monotonic()
        try:
            for i in range(0, len(rids), chunk):
                part = rids[i : i + chunk]
                if rate_per_s:
                    due = start + i / rate_per_s
                    time.sleep(max(0.0, due - time.monotonic()))  # pacing, not synchronisation
                by_shard: dict[str, list[str]] = {}
                for rid in part:
                    by_shard.setdefault(self.shard_of(rid), []).append(rid)
                for tag, group in by_shard.items():
                    self._send_chunk(producer, tag, group, retry_for_s)
        finally:
            producer.close()

    def _send_chunk(
        self, producer: Producer, tag: str, rids: Sequence[str], retry_for_s: float
    ) -> None:
        deadline = time.monotonic() + retry_for_s
        attempt = 0
        todo = list(rids)
        while True:
            try:
                items = [(r, self.requests.bodies[r], *self.stream_of(r)) for r in todo]
                port, refused = producer.xadd(items, tag)
            except (redis.ConnectionError, redis.TimeoutError):
                attempt += 1
                if time.monotonic() > deadline:
                    raise
                self.resent.update(todo)
                time.sleep(min(0.5, 0.02 * 2**attempt))  # backoff while Redis is away
                producer.lost_connection()
                continue
            for rid in todo:
                if rid not in refused:
                    self.confirmed.add(rid)
                    self.acked_by[rid] = port
            if not refused:
                return
            self.redirects.update(type(exc).__name__ for exc in refused.values())
            if time.monotonic() > deadline:
                raise next(iter(refused.values()))
            todo = [rid for rid in todo if rid in refused]
            producer.redirected(refused.values())

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
