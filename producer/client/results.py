"""What a caller gets back: ``Result`` (a worker's reply) and ``Chunk`` (one request of map()),
and the reading of a reply element into a Result. A reply that cannot be decoded becomes a
failed Result, never an exception that would lose the replies read with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from producer.protocol import codec, keys
from producer.protocol.codec import ErrorInfo, ModelRef
from producer.protocol.errors import WireFormatError, error_for_code

__all__ = [
    "WAIT_TIMEOUT",
    "Chunk",
    "Result",
    "as_bytes",
    "failed_result",
    "handle_of",
    "parse_reply",
    "parse_reply_or_fail",
    "wrong_type_result",
]

#: The client-side code of a request whose reply did not come in time (map() and ``redbatch
#: run``); its request is cancelled, so a worker that has not formed its batch yet skips it.
WAIT_TIMEOUT = "WAIT_TIMEOUT"


# eq=False: fields hold numpy arrays, whose == is elementwise, so a generated __eq__ would raise.
@dataclass(frozen=True, slots=True, eq=False)
class Result:
    """A worker's reply to one request; ``outputs`` when ``ok``, ``error`` otherwise.
    ``shard`` is the shard tag the request was sent to ("": not known, the model's first)."""

    rid: str
    ok: bool
    outputs: dict[str, np.ndarray] | None
    error: ErrorInfo | None
    meta: Any
    model: ModelRef
    worker: str
    batch_rows: int | None
    timings_ms: dict[str, float]
    shard: str = ""

    @property
    def handle(self) -> str:
        """What ``submit`` returned for this request: its rid, or ``T/R`` off the first shard."""
        return handle_of(self.shard, self.rid)

    def raise_for_error(self) -> None:
        """Raise the typed ``RequestFailed`` subclass for the reply's error code when not ok."""
        _raise_for_error(self.rid, self.ok, self.error)


@dataclass(frozen=True, slots=True, eq=False)
class Chunk:
    """One request of ``map()``: rows ``[start, stop)`` of the input and what came back.

    ``result`` is the whole reply (worker, model, batch_rows, timings); ``latency_ms`` is
    measured by the client, from the request's send to its reply's arrival.
    """

    start: int
    stop: int
    rid: str
    outputs: dict[str, np.ndarray] | None
    error: ErrorInfo | None
    result: Result
    latency_ms: float

    @property
    def ok(self) -> bool:
        """True when the worker answered these rows with outputs."""
        return self.error is None

    def raise_for_error(self) -> None:
        """Raise the typed ``RequestFailed`` subclass for the chunk's error when not ok."""
        _raise_for_error(self.rid, self.ok, self.error)


def _raise_for_error(rid: str, ok: bool, error: ErrorInfo | None) -> None:
    if ok:
        return
    err = error or ErrorInfo("INTERNAL", "the reply carried no error detail.", True)
    raise error_for_code(rid, err.code, err.message, err.retryable)


def handle_of(tag: str, rid: str) -> str:
    """``keys.handle``, without its checks where none is needed: a tag without ``~`` is a
    model's first shard, whose handle is the rid itself (the common case, on the hot path)."""
    return rid if "~" not in tag else keys.handle(tag, rid)


def parse_reply(rid: str, raw: bytes | str, shard: str = "") -> Result:
    """Decode the reply element of request ``rid`` (sent to ``shard``); raises WireFormatError
    if it is not one."""
    reply = codec.decode_reply(as_bytes(raw))
    return Result(
        rid=rid,
        ok=reply.ok,
        outputs=reply.outputs,
        error=reply.error,
        meta=reply.meta,
        model=reply.model,
        worker=reply.worker,
        batch_rows=reply.batch_rows,
        timings_ms=reply.timings_ms,
        shard=shard,
    )


def parse_reply_or_fail(rid: str, raw: bytes | str, model: str, shard: str = "") -> Result:
    """``parse_reply``, or a failed Result (INTERNAL) when the reply cannot be decoded: one bad
    reply must not become an exception that loses the others read with it."""
    try:
        return parse_reply(rid, raw, shard)
    except WireFormatError as exc:
        message = f"the reply could not be decoded: {exc}"
        return failed_result(rid, model, "INTERNAL", message, True, shard)


def failed_result(
    rid: str, model: str, code: str, message: str, retryable: bool, shard: str = ""
) -> Result:
    """A Result for a request the client had to give up on itself (no usable reply)."""
    return Result(
        rid=rid,
        ok=False,
        outputs=None,
        error=ErrorInfo(code, message, retryable),
        meta=None,
        model=ModelRef(model, "", ""),
        worker="",
        batch_rows=None,
        timings_ms={},
        shard=shard,
    )


def wrong_type_result(
    rid: str, model: str, key: bytes, error: BaseException, shard: str = ""
) -> Result:
    """A failed Result (INTERNAL, not retryable as is) for a request whose reply key holds
    another type of value than a list: something other than a worker wrote it, and Redis
    answered ``error`` (WRONGTYPE) when the client read it."""
    name = key.decode("utf-8", "replace")
    message = (
        f"the reply key {name!r} holds a value that is not a list ({_first_line(error)}): "
        "something other than a worker wrote it, so this request's reply cannot be read. "
        f"An operator can look at it (TYPE {name}) and remove it (DEL {name}); then send the "
        "request again."
    )
    return failed_result(rid, model, "INTERNAL", message, False, shard)


def _first_line(error: BaseException) -> str:
    cause = error if error.__cause__ is None else error.__cause__
    return str(cause).rpartition("caused error: ")[2].splitlines()[0].rstrip(".")


def as_bytes(value: bytes | str) -> bytes:
    """``value``, which must be bytes; TypeError for text, which a decoding client returns."""
    # redis-py is typed to hand back bytes or str; the shells connect with decode_responses off.
    if isinstance(value, str):
        raise TypeError(
            "Redis returned text; connect with decode_responses=False (bodies are bytes)."
        )
    return value
