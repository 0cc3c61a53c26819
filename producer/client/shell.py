"""What ``Client`` and ``AsyncClient`` share outside their I/O: the constructor, which sets up
the ``Session`` the plans work on, and the methods that do no I/O when called.

Each shell names its redis-py flavour (``Flavour``: blocking or asyncio). ``map`` and
``wait_many`` check their arguments, then hand back an iterator the shell drives, so they are
written once as well. ``BaseClient`` is generic in the redis-py client it takes and the
iterators it returns, so that type checkers see each shell's own types.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from numpy.typing import ArrayLike

from producer.client.lanes import choose
from producer.client.mapwindow import MapPlan
from producer.client.routing import Routing
from producer.client.session import Session
from producer.client.settings import Settings
from producer.client.waiting import ReplyWaiter
from producer.protocol.keys import DEFAULT_PREFIX
from producer.redisio import resp
from producer.redisio.connection import (
    block_cap_s,
    check_connection_kwargs,
    describe_connection,
    redact_url,
)
from producer.redisio.memory import DEFAULT_HIGH_WATERMARK, MemoryWatch, check_watermark
from producer.redisio.retry import DEFAULT_RETRY_S, RetryPolicy
from producer.redisio.topology import seed_client

__all__ = ["DEFAULT_URL", "URL_ENV", "BaseClient", "Flavour", "default_url"]

DEFAULT_URL = "redis://127.0.0.1:6379/0"
URL_ENV = "REDIS_URL"


def default_url() -> str:
    """The URL a client given none uses: ``$REDIS_URL``, as the CLI and the worker read it (so
    a script and the worker it talks to agree without repeating the URL), else DEFAULT_URL."""
    return os.environ.get(URL_ENV) or DEFAULT_URL


RedisT = TypeVar("RedisT")
ChunksT = TypeVar("ChunksT")
ResultsT = TypeVar("ResultsT")


@dataclass(frozen=True, slots=True)
class Flavour:
    """A shell's redis-py flavour: its client class, its TLS connection class (to say
    ``rediss://`` for a client passed in), its ``INFO memory`` reader, and its topology
    (``producer.redisio.topology``: which node serves each shard)."""

    redis_class: Any
    tls_class: type
    info_memory: Callable[[Any], Any]
    topology_class: Any


class BaseClient(ABC, Generic[RedisT, ChunksT, ResultsT]):
    """The constructor and the no-I/O methods of both clients; see ``Client`` for the settings.

    ``url`` goes to the flavour's ``Redis.from_url`` (none: ``$REDIS_URL``, else
    ``DEFAULT_URL``), or pass ``redis_client`` (then ``close()``
    leaves it open): a client of the flavour, or its ``RedisCluster``. Either way it is only a
    seed: the client finds each shard's node itself (``producer.redisio.topology``), at first use.
    """

    _flavour: ClassVar[Flavour]

    def __init__(
        self,
        model: str,
        url: str | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
        max_backlog: int | None = None,
        wait_for_backlog: bool = False,
        redis_client: RedisT | Any | None = None,  # Any: the flavour's RedisCluster too
        retry_s: float = DEFAULT_RETRY_S,
        memory_high_watermark: float | None = DEFAULT_HIGH_WATERMARK,
    ) -> None:
        settings = Settings.create(model, prefix, max_backlog, wait_for_backlog)
        check_watermark(memory_high_watermark)
        flavour = self._flavour
        redis: Any = redis_client
        if redis is None:
            url = default_url() if url is None else url
            redis = flavour.redis_class.from_url(url, decode_responses=False)
            where = redact_url(url)
        else:
            pool = seed_client(redis).connection_pool
            tls = issubclass(pool.connection_class, flavour.tls_class)
            where = describe_connection(pool.connection_kwargs, tls)
        self._redis: RedisT = redis
        self._owns_redis = redis_client is None
        seed = seed_client(redis)
        connection_kwargs = seed.connection_pool.connection_kwargs
        check_connection_kwargs(connection_kwargs)
        self._session = Session(
            settings,
            where,
            block_cap_s(connection_kwargs.get("socket_timeout")),
            RetryPolicy(where, retry_s),
            resp.supports(seed),
            MemoryWatch(where, memory_high_watermark),
            flavour.info_memory,
        )
        self._topology = flavour.topology_class(seed)
        self._routing = Routing(self._topology, model)
        self._opened()

    def _opened(self) -> None:
        """Set up what the shell keeps beside the session; nothing unless it says so."""

    @property
    def model(self) -> str:
        """The model this client sends to."""
        return self._session.settings.model

    def wait_many(self, handles: Sequence[str], timeout_s: float) -> ResultsT:
        """Yield replies as they arrive (consuming them); WaitTimeout for any left at the end.
        Takes what ``submit`` returned (or bare rids: the model's first shard); each Result's
        ``handle`` says which it answers. A reply key holding another type than a list (set by
        something other than a worker) is a failed Result (INTERNAL) naming the key; the
        replies popped beside it are yielded as usual."""
        settings = self._session.settings
        waiter = ReplyWaiter(settings, timeout_s)
        now = time.monotonic()
        for handle in handles:
            tag, rid = settings.target(handle)
            waiter.add(rid, now, tag)
        return self._drain(waiter)

    def map(
        self,
        arrays: Mapping[str, ArrayLike | Iterable[Any]],
        *,
        rows_per_request: int | None = None,
        concurrency: int = 64,
        outputs: Sequence[str] | None = None,
        timeout_s: float = 60.0,
        stop_on_timeout: bool = False,
        priority: str = "normal",
        tenant: str | None = None,
    ) -> ChunksT:
        """Run arrays through the model in requests of at most ``rows_per_request`` rows.

        Each input is an array (a list of str or bytes is a string or bytes tensor), or an
        iterator of rows (a generator, an open file), read only as requests are sent, so an
        input larger than memory streams; ``producer.client.maprows.Blocks`` takes arrays of many
        rows each. Inputs must end together (ValueError when one runs out first). ``AsyncClient``
        reads iterators on its event loop.

        Yields one Chunk per request, in input order (``AsyncClient``: an async iterator); a
        failed request is a Chunk with ``error`` set. ``rows_per_request`` defaults to the
        smallest ``max_batch_size`` of the live workers (NoWorkerInfo when none is registered:
        ``Client`` raises it at the call, ``AsyncClient`` on first use; bad arguments raise at
        the call in both). ``timeout_s`` bounds the wait for each request's reply, counted from
        when it was sent: a late request is yielded as a failed Chunk (code WAIT_TIMEOUT) and
        cancelled, and the others carry on; with ``stop_on_timeout`` the first late reply stops
        the sending instead, and the iteration ends once the requests already in flight are
        yielded (its last chunk then stops short of the input's end). Stopping the iteration
        early cancels the requests still in flight. Each refill of the window is one pipelined
        submit, split evenly over the model's shards, with the same backlog check as
        ``submit_many``. When Redis is full (``RedisFull``), the sending stops: the requests in
        flight are still awaited and yielded, and then the refusal is raised; the rows after
        the last chunk yielded were not all sent (with several shards, one with room may have
        taken some, which are answered but not yielded; with ``wait_for_backlog``, map waits
        for room instead).

        ``priority`` and ``tenant`` choose every request's lane, as ``submit``'s do; a large
        batch job is best sent as ``priority="low"``, so that interactive callers of the same
        model never wait behind it (``redbatch run`` does so by default).
        """
        lane = choose(priority, tenant)
        plan = MapPlan(
            self._session.settings,
            arrays,
            rows_per_request=rows_per_request,
            concurrency=concurrency,
            outputs=outputs,
            timeout_s=timeout_s,
            stop_on_timeout=stop_on_timeout,
            lane=lane,
        )
        return self._map(plan)

    @abstractmethod
    def _drain(self, waiter: ReplyWaiter) -> ResultsT:
        """The replies ``waiter`` awaits, as they arrive."""

    @abstractmethod
    def _map(self, plan: MapPlan) -> ChunksT:
        """``plan``'s chunks, in input order."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.model!r}, url={self._session.where!r})"
