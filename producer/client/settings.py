"""A client's checked settings and the per-call arguments checked before any I/O.

``Settings`` holds the model, the key prefix and the backlog policy, the keys built from them,
and the shard and request id that a handle (what ``submit`` returned) names.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from producer.protocol import keys

__all__ = [
    "INFER_LIMIT",
    "MAX_SPAN_S",
    "Settings",
    "check_timeout_s",
    "check_ttl_s",
    "deadline_ms",
    "is_number",
]

#: The longest deadline or TTL a client takes, in seconds (about 31 years): past any real one,
#: yet small enough that now plus it, in milliseconds, fits the wire format's and Redis's
#: integers, so a typo is a ValueError here, not an OverflowError or a Redis refusal later.
MAX_SPAN_S = 1_000_000_000
#: What ends an ``infer``'s submit early, as RedisUnavailable's message names it.
INFER_LIMIT = "infer's timeout_s"


@dataclass(frozen=True, slots=True)
class Settings:
    """A client's checked settings and the key names built from them."""

    model: str
    prefix: str
    max_backlog: int | None
    wait_for_backlog: bool
    stream: str  # the model's first shard's
    workers_key: str

    @classmethod
    def create(
        cls, model: str, prefix: str, max_backlog: int | None, wait_for_backlog: bool
    ) -> Settings:
        """Check the settings; ValueError names the bad one."""
        workers_key = keys.workers_key(prefix, model)  # checks the model name first
        if max_backlog is not None and (type(max_backlog) is not int or max_backlog < 1):
            raise ValueError(
                f"max_backlog must be a positive integer or None, got {max_backlog!r}."
            )
        if not keys.is_valid_prefix(prefix):  # the workers and the CLI refuse the same ones
            raise ValueError(
                f"prefix {prefix!r} is not a key prefix: use a non-empty name without braces "
                "or whitespace."
            )
        return cls(
            model=model,
            prefix=prefix,
            max_backlog=max_backlog,
            wait_for_backlog=wait_for_backlog,
            stream=keys.request_stream(prefix, model),
            workers_key=workers_key,
        )

    def reply_key(self, rid: str, tag: str | None = None) -> str:
        """The reply list of ``rid`` on shard ``tag`` (default: the model's first); ValueError
        when the rid breaks the contract pattern."""
        return keys.reply_key(self.prefix, tag or self.model, rid)

    def cancel_key(self, rid: str, tag: str | None = None) -> str:
        """The cancel key of ``rid`` on shard ``tag`` (default: the model's first); ValueError
        when the rid breaks the contract pattern."""
        return keys.cancel_key(self.prefix, tag or self.model, rid)

    def target(self, handle: str) -> tuple[str, str]:
        """``(tag, rid)`` of what ``submit`` returned (a bare rid names the model's first
        shard); ValueError for a malformed one or another model's."""
        if not isinstance(handle, str):
            raise ValueError(f"A request handle is a string, got {handle!r}.")
        if "/" not in handle:  # a rid: checked where its key is built
            return self.model, handle
        return keys.parse_handle(handle, self.model)


def check_timeout_s(timeout_s: float) -> float:
    """``timeout_s``, when it is a number of seconds >= 0 (``math.inf``: no limit); else
    ValueError naming it. ``infer`` checks it before sending, so a bad timeout never leaves a
    request queued (and NaN would otherwise surface later as a bad ``retry_s``)."""
    if not is_number(timeout_s) or not timeout_s >= 0:  # NaN fails the comparison too
        raise ValueError(f"timeout_s must be a number of seconds >= 0, got {timeout_s!r}.")
    return float(timeout_s)


def check_ttl_s(name: str, ttl_s: int) -> int:
    """``ttl_s``, when it is a whole number of seconds from 1 to ``MAX_SPAN_S`` (a numpy
    integer too); else ValueError naming ``name``. Redis refuses other expire times, and its
    refusal would read as a Redis failure (``ConnectionFailed``)."""
    if not isinstance(ttl_s, numbers.Integral) or isinstance(ttl_s, bool):
        raise ValueError(f"{name} must be a whole number of seconds, got {ttl_s!r}.")
    if not 1 <= ttl_s <= MAX_SPAN_S:
        raise ValueError(
            f"{name} must be a whole number of seconds from 1 to {MAX_SPAN_S}, got {ttl_s!r}."
        )
    return int(ttl_s)


def deadline_ms(deadline_s: float | None, now_s: float) -> int | None:
    """The wire format's ``deadline_ms`` for a deadline ``deadline_s`` seconds after ``now_s``."""
    if deadline_s is None:
        return None
    if not is_number(deadline_s) or not 0 < deadline_s <= MAX_SPAN_S:
        raise ValueError(
            f"deadline_s must be a number of seconds above 0 and at most {MAX_SPAN_S}, "
            f"got {deadline_s!r}."
        )
    return round((now_s + deadline_s) * 1000)


def is_number(value: object) -> bool:
    """True for a real number; False for a bool, which would pass for 0 or 1 by mistake."""
    kind = type(value)
    if kind is float or kind is int:  # the common case, without the ABC check's cost
        return True
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
