"""Errors raised by the producer package.

Every error has one root, so callers can catch ``RedbatchError`` and nothing else::

    RedbatchError
    ├── WireFormatError        bytes off the wire format (code MALFORMED or TOO_LARGE)
    ├── BacklogFull            the request stream is at or above the producer's max_backlog
    ├── RedisFull              Redis memory is at the producers' high watermark, or Redis
    │                          refused a write for memory (maxmemory with noeviction)
    ├── WaitTimeout            no reply arrived in time (also a builtin TimeoutError)
    ├── ConnectionFailed       Redis could not be reached or refused the command
    │   ├── RedisUnavailable   Redis stayed unreachable or busy through the retry budget
    │   ├── Misconfigured      the connection's settings are wrong (TLS, certificate,
    │   │                      password): no retry can fix it
    │   └── StreamExhausted    the request stream's id space is used up (an XADD with the
    │                          largest id): no XADD * can succeed until it is repaired
    ├── NoWorkerInfo           a value only a live worker can tell (its row limit) is unknown
    ├── UsageError             a command cannot run as asked (bad option, unreadable file)
    └── RequestFailed          the worker answered ok = false; one subclass per contract code
        ├── MalformedRequest   MALFORMED
        ├── InvalidInput       INVALID_INPUT
        ├── TooLarge           TOO_LARGE
        ├── DeadlineExceeded   DEADLINE_EXCEEDED
        ├── Cancelled          CANCELLED
        ├── InferenceFailed    INFERENCE_FAILED
        ├── Poisoned           POISONED
        └── InternalError      INTERNAL, and any code this version does not know
"""

from __future__ import annotations

from producer.protocol.units import format_bytes

__all__ = [
    "ERROR_CODES",
    "BacklogFull",
    "Cancelled",
    "ConnectionFailed",
    "DeadlineExceeded",
    "InferenceFailed",
    "InternalError",
    "InvalidInput",
    "MalformedRequest",
    "Misconfigured",
    "NoWorkerInfo",
    "Poisoned",
    "RedbatchError",
    "RedisFull",
    "RedisUnavailable",
    "RequestFailed",
    "StreamExhausted",
    "TooLarge",
    "UsageError",
    "WaitTimeout",
    "WireFormatError",
    "error_for_code",
]

ERROR_CODES = (
    "MALFORMED",
    "INVALID_INPUT",
    "TOO_LARGE",
    "DEADLINE_EXCEEDED",
    "CANCELLED",
    "INFERENCE_FAILED",
    "POISONED",
    "INTERNAL",
)


class RedbatchError(Exception):
    """Raised for every failure the redbatch packages report; the root of the tree."""


class WireFormatError(RedbatchError):
    """Raised when bytes do not follow the wire format; ``code`` is the contract code to answer."""

    def __init__(self, message: str, code: str = "MALFORMED") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        #: What a request body that failed could still tell, for its error reply: the meta
        #: bytes to echo and the reply TTL it asked for (None when not sent or unreadable).
        self.meta_raw: bytes | None = None
        self.reply_ttl_s: int | None = None


class BacklogFull(RedbatchError):
    """Raised by submit when the request stream holds max_backlog entries or more."""

    def __init__(self, backlog: int, max_backlog: int, *, waited: bool = False) -> None:
        advice = (
            "The call's timeout_s ran out while it waited for the backlog to drop; the request "
            "was not sent. Give it a longer timeout_s, raise max_backlog, or add workers."
            if waited
            else "Retry later, raise max_backlog, or submit with wait_for_backlog=True."
        )
        super().__init__(
            f"Request stream backlog is {backlog}, at or above max_backlog={max_backlog}. {advice}"
        )
        self.backlog = backlog
        self.max_backlog = max_backlog


