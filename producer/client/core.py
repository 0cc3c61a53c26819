"""The client's logic with no I/O: what a request and a reply are, and how a submit is gated.

``Client`` (``client.py``) and ``AsyncClient`` (``aio.py``) are thin shells in the sans-I/O
style: ``plans.py`` says which Redis commands a call runs, built from the pieces here and in
``window.py`` (waiting for replies, map()'s window), ``workers.py`` (the worker registry) and
``connection.py`` (where a client connects; re-exported here). Pieces:

- ``Result`` and ``Chunk``: what callers get back; ``parse_reply`` reads a reply element.
- ``Settings``: a client's validated settings, the keys it uses, and the shard and request id
  a handle (what ``submit`` returned) names.
- ``check_timeout_s`` and ``check_ttl_s``: the per-call arguments checked before any I/O.
- ``build_submission``: a request as a stream entry (``rid``, ``body``); ``pack_xadds`` and
  ``pack_lpops``: submits and reply sweeps as one hand-packed round trip.
- ``BacklogGate``: from ``XLEN`` and Redis memory, go ahead, refuse, or sleep and look again.

Retrying through Redis outages, and turning redis-py errors into ``ConnectionFailed``, is
``producer.redisio.retry``'s job.
"""

from __future__ import annotations

import logging
import numbers
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from redis.typing import EncodableT, FieldT

from producer.protocol import codec, keys
from producer.protocol.codec import ErrorInfo, ModelRef
from producer.protocol.errors import BacklogFull, RedisFull, WireFormatError, error_for_code
from producer.redisio import resp
from producer.redisio.connection import (
    MAX_BLOCK_S,
    block_cap_s,
    check_connection_kwargs,
    describe_connection,
    redact_url,
)

__all__ = [
    "FIRST_BACKOFF_S",
    "INFER_LIMIT",
    "MAX_BACKOFF_S",
    "MAX_BLOCK_S",
    "MAX_SPAN_S",
    "BacklogGate",
    "Chunk",
    "Result",
    "Settings",
    "Submission",
    "as_bytes",
    "block_cap_s",
    "build_submission",
    "build_submissions",
    "check_connection_kwargs",
    "check_timeout_s",
    "check_ttl_s",
    "check_xadds",
    "describe_connection",
    "failed_result",
    "handle_of",
    "pack_lpops",
    "pack_xadds",
    "parse_reply",
    "parse_reply_or_fail",
    "redact_url",
]

log = logging.getLogger(__name__)

#: Backoff while waiting for the backlog to shrink; Redis has no event for a stream shrinking.
FIRST_BACKOFF_S = 0.005
MAX_BACKOFF_S = 0.2
#: The longest deadline or TTL a client takes, in seconds (about 31 years): past any real one,
#: yet small enough that now plus it, in milliseconds, fits the wire format's and Redis's
#: integers, so a typo is a ValueError here, not an OverflowError or a Redis refusal later.
MAX_SPAN_S = 1_000_000_000
#: What ends an ``infer``'s submit early, as RedisUnavailable's message names it.
INFER_LIMIT = "infer's timeout_s"
# Batches of submits go in transactions of at most this many entries or bytes (pack_xadds).
_MULTI = resp.command(b"MULTI")
_EXEC = resp.command(b"EXEC")
_TXN_ENTRIES = 256
_TXN_BYTES = 1 << 20
_WARNED: set[str] = set()  # warnings given once per process


# ---------------------------------------------------------------------------------------------
# Values handed to callers


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


def as_bytes(value: bytes | str) -> bytes:
    """``value``, which must be bytes; TypeError for text, which a decoding client returns."""
    # redis-py is typed to hand back bytes or str; the shells connect with decode_responses off.
    if isinstance(value, str):
        raise TypeError(
            "Redis returned text; connect with decode_responses=False (bodies are bytes)."
        )
    return value


# ---------------------------------------------------------------------------------------------
# Settings and submissions


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
        if "/" not in handle:  # a rid: checked where its key is built, as before shards
            return self.model, handle
        return keys.parse_handle(handle, self.model)


def check_timeout_s(timeout_s: float) -> float:
    """``timeout_s``, when it is a number of seconds >= 0 (``math.inf``: no limit); else
    ValueError naming it. ``infer`` checks it before sending, so a bad timeout never leaves a
    request queued (and NaN would otherwise surface later as a bad ``retry_s``)."""
    if not _is_number(timeout_s) or not timeout_s >= 0:  # NaN fails the comparison too
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


