"""map()'s window, with no I/O: which rows to send next, which requests are in flight, and
which chunks may be yielded, in input order."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from producer.client.lanes import LaneChoice
from producer.client.limits import BodyLimit
from producer.client.maprows import RowFeed
from producer.client.results import WAIT_TIMEOUT, Chunk, Result, failed_result
from producer.client.settings import Settings
from producer.client.submission import Submission, build_submission
from producer.client.waiting import ReplyWaiter, Target
from producer.protocol.errors import RedisFull

__all__ = ["MapPlan"]


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

    With a body limit (``use_body_limit``: Redis's bulk limit and the workers'
    ``max_request_bytes``), a request whose body would be over it is split in halves until each
    part fits, and later requests take no more rows than fitted; a single row over it is never
    sent: its chunk fails with TOO_LARGE, and the others carry on.
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
        lane: LaneChoice | None = None,
    ) -> None:
        if type(concurrency) is not int or concurrency < 1:
            raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}.")
        self._feed = RowFeed(arrays)
        #: The row count when known in advance (an input is an array), else None.
        self.rows = self._feed.rows
        self._concurrency = concurrency
        self._outputs = outputs
        self._lane = lane  # every request's (None: the default lane)
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
        self._limit: BodyLimit | None = None
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

    def use_body_limit(self, limit: BodyLimit) -> None:
        """Keep each request's body within ``limit.max_bytes`` (read at each take)."""
        self._limit = limit

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
            for rows, sub in self._fitted(inputs, now_s):
                start = self._next_start
                stop = start + len(next(iter(rows.values())))
                self._next_start = stop
                self._held += 1
                room -= 1
                if isinstance(sub, Result):  # one row over the body limit: never sent
                    self._answered[start] = Chunk(start, stop, sub.rid, None, sub.error, sub, 0.0)
                    continue
                self._in_flight[sub.rid] = (start, stop)
                self._rows_of[sub.rid] = rows
                subs.append(sub)
        return subs

    def _fitted(
        self, inputs: dict[str, np.ndarray], now_s: float
    ) -> list[tuple[dict[str, np.ndarray], Submission | Result]]:
        """``inputs`` as one request, or as several whose bodies each fit the body limit (in
        row order), each with its rows; a row alone over the limit is a failed Result."""
        sub = build_submission(inputs, outputs=self._outputs, now_s=now_s, lane=self._lane)
        if self._limit is None or len(sub.body) <= self._limit.max_bytes:
            return [(inputs, sub)]
        rows = len(next(iter(inputs.values())))
        if rows == 1:
            message = self._limit.message(len(sub.body))
            model = self.waiter.model
            return [(inputs, failed_result(sub.rid, model, "TOO_LARGE", message, False))]
        half = rows // 2
        self._rows_per_request = min(self._rows_per_request, half)  # later takes fit at once
        first = {name: array[:half] for name, array in inputs.items()}
        second = {name: array[half:] for name, array in inputs.items()}
        return self._fitted(first, now_s) + self._fitted(second, now_s)

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
            sub = build_submission(
                self._rows_of[rid], outputs=self._outputs, rid=rid, now_s=now_s, lane=self._lane
            )
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
