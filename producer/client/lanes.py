"""Which lane a request goes to, and the commands that send it there (contract section 7;
docs/protocol.md, "Lanes").

A request's class (``priority``: ``high``, ``normal``, ``low``) says what a worker takes first:
``high`` before ``normal`` before ``low``, with a minimum share for each lower class so that
none starves. A ``tenant`` (a name, ``[A-Za-z0-9_-]{1,64}``) gets a lane of its own in its
class, served by weight beside the other tenants of that class, and request ids that begin
with ``N.``, so that an ACL role confined to the tenant can send, wait for and cancel its own
requests and touch no one else's.

The default lane (class ``normal``, no tenant) is version 2's stream ``P:{T}:requests``: its
requests are sent exactly as before (``choose`` returns None, and the hot path never comes
here). Any other lane's requests go in ``MULTI; SADD P:{T}:lanes LANE; XADD LANE ...; EXEC``,
so that the lane is in the shard's lane set, where workers find it, whenever it has entries
(a worker may remove an empty lane from the set meanwhile: each transaction adds it again);
``producer.client.lanesend`` builds those commands.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from producer.protocol.lanes import (
    DEFAULT_CLASS,
    check_class,
    check_tenant,
    lane_stream,
)

__all__ = ["LaneChoice", "choose", "stream_of"]


@dataclass(frozen=True, slots=True)
class LaneChoice:
    """A lane other than the default, on whichever shard the request goes to: its class
    (``cls``) and tenant (None: none)."""

    cls: str
    tenant: str | None


def choose(priority: str, tenant: str | None) -> LaneChoice | None:
    """The lane of ``priority`` and ``tenant``, checked before anything is built or sent
    (ValueError naming the bad one); None for the default lane (``normal``, no tenant)."""
    if priority == DEFAULT_CLASS and tenant is None:
        return None
    return _choice(check_class(priority), check_tenant(tenant))


@functools.lru_cache(maxsize=1024)
def _choice(cls: str, tenant: str | None) -> LaneChoice | None:
    if cls == DEFAULT_CLASS and tenant is None:
        return None
    return LaneChoice(cls, tenant)


@functools.lru_cache(maxsize=4096)
def stream_of(prefix: str, tag: str, lane: LaneChoice | None) -> str:
    """The stream of ``lane`` on shard ``tag`` (None: ``P:{T}:requests``)."""
    if lane is None:
        return lane_stream(prefix, tag)
    return lane_stream(prefix, tag, lane.cls, lane.tenant)