def _deadline_ms(deadline_s: float | None, now_s: float) -> int | None:
    """The wire format's ``deadline_ms`` for a deadline ``deadline_s`` seconds after ``now_s``."""
    if deadline_s is None:
        return None
    if not _is_number(deadline_s) or not 0 < deadline_s <= MAX_SPAN_S:
        raise ValueError(
            f"deadline_s must be a number of seconds above 0 and at most {MAX_SPAN_S}, "
            f"got {deadline_s!r}."
        )
    return round((now_s + deadline_s) * 1000)


def _is_number(value: object) -> bool:
    """True for a real number; False for a bool, which would pass for 0 or 1 by mistake."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(slots=True)
class Submission:
    """One request ready for ``XADD P:{T}:requests * rid R body B``; ``tag`` is the shard it
    goes to, chosen when it is sent ("" until then)."""

    rid: str
    body: bytes
    tag: str = ""

    @property
    def handle(self) -> str:
        """What ``submit`` returns: the rid on the model's first shard, else ``T/R``."""
        return handle_of(self.tag, self.rid)

    def fields(self) -> dict[FieldT, EncodableT]:
        """The stream entry's fields, in contract order."""
        return {"rid": self.rid, "body": self.body}


@dataclass(frozen=True, slots=True)
class Xadds:
    """``XADD``s packed for one round trip, and how their replies are laid out: ``blocks``
    holds each run of entries sent together, with whether it is a ``MULTI``/``EXEC``."""

    packer: resp.Packer
    blocks: tuple[tuple[int, bool], ...]


def pack_xadds(stream: str, subs: Sequence[Submission]) -> Xadds:
    """``XADD stream * rid R body B`` for each submission, for one round trip; two or more go
    in ``MULTI``/``EXEC`` transactions of at most ``_TXN_ENTRIES`` entries or about
    ``_TXN_BYTES`` of bodies.

    Redis serves a blocked ``XREADGROUP`` after each command it runs, so a plain pipeline of
    XADDs wakes a waiting worker after its first entry and the rest come in later reads, each
    with its own round trips and hand-over (docs/design.md). In a transaction the entries
    appear together, and are added whole or not at all. The cap keeps one transaction from
    holding Redis (and every worker's reads and finishes) for long.
    """
    packer, key = resp.Packer(), stream.encode()
    blocks: list[tuple[int, bool]] = []
    i = 0
    while i < len(subs):
        j, size = i, 0
        while j < len(subs) and j - i < _TXN_ENTRIES and (j == i or size < _TXN_BYTES):
            size += len(subs[j].body)
            j += 1
        txn = j - i > 1
        if txn:
            packer.add_packed(_MULTI)
        for sub in subs[i:j]:
            packer.add(b"XADD", key, b"*", b"rid", sub.rid.encode(), b"body", sub.body)
        if txn:
            packer.add_packed(_EXEC)
        blocks.append((j - i, txn))
        i = j
    return Xadds(packer, tuple(blocks))


def check_xadds(xadds: Xadds, replies: Sequence[Any]) -> None:
    """Raise the first error among the replies of ``xadds``, as ``resp.raise_first_error``.

    A ``MULTI`` refused (a producer ACL without ``+multi``, from before transactions) does not
    start a transaction: Redis runs that block's XADDs one by one and refuses its ``EXEC``. The
    entries are then in the stream, so that is not an error; it is logged once.
    """
    at = 0
    for count, txn in xadds.blocks:
        if not txn:
            resp.raise_first_error([replies[at]])
            at += 1
            continue
        opened, added, done = replies[at], replies[at + 1 : at + 1 + count], replies[at + 1 + count]
        at += count + 2
        if isinstance(opened, Exception):
            _warn_no_multi(opened)
            resp.raise_first_error(list(added))
            continue
        resp.raise_first_error([*added, done])


def _warn_no_multi(exc: Exception) -> None:
    if "no multi" not in _WARNED:
        _WARNED.add("no multi")
        log.warning(
            "Redis refused MULTI (%s); submits are sent without transactions, so a waiting "
            "worker may read a batch in parts. Grant the producer user +multi +exec +discard "
            "(docs/security.md).",
            exc,
        )


