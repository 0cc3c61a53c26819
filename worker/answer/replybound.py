"""The largest reply Redis will take, and the error reply that stands in for a larger one.

A bulk string over Redis's ``proto-max-bulk-len`` is refused with a protocol error and the
connection is closed (``../shared/FACTS.md``): the worker would see an outage and retry the
batch for ever. So replies are bounded before they are written: by ``limits.max_reply_bytes``
when set, and by the server's own limit, asked once per shard (``CONFIG GET``) on first use. A
reply over the bound is answered ``TOO_LARGE`` instead, naming its largest output.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from producer.protocol.units import format_bytes
from producer.redisio.bulklimit import BULK_KEY, REDIS_DEFAULT_BULK_BYTES, parse_bulk_limit
from worker.errors import Rejected

__all__ = ["HEADROOM_BYTES", "Bound", "ReplyBound", "numeric_bytes", "run_fits", "too_large"]

log = logging.getLogger(__name__)

#: Redis's own default ``proto-max-bulk-len`` (512 MiB), assumed when it cannot be read.
_SERVER = "Redis proto-max-bulk-len"
_CONFIGURED = "limits.max_reply_bytes"
_RETRY_S = 5.0
_ASSUMED = "Redis's default proto-max-bulk-len, assumed"


@dataclass(frozen=True, slots=True)
class Bound:
    """The largest reply, in bytes, and where that limit comes from (for the message)."""

    nbytes: int
    source: str


class ReplyBound:
    """Per shard, the largest reply its Redis takes. ``client_of(tag)`` is the shard's client
    (None: no Redis to ask); ``configured`` is ``limits.max_reply_bytes`` (0: learn it)."""

    def __init__(self, client_of: Callable[[str], redis.Redis | None], configured: int = 0) -> None:
        self.client_of = client_of
        self.configured = configured
        self._bounds: dict[str, Bound] = {}
        self._retry_at: dict[str, float] = {}  # monotonic: when to ask an unreachable one again
        self._warned = False

    def of(self, tag: str) -> Bound:
        """Shard ``tag``'s bound, learned on first use; a Redis that cannot be reached now is
        asked again next time (its writes wait for it anyway)."""
        bound = self._bounds.get(tag)
        if bound is not None:
            return bound
        client = self.client_of(tag)
        if client is not None and time.monotonic() >= self._retry_at.get(tag, 0.0):
            try:
                bound = self._learn(client)
            except (redis.ConnectionError, redis.TimeoutError):
                self._retry_at[tag] = time.monotonic() + _RETRY_S  # not on every batch
        if bound is None:
            return Bound(self.configured or REDIS_DEFAULT_BULK_BYTES, self._source())
        self._bounds[tag] = bound
        return bound

    def _source(self) -> str:
        return _CONFIGURED if self.configured else _ASSUMED

    def _learn(self, client: redis.Redis) -> Bound:
        server = _server_limit(client)
        if server is None:
            if not self.configured and not self._warned:
                self._warned = True
                log.warning(
                    "Redis refused CONFIG GET proto-max-bulk-len, so the largest reply it takes "
                    "is not known; assuming its default, %s. Set limits.max_reply_bytes to the "
                    "server's proto-max-bulk-len, or grant the worker's user +config|get: a "
                    "larger reply would be refused and stop this worker",
                    format_bytes(REDIS_DEFAULT_BULK_BYTES),
                )
            return Bound(self.configured or REDIS_DEFAULT_BULK_BYTES, self._source())
        if not self.configured:
            return Bound(server, _SERVER)
        if self.configured > server:
            if not self._warned:
                self._warned = True
                log.warning(
                    "limits.max_reply_bytes (%d) is above Redis's proto-max-bulk-len (%d); "
                    "replies are bounded by the smaller. Lower limits.max_reply_bytes, or "
                    "raise proto-max-bulk-len",
                    self.configured,
                    server,
                )
            return Bound(server, _SERVER)
        return Bound(self.configured, _CONFIGURED)


def _server_limit(client: redis.Redis) -> int | None:
    """``proto-max-bulk-len`` as the server reports it; None when refused (an ACL without
    +config|get, a managed Redis that renames CONFIG) or not reported."""
    try:
        got = client.config_get(BULK_KEY)
    except (redis.ConnectionError, redis.TimeoutError):
        raise
    except redis.RedisError:
        return None
    return parse_bulk_limit(got)


def too_large(size: int, bound: Bound, output_sizes: Mapping[str, int]) -> Rejected:
    """TOO_LARGE for a reply of ``size`` bytes over ``bound``, naming its largest output."""
    message = (
        f"the reply would be {format_bytes(size)}, over the {format_bytes(bound.nbytes)} "
        f"limit ({bound.source})"
    )
    if output_sizes:
        name, largest = max(output_sizes.items(), key=lambda kv: kv[1])
        message += f"; output {name!r} alone is {format_bytes(largest)}"
    message += (
        ". Ask for fewer rows per request or fewer outputs (outputs=...), or raise "
        "proto-max-bulk-len and limits.max_reply_bytes."
    )
    return Rejected("TOO_LARGE", message, retryable=False)


#: What a reply holds besides its outputs' data, at most: meta (4 KiB), rid, names, headers.
HEADROOM_BYTES = 64 * 1024


def numeric_bytes(outputs: Mapping[str, Any]) -> float:
    """The outputs' data bytes; infinity when one is not a numeric array (its encoded size
    is only known by encoding it)."""
    total = 0
    for array in outputs.values():
        if type(array) is not np.ndarray or array.dtype.kind in "OUSV":
            return float("inf")
        total += array.nbytes
    return total


def run_fits(first: Mapping[str, Any], rows: int, bound: int) -> bool:
    """Whether every reply of a run of ``rows`` rows is surely under ``bound``: that many rows
    of ``first`` (a request's numeric outputs), per row, plus the envelope, fit. One look per
    run rather than one per reply; False sends each reply through checks of its own."""
    per_row = 0
    for array in first.values():
        if type(array) is not np.ndarray or array.dtype.kind in "OUSV" or not array.ndim:
            return False
        if not array.shape[0]:
            return False
        per_row += array.nbytes // array.shape[0]
    return per_row * rows + HEADROOM_BYTES <= bound
