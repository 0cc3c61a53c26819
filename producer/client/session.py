"""``Session``: what every call of one client shares, the state the plans work on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from producer.client.limits import BodyLimit
from producer.client.routing import ShardSpread
from producer.client.settings import Settings
from producer.protocol.errors import RedisFull
from producer.redisio.memory import MemoryWatch
from producer.redisio.retry import RetryPolicy

__all__ = ["Session"]


@dataclass(eq=False, slots=True)
class Session:
    """A client's checked settings and the policies its plans apply, shared by all its calls.

    ``backlog_seen`` and ``full_seen`` say what holds up the send under way (the backlog, Redis
    memory): the asyncio shell names it to a call whose time ran out behind that send.
    ``spread`` holds the model's shards, ``limits`` the largest body a submit may send.
    """

    settings: Settings
    where: str  # the Redis, as errors and logs name it: no password
    block_cap_s: float
    retry: RetryPolicy
    packed: bool  # submits and reply sweeps are packed by hand (``producer.redisio.resp``)
    memory: MemoryWatch
    info_memory: Callable[[Any], Any]
    backlog_seen: int | None = None
    full_seen: RedisFull | None = None
    spread: ShardSpread = field(init=False)
    limits: BodyLimit = field(init=False)

    def __post_init__(self) -> None:
        self.spread = ShardSpread(self.settings.model)
        self.limits = BodyLimit(self.where)
