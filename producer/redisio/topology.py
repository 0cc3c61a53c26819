"""Which Redis serves a shard: one code path for a single Redis and for Redis Cluster.

Every key of one shard carries the shard's hash tag, so one shard lives in one slot and one node
(contract section 1). A ``Topology`` hands out one plain redis-py client per shard tag, bound to
the pool of the node that owns the tag's slot: a single Redis gives every tag the same pool; on a
cluster each tag gets its master's. Code that talks to a shard (scripts, transactions, the packed
round trips of ``producer.redisio.resp``) never needs to know which it has.

Which it has is found out at start with ``CLUSTER SLOTS``: a Redis without cluster support
refuses it, and so does a user whose ACL lacks it (then it is taken for a single Redis; a
cluster still works through redirects, but docs/operations.md lists the command). A ``MOVED``
reply names the slot's new master: ``follow`` repoints every tag of that slot at once, so the
next command goes there. ``ASK``, ``TRYAGAIN`` and ``CLUSTERDOWN`` (a slot migrating, a failover
under way) are transient: the caller retries, and a refresh of the whole map follows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import redis
import redis.asyncio
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterDownError, MovedError, TryAgainError

__all__ = [
    "REDIRECTS",
    "REFRESH_GAP_S",
    "AsyncTopology",
    "Node",
    "SlotMap",
    "Topology",
    "is_redirect",
    "seed_client",
    "tag_slot",
]

log = logging.getLogger(__name__)

#: Replies of a cluster in motion: a slot moved or moving, a failover under way.
REDIRECTS = (MovedError, AskError, TryAgainError, ClusterDownError)
# A node that does not answer: on a cluster, its replica may be taking over.
_GONE = (redis.ConnectionError, redis.TimeoutError)
#: At most one slot-map refresh per this many seconds, however many callers fail at once.
REFRESH_GAP_S = 0.5

ClientT = TypeVar("ClientT")
PoolT = TypeVar("PoolT")


def is_redirect(exc: BaseException) -> bool:
    """True for a reply a cluster gives while slots move or a master fails over."""
    return isinstance(exc, REDIRECTS)


def tag_slot(tag: str) -> int:
    """The cluster slot of every key carrying hash tag ``{tag}``."""
    return key_slot(tag.encode())


@dataclass(frozen=True, slots=True)
class Node:
    """One master, as the cluster announces it."""

    host: str
    port: int
    node_id: str = ""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(slots=True)
class SlotMap:
    """Slot ranges to masters; empty for a single Redis (sans I/O, for both shells)."""

    ranges: list[tuple[int, int, Node]] = field(default_factory=list)
    moved: dict[int, Node] = field(default_factory=dict)  # slots a MOVED repointed since
    replicas: list[Node] = field(default_factory=list)  # asked for the map when masters are gone

    @classmethod
    def parse(cls, reply: Any, seed_host: str) -> SlotMap:
        """From ``CLUSTER SLOTS``; a master announced with an empty host is the seed's host."""
        ranges, replicas = [], []
        for row in reply or []:
            start, end, master = int(row[0]), int(row[1]), row[2]
            ranges.append((start, end, _node(master, seed_host)))
            replicas += [_node(replica, seed_host) for replica in row[3:]]
        return cls(sorted(ranges, key=lambda r: r[0]), replicas=replicas)

    @property
    def cluster(self) -> bool:
        return bool(self.ranges)

    def node(self, slot: int) -> Node | None:
        """The master of ``slot``; None on a single Redis or for an unassigned slot."""
        if slot in self.moved:
            return self.moved[slot]
        for start, end, node in self.ranges:
            if start <= slot <= end:
                return node
        return None

    def masters(self) -> list[Node]:
        """Every master that owns a slot, once each, in slot order."""
        seen: dict[tuple[str, int], Node] = {}
        for _, _, node in self.ranges:
            seen.setdefault((node.host, node.port), node)
        return list(seen.values())


def _node(entry: Any, seed_host: str) -> Node:
    """A node of a ``CLUSTER SLOTS`` row: host (empty: the seed's), port, id."""
    node_id = _text(entry[2]) if len(entry) > 2 else ""
    return Node(_text(entry[0]) or seed_host, int(entry[1]), node_id)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def _is_not_cluster(exc: Exception) -> bool:
    """``CLUSTER SLOTS`` refused: no cluster support, or an ACL without the command."""
    text = str(exc).lower()
    return (
        "cluster support disabled" in text
        or "unknown command" in text
        or isinstance(exc, redis.exceptions.NoPermissionError)
    )


def seed_client(client: Any) -> Any:
    """A plain client from what a caller passed: itself, or a ``RedisCluster``'s first node's
    (the project routes by itself; redis-py's cluster client has no connection pool)."""
    if hasattr(client, "connection_pool"):
        return client
    nodes = getattr(client, "get_nodes", None)
    if nodes is not None:
        for node in nodes():
            if getattr(node, "redis_connection", None) is not None:
                return node.redis_connection
    raise TypeError(f"{type(client).__name__} is neither a redis-py client nor a cluster client")


