"""The client's logic with no I/O: what to send, what a reply means, and what map() does next.

``Client`` (``client.py``) and ``AsyncClient`` (``aio.py``) are thin shells in the sans-I/O
style: they run the Redis commands this module asks for and feed the answers back, so the logic
exists once and can be tested without Redis. Pieces:

- ``Settings``: a client's validated settings and the keys it uses.
- ``build_submission``: a request as a stream entry (``rid``, ``body``).
- ``BacklogGate``: from ``XLEN``, go ahead, raise ``BacklogFull``, or sleep and look again.
- ``ReplyWaiter``: the replies still awaited, their deadlines, and how long to block.
- ``MapPlan``: map()'s window: which rows to send next and which chunks may be yielded in order.
- ``WorkerRoster`` and ``row_limit``: live worker records and the model's row limit.
- ``translate_redis_errors``: redis-py errors to ``ConnectionFailed``, without passwords.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import numpy as np
import redis.exceptions
from numpy.typing import ArrayLike
from redis.typing import EncodableT, FieldT

from producer import codec, keys
from producer.codec import ErrorInfo, ModelRef
from producer.errors import (
    BacklogFull,
    ConnectionFailed,
    NoWorkerInfo,
    WaitTimeout,
    error_for_code,
)

__all__ = [
    "FIRST_BACKOFF_S",
    "MAX_BACKOFF_S",
    "MAX_BLOCK_S",
    "REDIS_ERRORS",
    "BacklogGate",
    "Chunk",
    "MapPlan",
    "ReplyWaiter",
    "Result",
    "Settings",
    "Submission",
    "WorkerRoster",
    "block_cap_s",
    "build_submission",
    "check_connection_kwargs",
    "describe_connection",
    "parse_reply",
    "redact_url",
    "row_limit",
    "translate_redis_errors",
]

log = logging.getLogger(__name__)

#: Backoff while waiting for the backlog to shrink; Redis has no event for a stream shrinking.
FIRST_BACKOFF_S = 0.005
MAX_BACKOFF_S = 0.2
#: The longest single blocking command. redis-py's default socket timeout is 5 s, and a BLPOP that
#: outlasts the socket timeout fails, so long waits are made of several short blocks.
MAX_BLOCK_S = 2.0

#: The redis-py errors the shells translate into ConnectionFailed (AuthenticationError is a
#: ConnectionError; NoPermissionError is a ResponseError).
REDIS_ERRORS = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ResponseError,
)


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
    reply = codec.decode_reply(_as_bytes(raw))
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


def _as_bytes(value: bytes | str) -> bytes:
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
        if not prefix:
            raise ValueError("prefix must not be empty.")
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


@dataclass(frozen=True, slots=True)
class Submission:
    """One request ready for ``XADD stream * rid R body B``."""

    rid: str
    body: bytes

    def fields(self) -> dict[FieldT, EncodableT]:
        """The stream entry's fields, in contract order."""
        return {"rid": self.rid, "body": self.body}


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
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str) or not keys.is_valid_rid(rid):
        raise ValueError(f"Request id {rid!r} does not match [A-Za-z0-9_.:-]{{1,128}}.")
    if reply_ttl_s is not None and (type(reply_ttl_s) is not int or reply_ttl_s < 1):
        raise ValueError(f"reply_ttl_s must be a positive integer, got {reply_ttl_s!r}.")
    if isinstance(outputs, str):
        raise ValueError(f"outputs must be a list of output names, got the string {outputs!r}.")
    deadline_ms = None if deadline_s is None else max(0, round((now_s + deadline_s) * 1000))
    body = codec.encode_request(
        inputs, outputs=outputs, deadline_ms=deadline_ms, meta=meta, reply_ttl_s=reply_ttl_s
    )
    return Submission(rid, body)


class BacklogGate:
    """Decides from the stream's length whether a submit goes ahead, fails, or waits.

    One gate serves one submit call: its backoff starts at ``FIRST_BACKOFF_S`` and doubles up to
    ``MAX_BACKOFF_S``, because Redis has no event that fires when a stream shrinks.
    """

    def __init__(self, max_backlog: int | None, wait: bool) -> None:
        self.max_backlog = max_backlog
        self.wait = wait
        self._next_delay_s = FIRST_BACKOFF_S

    @property
    def active(self) -> bool:
        """False when there is no limit, so no XLEN is needed."""
        return self.max_backlog is not None

    def delay_s(self, backlog: int) -> float | None:
        """None: go ahead. A number: sleep that long, then ask again. Raises BacklogFull."""
        if self.max_backlog is None or backlog < self.max_backlog:
            return None
        if not self.wait:
            raise BacklogFull(backlog, self.max_backlog)
        delay = self._next_delay_s
        self._next_delay_s = min(delay * 2, MAX_BACKOFF_S)
        return delay


