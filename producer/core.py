"""The client's logic with no I/O: what to send, what a reply means, and which workers are live.

``Client`` (``client.py``) and ``AsyncClient`` (``aio.py``) are thin shells in the sans-I/O
style: they run the Redis commands this module (and ``window.py``, which waits for replies and
runs map()'s window) asks for and feed the answers back, so the logic exists once and can be
tested without Redis. Pieces:

- ``Settings``: a client's validated settings and the keys it uses.
- ``check_timeout_s`` and ``check_ttl_s``: the per-call arguments the shells check themselves.
- ``build_submission``: a request as a stream entry (``rid``, ``body``).
- ``BacklogGate``: from ``XLEN``, go ahead, raise ``BacklogFull``, or sleep and look again.
- ``WorkerRoster`` and ``row_limit``: live worker records and the model's row limit.
- ``check_connection_kwargs`` and ``block_cap_s``: what a redis-py client must be, how long it
  may block; ``redact_url`` and ``describe_connection``: where it connects, without passwords.

Retrying through Redis outages, and turning redis-py errors into ``ConnectionFailed``, is
``producer.retry``'s job.
"""

from __future__ import annotations

import json
import logging
import numbers
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import numpy as np
from numpy.typing import ArrayLike
from redis.typing import EncodableT, FieldT

from producer import codec, keys, resp
from producer.codec import ErrorInfo, ModelRef
from producer.errors import BacklogFull, NoWorkerInfo, RedisFull, WireFormatError, error_for_code

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
    "WorkerRoster",
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
    "pack_xadds",
    "parse_reply",
    "redact_url",
    "row_limit",
]

log = logging.getLogger(__name__)

#: Backoff while waiting for the backlog to shrink; Redis has no event for a stream shrinking.
FIRST_BACKOFF_S = 0.005
MAX_BACKOFF_S = 0.2
#: The longest single blocking command. redis-py's default socket timeout is 5 s, and a BLPOP that
#: outlasts the socket timeout fails, so long waits are made of several short blocks.
MAX_BLOCK_S = 2.0
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
    """A worker's reply to one request; ``outputs`` when ``ok``, ``error`` otherwise."""

    rid: str
    ok: bool
    outputs: dict[str, np.ndarray] | None
    error: ErrorInfo | None
    meta: Any
    model: ModelRef
    worker: str
    batch_rows: int | None
    timings_ms: dict[str, float]

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


def parse_reply(rid: str, raw: bytes | str) -> Result:
    """Decode the reply element of request ``rid``; raises WireFormatError if it is not one."""
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
    )


def parse_reply_or_fail(rid: str, raw: bytes | str, model: str) -> Result:
    """``parse_reply``, or a failed Result (INTERNAL) when the reply cannot be decoded: one bad
    reply must not become an exception that loses the others read with it."""
    try:
        return parse_reply(rid, raw)
    except WireFormatError as exc:
        message = f"the reply could not be decoded: {exc}"
        return failed_result(rid, model, "INTERNAL", message, True)


def failed_result(rid: str, model: str, code: str, message: str, retryable: bool) -> Result:
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
    stream: str
    workers_key: str

    @classmethod
    def create(
        cls, model: str, prefix: str, max_backlog: int | None, wait_for_backlog: bool
    ) -> Settings:
        """Check the settings; ValueError names the bad one."""
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
            stream=keys.request_stream(prefix, model),  # checks the model name
            workers_key=keys.workers_key(prefix, model),
        )

    def reply_key(self, rid: str) -> str:
        """The reply list of ``rid``; ValueError when the rid breaks the contract pattern."""
        return keys.reply_key(self.prefix, rid)

    def cancel_key(self, rid: str) -> str:
        """The cancel key of ``rid``; ValueError when the rid breaks the contract pattern."""
        return keys.cancel_key(self.prefix, rid)


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


@dataclass(frozen=True, slots=True)
class Submission:
    """One request ready for ``XADD stream * rid R body B``."""

    rid: str
    body: bytes

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


# ---------------------------------------------------------------------------------------------
# Worker registry


