"""Waiting for replies and map()'s window: the client's two state machines, with no I/O.

``core`` says what a request and a reply are; this module says what to do with many of them at
once. The plans (``producer.client.plans``) drive both for either shell: they ask for the Redis
commands these objects need and feed the answers back, so the logic exists once and can be tested
without Redis.

- ``ReplyWaiter``: the replies still awaited, their shards and deadlines, which shard to block
  on and how long.
- ``MapPlan``: map()'s window: which rows to send next and which chunks may be yielded in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from producer.client.core import (
    Chunk,
    Result,
    Settings,
    Submission,
    as_bytes,
    build_submission,
    check_timeout_s,
    failed_result,
    handle_of,
    parse_reply_or_fail,
)
from producer.client.maprows import RowFeed
from producer.protocol.errors import RedisFull, WaitTimeout
from producer.redisio.connection import block_s

#: The client-side code of a request whose reply did not come in time (map() and ``redbatch
#: run``); its request is cancelled, so a worker that has not formed its batch yet skips it.
WAIT_TIMEOUT = "WAIT_TIMEOUT"
#: The longest BLPOP on one shard while replies are awaited on others too (a BLPOP watches one
#: slot): one shard's turn. Redis's own timeout floor (100 ms at ``hz 10``) is about this.
SHARD_TURN_S = 0.1

__all__ = ["SHARD_TURN_S", "WAIT_TIMEOUT", "MapPlan", "ReplyWaiter"]

#: A request as the client addresses it: (shard tag, rid).
Target = tuple[str, str]


# ---------------------------------------------------------------------------------------------
# Waiting for replies


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
    cancel. A reply that cannot be decoded is a failed Result (code INTERNAL), never an
    exception that would lose its neighbours.
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

    def add(self, rid: str, now: float, tag: str | None = None) -> None:
        """Await the reply of ``rid``, sent to shard ``tag`` (None: the model's first), until
        ``now + timeout_s``; ValueError for a bad rid. ``now`` may be earlier than the present:
        ``infer`` counts its wait from before its submit."""
        tag = tag or self._settings.model
        key = self._settings.reply_key(rid, tag).encode()
        self._pending.setdefault(key, (rid, now + self.timeout_s, tag))

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
            return self._late(now)
        key, raw = item
        return [self._take(as_bytes(key), raw)]

    def _take(self, key: bytes, raw: bytes | str) -> Result:
        rid, _, tag = self._pending.pop(key)
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


# ---------------------------------------------------------------------------------------------
# map()


class MapPlan:
    """map()'s state: rows to send next, requests in flight, and chunks ready in input order.

    At most ``concurrency`` requests are in flight, and at most ``2 * concurrency`` are held
    between being sent and being yielded, so a slow first request cannot make the plan buffer
    the whole input. ``plans.run_map`` loops: ``take()`` and send, ``sent()``, yield
    ``ready()``, then wait on ``waiter`` and hand its Results to ``answered()``, until
    ``finished``.

    The inputs are a ``maprows.RowFeed`` (arrays, iterators of rows, ``Blocks``), read only as
    requests are sent, so an iterator over an input larger than memory is read a window at a
    time. Each request's rows are kept until it is answered (views, for arrays), to send it
    again after an interruption.

    With ``stop_on_timeout``, the first late reply stops the sending: the requests already in
    flight are still awaited and yielded, and then the plan is finished with the rows after
    them never sent (a job whose workers are gone ends after one timeout, not one per window).
    A send refused because Redis is full (``refused``) stops it the same way, whatever
    ``stop_on_timeout`` says, and ``run_map`` raises the refusal once the plan is finished.
    """

    def __init__(
        self,
        settings: Settings,
        arrays: Mapping[str, Any],
        *,
        rows_per_request: int | None,
        concurrency: int,
        outputs: Sequence[str] | None,
        timeout_s: float,
        stop_on_timeout: bool = False,
    ) -> None:
        if type(concurrency) is not int or concurrency < 1:
            raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}.")
        self._feed = RowFeed(arrays)
        #: The row count when known in advance (an input is an array), else None.
        self.rows = self._feed.rows
        self._concurrency = concurrency
        self._outputs = outputs
        self._rows_per_request = 0
        self._next_start = 0
        self._in_flight: dict[str, tuple[int, int]] = {}  # rid -> (start, stop), in send order
        self._tags: dict[str, str] = {}  # rid -> the shard it was sent to, until answered
        self._rows_of: dict[str, dict[str, np.ndarray]] = {}  # rid -> its rows, until answered
        self._sent_at: dict[str, float] = {}  # rid -> monotonic send time
        self._answered: dict[int, Chunk] = {}  # start -> chunk
        self._next_yield = 0  # start of the next chunk to yield
        self._held = 0  # requests sent and not yet yielded
        self._stop_on_timeout = stop_on_timeout
        self.stopped = False  # a reply came late under stop_on_timeout: nothing more is sent
        self.refusal: RedisFull | None = None  # Redis was full: nothing more is sent
        self.waiter = ReplyWaiter(settings, timeout_s, late_fails=True)
        if rows_per_request is not None:
            self.use_row_limit(rows_per_request)

    @property
    def rows_per_request(self) -> int | None:
        """The row limit in use (None until ``use_row_limit``)."""
        return self._rows_per_request or None

    @property
    def has_rows(self) -> bool:
        """True when there are rows to send (an iterator is read ahead by one row to know)."""
        return self._next_start > 0 or self._feed.has_rows()

    @property
    def needs_row_limit(self) -> bool:
        """True when the caller gave no rows_per_request and there are rows to send."""
        return self._rows_per_request == 0 and self.has_rows

    def use_row_limit(self, rows_per_request: int) -> None:
        """Send at most ``rows_per_request`` rows per request."""
        if type(rows_per_request) is not int or rows_per_request < 1:
            raise ValueError(
                f"rows_per_request must be a positive integer, got {rows_per_request!r}."
            )
        self._rows_per_request = rows_per_request

    @property
    def in_flight(self) -> list[Target]:
        """The requests taken and not yet answered, as (tag, rid), to cancel when the caller
        stops early (one not sent yet names the model's first shard: nothing is there)."""
        model, tags = self.waiter.model, self._tags
        return [(tags.get(rid, model), rid) for rid in self._in_flight]

    @property
    def finished(self) -> bool:
        """True once every row has been yielded (at once for zero rows), or once a stopped
        plan has yielded every request it sent."""
        if self.stopped:  # a refusal may leave a hole: the chunks past it are never yielded
            return not self._in_flight and self._next_yield not in self._answered
        return self._feed.exhausted and self._next_yield >= self._next_start

    def take(self, now_s: float) -> list[Submission]:
        """The requests to send now to fill the window; ``now_s`` is the Unix time."""
        if self.needs_row_limit:
            raise RuntimeError("MapPlan.use_row_limit() must be called before take().")
        if self.stopped:
            return []
        room = min(self._concurrency - len(self._in_flight), 2 * self._concurrency - self._held)
        subs = []
        while room > 0 and (inputs := self._feed.take(self._rows_per_request)) is not None:
            start = self._next_start
            stop = start + len(next(iter(inputs.values())))
            sub = build_submission(inputs, outputs=self._outputs, now_s=now_s)
            self._in_flight[sub.rid] = (start, stop)
            self._rows_of[sub.rid] = inputs
            self._next_start = stop
            self._held += 1
            subs.append(sub)
            room -= 1
        return subs

    def sent(self, subs: Iterable[Submission], now: float) -> None:
        """Start the reply clock of requests that reached the stream (``now`` is monotonic)."""
        for sub in subs:
            self.waiter.add(sub.rid, now, sub.tag)
            self._sent_at[sub.rid] = now

    def routed(self, subs: Iterable[Submission]) -> None:
        """Note the shard each of ``subs`` went to (or was meant for, when the send failed),
        so that cancelling it sets the cancel key there."""
        for sub in subs:
            if sub.tag and sub.rid in self._in_flight:
                self._tags[sub.rid] = sub.tag

    def refused(self, subs: Sequence[Submission], refusal: RedisFull) -> None:
        """Take back ``subs``, of the last ones taken, which Redis was too full to accept, and
        stop sending; the requests already in flight are still awaited. With shards, a shard
        that had room may have taken others of the same send: chunks past the first one taken
        back are then answered but never yielded (the iteration ends at that hole)."""
        for sub in subs:
            start, _ = self._in_flight.pop(sub.rid)
            del self._rows_of[sub.rid]
            self._tags.pop(sub.rid, None)
            self._next_start = min(self._next_start, start)
            self._held -= 1
        self.stopped = True
        self.refusal = refusal

    def answered(self, results: Iterable[Result], now: float) -> None:
        """Record replies that arrived by ``now`` (monotonic); failed ones keep ``error``."""
        for result in results:
            start, stop = self._in_flight.pop(result.rid)
            del self._rows_of[result.rid]
            self._tags.pop(result.rid, None)
            latency_ms = (now - self._sent_at.pop(result.rid)) * 1000
            late = result.error is not None and result.error.code == WAIT_TIMEOUT
            self.stopped = self.stopped or (late and self._stop_on_timeout)
            self._answered[start] = Chunk(
                start, stop, result.rid, result.outputs, result.error, result, latency_ms
            )

    def awaited(self, now_s: float) -> list[Submission]:
        """The requests whose reply is still awaited (not answered, not given up on), built
        again from their rows (bodies are not kept: up to ``concurrency`` of them could be
        large) with the same rids and shards, to send again after an interruption."""
        again = []
        for tag, rid in self.waiter.targets():
            sub = build_submission(self._rows_of[rid], outputs=self._outputs, rid=rid, now_s=now_s)
            sub.tag = tag
            again.append(sub)
        return again

    def ready(self) -> list[Chunk]:
        """The answered chunks that come next in input order, removed from the plan."""
        chunks = []
        while (chunk := self._answered.pop(self._next_yield, None)) is not None:
            chunks.append(chunk)
            self._next_yield = chunk.stop
            self._held -= 1
        return chunks