# ---------------------------------------------------------------------------------------------
# Waiting for replies


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


class ReplyWaiter:
    """The replies still awaited, each with its own monotonic deadline.

    A shell asks for ``keys()``, pops them (a pipelined LPOP, or a BLPOP of ``block_s()``
    seconds when none was ready), and hands the answers to ``take_popped``/``take_blpopped``,
    which return the Results and forget their keys. A BLPOP that comes back empty after a
    deadline has passed raises WaitTimeout, so every request gets at least one look.
    """

    def __init__(self, settings: Settings, timeout_s: float) -> None:
        if timeout_s < 0:
            raise ValueError(f"timeout_s must not be negative, got {timeout_s!r}.")
        self._settings = settings
        self.timeout_s = timeout_s
        # reply key, as bytes like BLPOP hands it back -> (rid, monotonic deadline)
        self._pending: dict[bytes, tuple[str, float]] = {}

    @property
    def pending(self) -> int:
        """How many replies are still awaited."""
        return len(self._pending)

    def add(self, rid: str, now: float) -> None:
        """Await ``rid``'s reply until ``now + timeout_s``; ValueError for a bad rid."""
        key = self._settings.reply_key(rid).encode()
        self._pending.setdefault(key, (rid, now + self.timeout_s))

    def keys(self) -> list[bytes]:
        """The reply keys still awaited, oldest first."""
        return list(self._pending)

    def block_s(self, now: float, cap_s: float) -> float:
        """Seconds a BLPOP should block: until the first deadline, at most ``cap_s``."""
        first = min(deadline for _, deadline in self._pending.values())
        # Redis counts in milliseconds, and a timeout of 0 would block forever.
        return max(round(min(first - now, cap_s), 3), 0.001)

    def take_popped(
        self, keys_: Sequence[bytes], raws: Sequence[bytes | str | None]
    ) -> list[Result]:
        """Results for the keys whose LPOP returned an element, in the order of ``keys_``."""
        return [
            self._take(key, raw) for key, raw in zip(keys_, raws, strict=True) if raw is not None
        ]

    def take_blpopped(self, item: Sequence[bytes | str] | None, now: float) -> list[Result]:
        """The Result in a BLPOP answer (``[key, element]``); if it timed out, none, or
        WaitTimeout when a deadline has passed by ``now``."""
        if not item:
            self._raise_if_late(now)
            return []
        key, raw = item
        return [self._take(_as_bytes(key), raw)]

    def _take(self, key: bytes, raw: bytes | str) -> Result:
        rid, _ = self._pending.pop(key)
        return parse_reply(rid, raw)

    def _raise_if_late(self, now: float) -> None:
        late = [rid for rid, deadline in self._pending.values() if deadline <= now]
        if not late:
            return
        shown = ", ".join(late[:5]) + (f" and {len(late) - 5} more" if len(late) > 5 else "")
        raise WaitTimeout(
            f"No reply within {self.timeout_s:g} s for {len(late)} request(s) to model "
            f"{self._settings.model!r}: {shown}. A worker may be down or behind; "
            "'redbatch status' shows the backlog and the live workers."
        )


# ---------------------------------------------------------------------------------------------
# map()


