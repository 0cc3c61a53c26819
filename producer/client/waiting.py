"""Waiting for replies, with no I/O: ``ReplyWaiter`` holds the replies still awaited, their
shards and deadlines, which shard to block on and for how long.

The plans (``producer.client.plans``) ask for the Redis commands it needs and feed it the
answers, so the logic exists once, for both shells, and can be tested without Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from producer.client.results import (
    WAIT_TIMEOUT,
    Result,
    as_bytes,
    failed_result,
    handle_of,
    parse_reply_or_fail,
    wrong_type_result,
)
from producer.client.settings import Settings, check_timeout_s
from producer.protocol.errors import WaitTimeout
from producer.redisio.connection import block_s

__all__ = ["SHARD_TURN_S", "ReplyWaiter", "Target", "wait_timeout"]

#: The longest BLPOP on one shard while replies are awaited on others too (a BLPOP watches one
#: slot): one shard's turn. Redis's own timeout floor (100 ms at ``hz 10``) is about this.
SHARD_TURN_S = 0.1

#: A request as the client addresses it: (shard tag, rid).
Target = tuple[str, str]


class ReplyWaiter:
    """The replies still awaited, each with its shard and its own monotonic deadline.

    A plan asks for ``by_shard()``, pops those keys (a pipelined LPOP per shard), and, when
    none was ready, a BLPOP over one shard's keys (``blpop_keys()``; a BLPOP watches one slot)
    for ``block_s()`` seconds. It hands the answers to ``take_popped``/``take_blpopped``, which
    return the Results and forget their keys. With replies awaited on several shards, the
    BLPOP goes to each shard in turn and blocks at most ``SHARD_TURN_S``, so a reply on
    another shard waits that long at most; with one shard it blocks until the first deadline.
    A BLPOP that comes back empty after a deadline has passed raises WaitTimeout, so every
    request gets at least one look; with ``late_fails`` it instead returns a failed Result
    (code WAIT_TIMEOUT) for each late request and lists them in ``late``, for the plan to
    cancel. A reply that cannot be decoded, or a reply key of another type (an answer that is
    the key's WRONGTYPE error), is a failed Result (code INTERNAL), never an exception that
    would lose its neighbours.
    """

    def __init__(self, settings: Settings, timeout_s: float, *, late_fails: bool = False) -> None:
        self._settings = settings
        self.timeout_s = check_timeout_s(timeout_s)
        self.late_fails = late_fails
        self.late: list[Target] = []  # requests given up on, not yet cancelled by the plan
        #: Set by the plan when a pop needed a retry: it may have taken a reply whose answer
        #: was lost with its connection, so the requests still awaited are sent again.
        self.interrupted = False
        # reply key, as bytes like BLPOP hands it back -> (rid, monotonic deadline, shard tag)
        self._pending: dict[bytes, tuple[str, float, str]] = {}
        self._turn = 0  # which shard the next BLPOP watches, when several have keys

    @property
    def model(self) -> str:
        """The model whose replies these are."""
        return self._settings.model

    @property
    def pending(self) -> int:
        """How many replies are still awaited."""
        return len(self._pending)

    def add(self, rid: str, now: float, tag: str | None = None) -> bytes:
        """Await the reply of ``rid``, sent to shard ``tag`` (None: the model's first), until
        ``now + timeout_s``; ValueError for a bad rid. ``now`` may be earlier than the present:
        ``infer`` counts its wait from before its submit. Returns its reply key."""
        tag = tag or self._settings.model
        key = self._settings.reply_key(rid, tag).encode()
        self._pending.setdefault(key, (rid, now + self.timeout_s, tag))
        return key

    def keys(self) -> list[bytes]:
        """The reply keys still awaited, oldest first."""
        return list(self._pending)

    def by_shard(self) -> dict[str, list[bytes]]:
        """The reply keys still awaited, by shard tag, oldest first."""
        if len({tag for _, _, tag in self._pending.values()}) == 1:
            return {next(iter(self._pending.values()))[2]: list(self._pending)}
        found: dict[str, list[bytes]] = {}
        for key, (_, _, tag) in self._pending.items():
            found.setdefault(tag, []).append(key)
        return found

    def targets(self) -> list[Target]:
        """The requests still awaited, as (tag, rid), oldest first."""
        return [(tag, rid) for rid, _, tag in self._pending.values()]

    def rids(self) -> list[str]:
        """The request ids still awaited, oldest first."""
        return [rid for rid, _, _ in self._pending.values()]

    def blpop_keys(self) -> tuple[str, list[bytes], bool]:
        """The shard the next BLPOP watches, its keys, and whether other shards have keys too
        (then it blocks ``SHARD_TURN_S`` at most). Shards take turns."""
        by_shard = self.by_shard()
        tags = list(by_shard)
        tag = tags[self._turn % len(tags)]
        self._turn += 1
        return tag, by_shard[tag], len(tags) > 1

    @property
    def deadline(self) -> float:
        """The first deadline among the replies awaited (monotonic)."""
        return self._first_deadline()

    def time_left(self, now: float) -> float:
        """Seconds until the first deadline (0 once it has passed)."""
        return max(self._first_deadline() - now, 0.0)

    def block_s(self, now: float, cap_s: float, shared: bool = False) -> float:
        """Seconds a BLPOP should block: until the first deadline, at most ``cap_s``, and at
        most ``SHARD_TURN_S`` when it watches one shard of several (``shared``)."""
        return block_s(self._first_deadline(), now, min(cap_s, SHARD_TURN_S) if shared else cap_s)

    def _first_deadline(self) -> float:
        return min(deadline for _, deadline, _ in self._pending.values())

    def take_popped(
        self, keys_: Sequence[bytes], raws: Sequence[bytes | str | Exception | None]
    ) -> list[Result]:
        """Results for the keys whose LPOP returned an element (or an error), in the order of
        ``keys_``."""
        return [
            self._take(key, raw) for key, raw in zip(keys_, raws, strict=True) if raw is not None
        ]

    def take_blpopped(self, item: Sequence[Any] | None, now: float) -> list[Result]:
        """The Result in a BLPOP answer (``[key, element]``); if it timed out, none, or
        WaitTimeout when a deadline has passed by ``now``."""
        if not item:
            return self._late(now)
        key, raw = item  # raw: the element, or the key's WRONGTYPE error
        return [self._take(as_bytes(key), raw)]

    def _take(self, key: bytes, raw: bytes | str | Exception) -> Result:
        rid, _, tag = self._pending.pop(key)
        if isinstance(raw, Exception):
            return wrong_type_result(rid, self._settings.model, key, raw, tag)
        return parse_reply_or_fail(rid, raw, self._settings.model, tag)

    def _late(self, now: float) -> list[Result]:
        late = {k: v for k, v in self._pending.items() if v[1] <= now}
        if not late:
            return []
        if self.late_fails:
            self._pending = {k: v for k, v in self._pending.items() if k not in late}
            self.late.extend((tag, rid) for rid, _, tag in late.values())
            message = (
                f"no reply within {self.timeout_s:g} s; the request was cancelled. A worker may "
                "be down or behind: 'redbatch status' shows the backlog and the live workers."
            )
            model = self._settings.model
            return [
                failed_result(rid, model, WAIT_TIMEOUT, message, True, tag)
                for rid, _, tag in late.values()
            ]
        handles = [handle_of(tag, rid) for rid, _, tag in late.values()]
        raise wait_timeout(self._settings.model, self.timeout_s, handles)


def wait_timeout(model: str, timeout_s: float, rids: Sequence[str]) -> WaitTimeout:
    """The error for requests whose reply did not come within ``timeout_s``."""
    shown = ", ".join(rids[:5]) + (f" and {len(rids) - 5} more" if len(rids) > 5 else "")
    return WaitTimeout(
        f"No reply within {timeout_s:g} s for {len(rids)} request(s) to model {model!r}: "
        f"{shown}. A worker may be down or behind; 'redbatch status' shows the backlog and the "
        "live workers."
    )