class RedisFull(RedbatchError):
    """Raised by submit when Redis memory is at the producers' high watermark of ``maxmemory``,
    or when Redis refused a write for memory (``OOM``); nothing was sent."""

    def __init__(
        self,
        where: str,
        used_bytes: int | None,
        max_bytes: int | None,
        watermark: float | None,
        *,
        refused: str | None = None,
        waited: bool = False,
    ) -> None:
        self.where = where
        self.used_bytes = used_bytes
        self.max_bytes = max_bytes
        self.watermark = watermark
        self.refused = refused
        self.waited = waited
        super().__init__(self._message())

    def waited_out(self) -> RedisFull:
        """The same refusal, for a call whose timeout_s ran out while it waited for room."""
        return RedisFull(
            self.where,
            self.used_bytes,
            self.max_bytes,
            self.watermark,
            refused=self.refused,
            waited=True,
        )

    def _message(self) -> str:
        used, limit = self.used_bytes, self.max_bytes
        if used is not None and limit:
            how_full = (
                f"used_memory {format_bytes(used)} is {used / limit:.0%} of maxmemory "
                f"{format_bytes(limit)}"
            )
        else:
            how_full = "it is at maxmemory"
        if self.refused is not None:
            head = (
                f"Redis at {self.where} is full (maxmemory): it refused the write "
                f"({self.refused.rstrip('.')}); {how_full}."
            )
        else:
            mark = f"{self.watermark:.0%}" if self.watermark is not None else "?"
            head = (
                f"Redis at {self.where} is full: {how_full}, at or above the producers' high "
                f"watermark of {mark}."
            )
        if self.waited:
            advice = "The call's timeout_s ran out while it waited for room; nothing was sent."
        else:
            what = "Nothing was written" if self.refused is not None else "The request was not sent"
            advice = (
                f"{what}; workers keep draining the backlog. Retry later, or submit with "
                "wait_for_backlog=True to wait for room."
            )
        return (
            f"{head} {advice} Add workers, read or shorten replies (reply_ttl_s), or raise "
            "maxmemory (docs/operations.md, 'A full Redis')."
        )


class WaitTimeout(RedbatchError, TimeoutError):
    """Raised when no reply arrived for a request within the caller's timeout."""


class ConnectionFailed(RedbatchError):
    """Raised when Redis cannot be reached, refuses a login, or rejects a command."""


class RedisUnavailable(ConnectionFailed):
    """Raised when Redis stayed unreachable, loading or busy for the client's whole ``retry_s``."""


class Misconfigured(ConnectionFailed):
    """Raised at once when the connection's settings are wrong (a plain URL to a TLS port or the
    reverse, a certificate that does not verify, a wrong password): not an outage, so not
    retried; the message names the fix."""


class StreamExhausted(ConnectionFailed):
    """Raised when Redis refuses an ``XADD *`` because the stream holds the largest possible
    id: nothing can be added until an operator repairs it (docs/operations.md, "A damaged
    stream")."""


class NoWorkerInfo(RedbatchError):
    """Raised when a value only a live worker can tell (such as its row limit) is unknown."""


class UsageError(RedbatchError):
    """Raised when a command cannot run as asked (bad option, unreadable file); exit status 2."""


class RequestFailed(RedbatchError):
    """Raised when a worker answered a request with ok = false."""

    code = "INTERNAL"

    def __init__(self, rid: str, code: str, message: str, retryable: bool) -> None:
        super().__init__(f"{code}: {message} (request {rid})")
        self.rid = rid
        self.code = code
        self.message = message
        self.retryable = retryable


class MalformedRequest(RequestFailed):
    """Raised when the worker could not parse the request body (MALFORMED)."""

    code = "MALFORMED"


class InvalidInput(RequestFailed):
    """Raised when the request does not fit the model's input schema (INVALID_INPUT)."""

    code = "INVALID_INPUT"


class TooLarge(RequestFailed):
    """Raised when the request has too many bytes or rows (TOO_LARGE)."""

    code = "TOO_LARGE"


class DeadlineExceeded(RequestFailed):
    """Raised when the request's deadline passed before it ran (DEADLINE_EXCEEDED)."""

    code = "DEADLINE_EXCEEDED"


class Cancelled(RequestFailed):
    """Raised when the request was cancelled before it ran (CANCELLED)."""

    code = "CANCELLED"


class InferenceFailed(RequestFailed):
    """Raised when the runtime failed on this request even alone (INFERENCE_FAILED)."""

    code = "INFERENCE_FAILED"


class Poisoned(RequestFailed):
    """Raised when the request was dead-lettered after max_deliveries (POISONED)."""

    code = "POISONED"


class InternalError(RequestFailed):
    """Raised for INTERNAL, and for any code this client version does not know."""

    code = "INTERNAL"


_BY_CODE: dict[str, type[RequestFailed]] = {
    cls.code: cls
    for cls in (
        MalformedRequest,
        InvalidInput,
        TooLarge,
        DeadlineExceeded,
        Cancelled,
        InferenceFailed,
        Poisoned,
        InternalError,
    )
}


def error_for_code(rid: str, code: str, message: str, retryable: bool) -> RequestFailed:
    """Build the typed error for a reply's error code; unknown codes become InternalError."""
    cls = _BY_CODE.get(code, InternalError)
    return cls(rid, code, message, retryable)