class MapPlan:
    """map()'s state: rows to send next, requests in flight, and chunks ready in input order.

    At most ``concurrency`` requests are in flight, and at most ``2 * concurrency`` are held
    between being sent and being yielded, so a slow first request cannot make the plan buffer
    the whole input. The shell loops: ``take()`` and send, ``sent()``, yield ``ready()``, then
    wait on ``waiter`` and hand its Results to ``answered()``, until ``finished``.
    """

    def __init__(
        self,
        settings: Settings,
        arrays: Mapping[str, ArrayLike],
        *,
        rows_per_request: int | None,
        concurrency: int,
        outputs: Sequence[str] | None,
        timeout_s: float,
    ) -> None:
        if type(concurrency) is not int or concurrency < 1:
            raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}.")
        self._arrays, self.rows = _leading_rows(arrays)
        self._concurrency = concurrency
        self._outputs = outputs
        self._rows_per_request = 0
        self._next_start = 0
        self._in_flight: dict[str, tuple[int, int]] = {}  # rid -> (start, stop), in send order
        self._sent_at: dict[str, float] = {}  # rid -> monotonic send time
        self._answered: dict[int, Chunk] = {}  # start -> chunk
        self._next_yield = 0  # start of the next chunk to yield
        self._held = 0  # requests sent and not yet yielded
        self.waiter = ReplyWaiter(settings, timeout_s)
        if rows_per_request is not None:
            self.use_row_limit(rows_per_request)

    @property
    def needs_row_limit(self) -> bool:
        """True when the caller gave no rows_per_request and there are rows to send."""
        return self._rows_per_request == 0 and self.rows > 0

    def use_row_limit(self, rows_per_request: int) -> None:
        """Send at most ``rows_per_request`` rows per request."""
        if type(rows_per_request) is not int or rows_per_request < 1:
            raise ValueError(
                f"rows_per_request must be a positive integer, got {rows_per_request!r}."
            )
        self._rows_per_request = rows_per_request

    @property
    def finished(self) -> bool:
        """True once every row has been yielded (at once for zero rows)."""
        return self._next_yield >= self.rows

    def take(self, now_s: float) -> list[Submission]:
        """The requests to send now to fill the window; ``now_s`` is the Unix time."""
        if self.needs_row_limit:
            raise RuntimeError("MapPlan.use_row_limit() must be called before take().")
        room = min(self._concurrency - len(self._in_flight), 2 * self._concurrency - self._held)
        subs = []
        while room > 0 and self._next_start < self.rows:
            start = self._next_start
            stop = min(start + self._rows_per_request, self.rows)
            inputs = {name: arr[start:stop] for name, arr in self._arrays.items()}
            sub = build_submission(inputs, outputs=self._outputs, now_s=now_s)
            self._in_flight[sub.rid] = (start, stop)
            self._next_start = stop
            self._held += 1
            subs.append(sub)
            room -= 1
        return subs

    def sent(self, subs: Iterable[Submission], now: float) -> None:
        """Start the reply clock of requests that reached the stream (``now`` is monotonic)."""
        for sub in subs:
            self.waiter.add(sub.rid, now)
            self._sent_at[sub.rid] = now

    def answered(self, results: Iterable[Result], now: float) -> None:
        """Record replies that arrived by ``now`` (monotonic); failed ones keep ``error``."""
        for result in results:
            start, stop = self._in_flight.pop(result.rid)
            latency_ms = (now - self._sent_at.pop(result.rid)) * 1000
            self._answered[start] = Chunk(
                start, stop, result.rid, result.outputs, result.error, result, latency_ms
            )

    def ready(self) -> list[Chunk]:
        """The answered chunks that come next in input order, removed from the plan."""
        chunks = []
        while (chunk := self._answered.pop(self._next_yield, None)) is not None:
            chunks.append(chunk)
            self._next_yield = chunk.stop
            self._held -= 1
        return chunks


def _leading_rows(arrays: Mapping[str, ArrayLike]) -> tuple[dict[str, np.ndarray], int]:
    """The inputs as arrays, and the row count they share."""
    if not arrays:
        raise ValueError("map() needs at least one input array.")
    as_arrays = {name: np.asarray(a) for name, a in arrays.items()}
    for name, a in as_arrays.items():
        if a.ndim == 0:
            raise ValueError(f"map() splits inputs by rows; input {name!r} is a scalar.")
    rows = {name: a.shape[0] for name, a in as_arrays.items()}
    if len(set(rows.values())) > 1:
        listed = ", ".join(f"{name!r} has {n}" for name, n in rows.items())
        raise ValueError(f"map() needs every input to have the same number of rows: {listed}.")
    return as_arrays, next(iter(rows.values()))


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
        for member in sorted(_as_bytes(m) for m in members):
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


def row_limit(records: Iterable[Mapping[str, Any]], settings: Settings) -> int:
    """The smallest ``batching.max_batch_size`` among live worker records."""
    limits = []
    for record in records:
        batching = record.get("batching")
        size = batching.get("max_batch_size") if isinstance(batching, dict) else None
        if type(size) is int and size >= 1:
            limits.append(size)
    if not limits:
        raise NoWorkerInfo(
            f"No live worker of model {settings.model!r} has registered under prefix "
            f"{settings.prefix!r} (set {settings.workers_key}), so its row limit "
            "(batching.max_batch_size) is unknown. Start a worker first, or pass "
            "rows_per_request= to map()."
        )
    return min(limits)


# ---------------------------------------------------------------------------------------------
# Connections and their errors


def redact_url(url: str) -> str:
    """``url`` without its password (in the authority or a ``password=`` query value)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<a Redis URL that could not be parsed>"
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


@contextlib.contextmanager
def translate_redis_errors(where: str) -> Iterator[None]:
    """Turn redis-py errors raised in the block into ConnectionFailed naming ``where``.

    A plain context manager, so ``with`` works around ``await`` in the async shell too.
    """
    try:
        yield
    except REDIS_ERRORS as exc:
        if isinstance(exc, redis.exceptions.ResponseError):
            message = f"Redis at {where} rejected a command: {exc}"
        else:
            message = (
                f"Could not talk to Redis at {where}: {exc or type(exc).__name__}. Check that "
                "Redis is running there and that the URL, password and TLS settings are right."
            )
        raise ConnectionFailed(message) from exc