@dataclass(frozen=True, slots=True)
class WorkerRoster:
    """The members of a model's worker set, split into names to look up and names to drop."""

    names: list[str]
    record_keys: list[str]
    junk: list[bytes]

    @classmethod
    def from_members(cls, settings: Settings, members: Iterable[bytes | str]) -> WorkerRoster:
        """Sort the set's members; ones that are not valid names can hold no record."""
        names, junk = [], []
        for member in sorted(as_bytes(m) for m in members):
            name = member.decode("utf-8", "replace")
            if keys.is_valid_name(name):
                names.append(name)
            else:
                junk.append(member)
        record_keys = [keys.worker_key(settings.prefix, settings.model, n) for n in names]
        return cls(names, record_keys, junk)

    def read(self, raws: Sequence[bytes | str | None]) -> tuple[list[dict[str, Any]], list[bytes]]:
        """The live records for ``raws`` (one per record key), and the set members to SREM."""
        records: list[dict[str, Any]] = []
        stale = list(self.junk)
        for name, raw in zip(self.names, raws, strict=True):
            if raw is None:
                stale.append(name.encode())
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                log.warning("worker %s has a record that is not JSON; skipped", name)
                continue
            if isinstance(record, dict):
                records.append(record)
            else:
                log.warning("worker %s has a record that is not a JSON object; skipped", name)
        return records, stale


def _row_limits(records: Iterable[Mapping[str, Any]]) -> list[int]:
    limits = []
    for record in records:
        batching = record.get("batching")
        size = batching.get("max_batch_size") if isinstance(batching, dict) else None
        if type(size) is int and size >= 1:
            limits.append(size)
    return limits


def check_rows_per_request(rows: int | None, records: Iterable[Mapping[str, Any]]) -> None:
    """Refuse a ``rows_per_request`` over the live workers' row limit, which would have every
    request answered TOO_LARGE; nothing to check when none has registered."""
    limits = _row_limits(records)
    if rows is not None and limits and rows > min(limits):
        raise ValueError(
            f"rows_per_request={rows} is over the live workers' max_batch_size={min(limits)}: "
            f"every request would be answered TOO_LARGE. Use {min(limits)} or less, or leave "
            "it out to use the workers' limit."
        )


def row_limit(records: Iterable[Mapping[str, Any]], settings: Settings) -> int:
    """The smallest ``batching.max_batch_size`` among live worker records."""
    limits = _row_limits(records)
    if not limits:
        raise NoWorkerInfo(
            f"No live worker of model {settings.model!r} has registered under prefix "
            f"{settings.prefix!r} (set {settings.workers_key}), so its row limit "
            "(batching.max_batch_size) is unknown. Start a worker first, or pass "
            "rows_per_request= to map()."
        )
    return min(limits)


# ---------------------------------------------------------------------------------------------
# Connections


def check_connection_kwargs(connection_kwargs: Mapping[str, Any]) -> None:
    """Refuse a redis-py client that decodes responses to text: bodies and replies are bytes."""
    if connection_kwargs.get("decode_responses"):
        raise ValueError(
            "The Redis client was created with decode_responses=True; redbatch needs raw bytes. "
            "Create it with decode_responses=False (the default)."
        )


def block_cap_s(socket_timeout_s: float | None) -> float:
    """The longest blocking command that cannot trip the connection's socket timeout."""
    if socket_timeout_s is None or socket_timeout_s <= 0:
        return MAX_BLOCK_S
    return min(MAX_BLOCK_S, socket_timeout_s / 2)


def redact_url(url: str) -> str:
    """``url`` without its password (in the authority or a ``password=`` query value)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:  # a bad port or host: shown as written, less what could be a password
        scheme, sep, rest = url.partition("://")
        if sep and "@" in rest:
            rest = "***@" + rest.rpartition("@")[2]
        return re.sub(r"([?&]password=)[^&#]*", r"\1***", scheme + sep + rest)
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{port}" if port is not None else "")
    if parts.username:
        netloc = f"{parts.username}@{netloc}"
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "password"])
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def describe_connection(connection_kwargs: Mapping[str, Any], tls: bool) -> str:
    """A URL-like description of a redis-py connection pool's settings, without a password."""
    if connection_kwargs.get("path"):
        return f"unix://{connection_kwargs['path']}?db={connection_kwargs.get('db', 0)}"
    scheme = "rediss" if tls else "redis"
    user = connection_kwargs.get("username")
    host = connection_kwargs.get("host", "localhost")
    port = connection_kwargs.get("port", 6379)
    db = connection_kwargs.get("db", 0)
    return f"{scheme}://{f'{user}@' if user else ''}{host}:{port}/{db}"