def pack_lpops(keys: Sequence[bytes]) -> resp.Packer:
    """``LPOP key`` for each key, for one round trip."""
    packer = resp.Packer()
    packed = [b"*2\r\n$4\r\nLPOP\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys]
    packer.add_packed(b"".join(packed), len(keys))
    return packer


def build_submission(
    inputs: Mapping[str, ArrayLike],
    *,
    outputs: Sequence[str] | None = None,
    deadline_s: float | None = None,
    meta: Any = None,
    rid: str | None = None,
    reply_ttl_s: int | None = None,
    now_s: float,
) -> Submission:
    """Encode one request; ``deadline_s`` is relative to ``now_s`` (Unix epoch seconds)."""
    if not isinstance(inputs, Mapping):
        raise TypeError(
            f"inputs must be a mapping of input name to array, got {type(inputs).__name__}."
        )
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str) or not keys.is_valid_rid(rid):
        raise ValueError(f"Request id {rid!r} does not match [A-Za-z0-9_.:-]{{1,128}}.")
    if reply_ttl_s is not None:
        check_ttl_s("reply_ttl_s", reply_ttl_s)
    if isinstance(outputs, str):
        raise ValueError(f"outputs must be a list of output names, got the string {outputs!r}.")
    deadline_ms = _deadline_ms(deadline_s, now_s)
    body = codec.encode_request(
        inputs, outputs=outputs, deadline_ms=deadline_ms, meta=meta, reply_ttl_s=reply_ttl_s
    )
    return Submission(rid, body)


def build_submissions(
    requests: Sequence[Mapping[str, ArrayLike]],
    *,
    outputs: Sequence[str] | None = None,
    deadline_s: float | None = None,
    meta: Any = None,
    reply_ttl_s: int | None = None,
    now_s: float,
) -> list[Submission]:
    """Encode many requests sharing their options, each with its own new rid."""
    # A string or a single mapping iterates as names, which would fail deep in the encoder.
    if isinstance(requests, str | bytes | Mapping) or not isinstance(requests, Iterable):
        raise TypeError(
            "submit_many takes a list of requests, each a mapping of input name to array; got "
            f"{type(requests).__name__} (for one request, use submit)."
        )
    return [
        build_submission(
            inputs,
            outputs=outputs,
            deadline_s=deadline_s,
            meta=meta,
            reply_ttl_s=reply_ttl_s,
            now_s=now_s,
        )
        for inputs in requests
    ]


class BacklogGate:
    """Decides from the stream's length, and from Redis memory, whether a submit goes ahead,
    fails, or waits.

    One gate serves one submit call: its backoff starts at ``FIRST_BACKOFF_S`` and doubles up to
    ``MAX_BACKOFF_S``, because Redis has no event that fires when a stream shrinks or memory
    frees. ``until`` (monotonic) bounds the wait: an ``infer`` waits no longer than its
    ``timeout_s``, and then gets the ``BacklogFull`` or ``RedisFull`` a submit that does not
    wait gets at once (nothing was sent).
    """

    def __init__(self, max_backlog: int | None, wait: bool, until: float | None = None) -> None:
        self.max_backlog = max_backlog
        self.wait = wait
        self.until = until
        self._next_delay_s = FIRST_BACKOFF_S

    @property
    def active(self) -> bool:
        """False when there is no limit, so no XLEN is needed."""
        return self.max_backlog is not None

    def delay_s(self, backlog: int, now: float) -> float | None:
        """None: go ahead. A number: sleep that long, then ask again. Raises BacklogFull when
        not waiting, or once ``now`` (monotonic) reaches ``until``."""
        if self.max_backlog is None or backlog < self.max_backlog:
            return None
        if not self.wait or (self.until is not None and now >= self.until):
            raise BacklogFull(backlog, self.max_backlog, waited=self.wait)
        return self._backoff_s(now)

    def refused(self, full: RedisFull, now: float) -> float:
        """How long to sleep before looking again at a Redis too full to submit to; raises
        ``full`` when not waiting, or once ``now`` reaches ``until``."""
        if not self.wait:
            raise full
        if self.until is not None and now >= self.until:
            raise full.waited_out()
        return self._backoff_s(now)

    def _backoff_s(self, now: float) -> float:
        delay = self._next_delay_s
        self._next_delay_s = min(delay * 2, MAX_BACKOFF_S)
        return delay if self.until is None else min(delay, self.until - now)
