"""The shard map: each served shard's stream and leases, by tag, shared down the worker's path.

Entry ids are unique only within one shard's stream, so every step after the read that names an
entry goes to its own shard (``RawEntry.shard``, ``Finish.shard``): the answerer's cancel
recheck, the writer's finish step and the release of its leases. The lanes add a shard's parts
when they start serving it and drop them once it is retired and answered; the later stages only
look them up, so none of them calls back into the lanes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from worker.errors import WorkerError
from worker.intake.leases import Leases
from worker.redisio.stream import RequestStream

__all__ = ["Shard", "ShardMap"]


@dataclass(frozen=True, slots=True)
class Shard:
    """One served shard: its stream and the leases on the entries read from it."""

    stream: RequestStream
    leases: Leases


class ShardMap:
    """The served streams by the name their entries carry (``RawEntry.shard``): a shard's tag
    for its default lane, the stream key for any other lane (``worker.intake.lanes``); ``""``
    names the model's first shard (``model``)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._lock = threading.Lock()  # writers only: a lookup is one dict read
        self._shards: dict[str, Shard] = {}

    def add(self, tag: str, stream: RequestStream, leases: Leases) -> None:
        with self._lock:
            self._shards = {**self._shards, tag: Shard(stream, leases)}

    def drop(self, tag: str) -> None:
        with self._lock:
            self._shards = {t: s for t, s in self._shards.items() if t != tag}

    def get(self, tag: str) -> Shard | None:
        """Shard ``tag``'s parts; None once it was dropped."""
        return self._shards.get(tag or self.model)

    def stream(self, tag: str) -> RequestStream:
        """The stream of shard ``tag``. A shard is dropped only once what was read from it is
        answered, so a batch never names one that is gone."""
        shard = self.get(tag)
        if shard is None:
            raise WorkerError(f"no lane serves shard {tag!r}")
        return shard.stream
