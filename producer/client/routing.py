"""Where a client's commands and requests go.

- ``ShardSpread``: which of the model's shards (contract section 1) takes each new request, and
  when to read the shard list again.
- ``Routing``: which node's redis-py client runs a step (``producer.redisio.topology``), and
  when the shell reads the cluster's slot map again.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from typing import Any

import redis.exceptions as rex

from producer.client.submission import Submission
from producer.redisio import shards
from producer.redisio.shards import Shards
from producer.redisio.topology import is_redirect

__all__ = ["REFRESH_MIN_S", "Routing", "ShardSpread"]

log = logging.getLogger(__name__)

#: The least time between two reads of the slot map after errors: a failover takes seconds, and
#: a read per retry would only load the nodes left.
REFRESH_MIN_S = 1.0


class Routing:
    """Which redis-py client runs a step, and when the shell reads the slot map again.

    The map is read before the first command (one round trip for the client's life on a single
    Redis; tried again with the command while no node answers), then only after trouble: a
    ``MOVED`` repoints its slot at once (``follow``); an ``ASK``, ``TRYAGAIN``,
    ``CLUSTERDOWN``, a ``MOVED`` seen by a client whose map says single Redis, or a lost
    connection on a cluster (a dead master: its replica is promoted) asks for a fresh map
    before the retry, at most every ``REFRESH_MIN_S``.
    """

    __slots__ = ("_clients", "_due", "_mapped", "_refreshed_at", "model", "topology")

    def __init__(self, topology: Any, model: str) -> None:
        self.topology = topology
        self.model = model
        self._clients: dict[str, Any] = {}  # the topology's, without its lock
        self._mapped = False
        self._due = True
        self._refreshed_at = -math.inf

    def refresh_due(self) -> bool:
        """True when the shell should read the slot map before its next command."""
        if not self._due:
            return False
        return not self._mapped or time.monotonic() - self._refreshed_at >= REFRESH_MIN_S

    def refreshed(self) -> None:
        """Note a read of the slot map."""
        self._mapped, self._due = True, False
        self._refreshed_at = time.monotonic()

    def client(self, tag: str | None) -> Any:
        """The client of shard ``tag`` (None: the model's first): the same object for the
        tag's life, repointed by the topology when its slot moves."""
        tag = tag or self.model
        found = self._clients.get(tag)
        if found is None:
            found = self._clients[tag] = self.topology.client(tag)
        return found

    def failed(self, exc: BaseException) -> None:
        """Note a try's error: follow a ``MOVED``, or ask for a fresh map."""
        if isinstance(exc, rex.MovedError):
            self.topology.follow(exc)
            self._due = self._due or not self.topology.cluster
        elif is_redirect(exc):
            self._due = True
        elif isinstance(exc, rex.ConnectionError | rex.TimeoutError):
            self._due = self._due or self.topology.cluster


class ShardSpread:
    """The shards a client sends to, and which one takes each new request.

    The list (``P:{M}:shards``) is read at the first submit and again when it is older than
    ``producer.redisio.shards.REFRESH_S`` (read at each use, so tests can shorten it). The rule: the
    k-th request this client sends goes to ``send[(start + k) % len(send)]``, with ``start``
    random per client. So ``submit`` round-robins, ``submit_many`` and each refill of ``map``
    split evenly (shard sizes differ by one at most), and many clients that each submit one
    request at a time do not all start on the same shard.
    """

    __slots__ = ("_next", "_read_at", "shards")

    def __init__(self, model: str) -> None:
        self.shards = Shards.single(model)
        self._read_at: float | None = None  # monotonic; None: never read
        self._next = random.randrange(1 << 16)

    def stale(self, now: float) -> bool:
        """True when the list should be read before the next send."""
        return self._read_at is None or now - self._read_at >= shards.REFRESH_S

    def seen(self, found: Shards, now: float) -> None:
        """Take a fresh reading of the list."""
        if found.send != self.shards.send:
            log.info("model %s: sending to shards %s", found.model, ", ".join(found.send))
        self.shards, self._read_at = found, now

    def assign(self, subs: Sequence[Submission]) -> dict[str, list[Submission]]:
        """Give each submission without a shard the next one (one sent again keeps its own);
        returns them by shard, each in the order given."""
        send = self.shards.send
        n, at = len(send), self._next
        by_tag: dict[str, list[Submission]] = {}
        for sub in subs:
            if not sub.tag:
                sub.tag = send[at % n]
                at += 1
            group = by_tag.get(sub.tag)
            if group is None:
                by_tag[sub.tag] = [sub]
            else:
                group.append(sub)
        self._next = at % n
        return by_tag