class _Routing(Generic[ClientT, PoolT]):
    """What both topologies share: the slot map, a pool per node, a client per tag."""

    _pool_class: type
    _client_class: type

    def __init__(self, seed: Any) -> None:
        self.seed = seed_client(seed)
        pool = self.seed.connection_pool
        self._kwargs = dict(pool.connection_kwargs)
        self._connection_class = pool.connection_class
        self._seed_pool: Any = pool
        self.slots = SlotMap()
        self._pools: dict[tuple[str, int], Any] = {}
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._stale = False
        self._refreshed_at = 0.0

    @property
    def cluster(self) -> bool:
        """True once the seed turned out to be a cluster node."""
        return self.slots.cluster

    def client(self, tag: str) -> ClientT:
        """The client of shard ``tag``: the same object for the tag's life, repointed (its
        pool swapped) when the slot moves, so scripts registered on it follow too."""
        with self._lock:
            found = self._clients.get(tag)
            if found is None:
                found = self._client_class(connection_pool=self._pool_for(tag_slot(tag)))
                self._clients[tag] = found
            return found

    def node_of(self, tag: str) -> Node | None:
        """The master serving ``tag`` (None on a single Redis)."""
        return self.slots.node(tag_slot(tag))

    def follow(self, exc: BaseException) -> bool:
        """Repoint the slot a ``MOVED`` names; True when ``exc`` was a cluster redirect at all
        (the caller retries it as transient). On a cluster, any other failure (a master gone,
        a failover under way) marks the slot map stale: ``stale`` says to refresh it."""
        if isinstance(exc, MovedError):
            node = Node(exc.host or self._kwargs.get("host", ""), int(exc.port))
            with self._lock:
                self.slots.moved[int(exc.slot_id)] = node
                self._repoint()
            return True
        if self.cluster and isinstance(exc, (*REDIRECTS, *_GONE)):
            self._stale = True
        return is_redirect(exc)

    def refresh_due(self) -> bool:
        """True when a failure marked the map stale and no refresh ran in the last
        ``REFRESH_GAP_S``: every caller that failed may ask, one refresh answers them."""
        now = time.monotonic()
        with self._lock:
            if not self._stale or now - self._refreshed_at < REFRESH_GAP_S:
                return False
            self._stale, self._refreshed_at = False, now
            return True

    def _apply(self, reply: Any) -> None:
        """Take a fresh ``CLUSTER SLOTS`` answer (None: a single Redis)."""
        slots = SlotMap.parse(reply, self._kwargs.get("host", "")) if reply else SlotMap()
        with self._lock:
            before = self.slots.masters()
            self.slots = slots
            self._repoint()
        if before != slots.masters() and slots.cluster:
            log.info("cluster masters: %s", ", ".join(n.address for n in slots.masters()))

    def _repoint(self) -> None:
        for tag, client in self._clients.items():
            pool = self._pool_for(tag_slot(tag))
            if client.connection_pool is not pool:
                client.connection_pool = pool

    def _pool_for(self, slot: int) -> Any:
        node = self.slots.node(slot)
        if node is None:
            return self._seed_pool
        return self._node_pool(node)

    def _node_pool(self, node: Node) -> Any:
        key = (node.host, node.port)
        pool = self._pools.get(key)
        if pool is None:
            kwargs = {**self._kwargs, "host": node.host, "port": node.port}
            pool = self._pool_class(connection_class=self._connection_class, **kwargs)
            self._pools[key] = pool
        return pool

    def pools(self) -> Iterable[Any]:
        """Every pool made for a node (not the seed's, which its owner closes)."""
        return list(self._pools.values())

    def _known_pools(self) -> list[Any]:
        """A pool for every node the last map named, masters and replicas: a client that only
        ever talked to its seed still finds the replica that took over when the seed died."""
        with self._lock:
            nodes = [*self.slots.masters(), *self.slots.replicas]
            for node in nodes:
                self._node_pool(node)
            return list(self._pools.values())


class Topology(_Routing[redis.Redis, redis.ConnectionPool]):
    """The blocking topology (the worker, ``Client``, the CLI)."""

    _pool_class = redis.ConnectionPool
    _client_class = redis.Redis

    def follow(self, exc: BaseException) -> bool:
        """As ``_Routing.follow``, and refresh the slot map at once when it went stale (a
        failed master's replica is found here, not only at the next heartbeat)."""
        redirect = super().follow(exc)
        if self.refresh_due():
            try:
                self.refresh()
            except redis.RedisError as failed:  # every node down: the next failure asks again
                log.debug("slot map refresh failed: %s", failed)
                self._stale = True
        return redirect

    def refresh(self) -> bool:
        """Read the slot map again (from the seed, else any known master); True on a cluster.
        When no node answers, the map stays as it was and the last error is raised."""
        reply, gone = None, None
        for client in self._askable():
            try:
                reply = client.execute_command("CLUSTER SLOTS")
                break
            except redis.ResponseError as exc:
                if _is_not_cluster(exc):
                    break
                raise
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                gone = exc  # that node is down (a failover): ask the next
        else:
            if gone is not None:
                raise gone
        self._apply(reply)
        return self.cluster

    def _askable(self) -> Iterable[redis.Redis]:
        yield self.seed
        for pool in self._known_pools():
            yield redis.Redis(connection_pool=pool)

    def close(self) -> None:
        """Disconnect the node pools this topology made."""
        for pool in self.pools():
            pool.disconnect()


class AsyncTopology(_Routing[redis.asyncio.Redis, redis.asyncio.ConnectionPool]):
    """The asyncio topology (``AsyncClient``)."""

    _pool_class = redis.asyncio.ConnectionPool
    _client_class = redis.asyncio.Redis

    async def refresh(self) -> bool:
        """As ``Topology.refresh``."""
        reply, gone = None, None
        for client in self._askable():
            try:
                reply = await client.execute_command("CLUSTER SLOTS")
                break
            except redis.ResponseError as exc:
                if _is_not_cluster(exc):
                    break
                raise
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                gone = exc
        else:
            if gone is not None:
                raise gone
        self._apply(reply)
        return self.cluster

    def _askable(self) -> Iterable[redis.asyncio.Redis]:
        yield self.seed
        for pool in self._known_pools():
            yield redis.asyncio.Redis(connection_pool=pool)

    async def close(self) -> None:
        for pool in self.pools():
            await pool.disconnect()
