"""Which models have live workers: read when ``redbatch run`` is pointed at a model that has none.

A run to a misspelled model would send its requests into a stream no worker reads and wait a
timeout for nothing, so ``run`` refuses it and says which models do have workers. They are found
with ``SCAN MATCH P:{*}:worker:*`` over the worker records (each one expires unless its worker's
heartbeat renews it, so a record is a live worker), on every master of a cluster. The scan is
bounded (``SCAN_BUDGET_S``, ``SCAN_MAX_KEYS``): this is an error path, and a Redis of millions
of keys should not hold it up; a scan cut short says so.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import redis

from producer.redisio.topology import Topology

__all__ = ["LiveModels", "live_models"]

#: How long, and over how many keys, the scan may run in all.
SCAN_BUDGET_S = 2.0
SCAN_MAX_KEYS = 1_000_000
_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class LiveModels:
    """The models with a live worker record, and whether the scan saw every key."""

    names: list[str]
    complete: bool

    def describe(self) -> str:
        """``'a', 'b'`` or ``none``, with a word when the scan was cut short."""
        listed = ", ".join(map(repr, self.names)) or "none"
        if self.complete:
            return listed
        return f"{listed} (the scan stopped early, so there may be others)"


def live_models(url: str, prefix: str) -> LiveModels:
    """The models with a live worker under ``prefix`` on the Redis at ``url``."""
    seed = redis.Redis.from_url(url, socket_connect_timeout=_TIMEOUT_S, socket_timeout=_TIMEOUT_S)
    names: set[str] = set()
    complete = True
    try:
        pattern = _glob_escape(prefix) + ":{*}:worker:*"
        shape = re.compile(re.escape(prefix.encode()) + rb":\{([^}]+)\}:worker:")
        deadline = time.monotonic() + SCAN_BUDGET_S
        for node in _masters(seed):
            complete = _scan(node, pattern, shape, names, deadline)
            if not complete:
                break
    except redis.RedisError:
        complete = False
    finally:
        seed.close()
    return LiveModels(sorted(names), complete)


def _masters(seed: redis.Redis) -> Iterator[redis.Redis]:
    """The client of each master: the seed alone on a single Redis."""
    topology = Topology(seed)
    try:
        if not topology.refresh():
            yield seed
            return
        pool = seed.connection_pool
        for node in topology.slots.masters():
            kwargs = {**pool.connection_kwargs, "host": node.host, "port": node.port}
            client = redis.Redis(
                connection_pool=redis.ConnectionPool(
                    connection_class=pool.connection_class, **kwargs
                )
            )
            try:
                yield client
            finally:
                client.connection_pool.disconnect()
    finally:
        topology.close()


def _scan(
    client: redis.Redis, pattern: str, shape: re.Pattern[bytes], names: set[str], deadline: float
) -> bool:
    """Add the models of one node's worker records to ``names``; False when the deadline or
    ``SCAN_MAX_KEYS`` stopped the scan before its end."""
    cursor, examined = 0, 0
    while True:
        cursor, found = client.scan(cursor=cursor, match=pattern, count=1000)
        examined += 1000
        for key in found:
            matched = shape.match(key if isinstance(key, bytes) else key.encode())
            if matched:
                names.add(matched.group(1).decode("utf-8", "replace"))
        if not cursor:
            return True
        if time.monotonic() > deadline or examined >= SCAN_MAX_KEYS:
            return False


def _glob_escape(text: str) -> str:
    """``text`` matched literally in a Redis glob."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
