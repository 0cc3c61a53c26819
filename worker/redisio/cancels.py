"""Cancellation: every cancel step of the worker's path, behind a small API.

A request is cancelled when its cancel key exists. The keys are asked for in two places:

- **At read time** (``ReadCheck``, on the reading thread): one ``MGET`` of a read's cancel
  keys, sent before the read is handed over to the batcher, the stream's next ``XREADGROUP``
  sent behind it on the same connection (``worker.redisio.readahead``), and the answer taken
  after the hand-over. So the batch never
  waits for that round trip, and a read costs one round trip, not two. The MGET reaches Redis
  one network delay after it is sent, so the keys it sees existed when the batch was formed,
  as the contract has it, give or take that delay. Only when that round trip fails is it
  asked again after the hand-over; that answer cannot tell whether a key was set before or
  after a batch already started, so it only keeps requests out of runs not yet started: a
  cancel may then be missed.
- **As a run starts** (``RunCheck``, on the main thread): a read may wait in the worker behind
  a few batches (or a long ``max_wait_ms``) before its batch forms, so the requests of a run
  whose check was asked more than ``RECHECK_AFTER_S`` before are asked again: one MGET sent as
  the run starts and read after it, so the run never waits on it.

Each admitted request carries its read's ``CancelCheck``. A request whose answer is in and says
cancelled before its run is left out (``already``); one whose answer came later, or that the
second check found, ran for nothing and is answered ``CANCELLED`` after the run
(``RunCheck.cancelled``): a rare cancel costs some compute, a wrong one would lose an answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import redis

from producer.redisio import resp
from worker.errors import Rejected
from worker.redisio.stream import RequestStream

__all__ = [
    "RECHECK_AFTER_S",
    "CancelCheck",
    "CancelQuery",
    "ReadCheck",
    "RunCheck",
    "already",
    "ask",
    "cancelled",
    "cancelled_error",
]

log = logging.getLogger(__name__)

#: A check older than this when its batch forms is asked again. Not less: the second round trip
#: cannot hide behind a very short run, and asked for every batch it cost throughput; a cancel
#: set less than this before its batch forms may be missed, and callers cancel requests that
#: waited far longer (docs/design.md has the measurements).
RECHECK_AFTER_S = 0.02


def cancelled_error() -> Rejected:
    """The reply's error for a request whose cancel key existed."""
    return Rejected("CANCELLED", "the request was cancelled (its cancel key was set).")


class Checked(Protocol):
    """An admitted request, as the cancel steps see it: its rid and its read's check."""

    @property
    def rid(self) -> str: ...

    @property
    def cancel(self) -> CancelCheck: ...

    @property
    def shard(self) -> str: ...


class CancelCheck:
    """One read's cancel check: answered once by the reading thread, read by the main thread."""

    def __init__(self) -> None:
        self.asked_at = time.monotonic()  # reset when the check is sent (ReadCheck)
        self._answered = threading.Event()
        self._cancelled: frozenset[str] = frozenset()
        self._binds_runs = True

    def answer(self, cancelled: Iterable[str], *, asked_before_hand_over: bool = True) -> None:
        """The rids whose cancel key existed; only the first answer counts. An answer asked
        for after the hand-over (the first MGET failed, and was asked again) may postdate a
        batch that already started: it only keeps requests out of runs not yet started."""
        if not self._answered.is_set():
            self._cancelled = frozenset(cancelled)
            self._binds_runs = asked_before_hand_over
            self._answered.set()

    @property
    def answered(self) -> bool:
        return self._answered.is_set()

    def known(self, rid: str) -> bool:
        """True when the answer is in and says ``rid`` was cancelled; never waits."""
        return self._answered.is_set() and rid in self._cancelled

    def confirmed(self, rid: str) -> bool:
        """After a run: whether ``rid``, which ran, is to be answered CANCELLED. Waits for the
        answer if it is not in yet (the reading thread always answers, with nothing cancelled
        if it fails or stops during an outage); False for an answer asked for after the
        hand-over."""
        self._answered.wait()
        return self._binds_runs and rid in self._cancelled


def already(item: Checked) -> Rejected | None:
    """CANCELLED when the item's check has answered that it was; never waits."""
    return cancelled_error() if item.cancel.known(item.rid) else None


# -- the MGET on the wire --------------------------------------------------------------------


class CancelQuery:
    """A cancel check on the wire: its MGET sent, its answer not yet read."""

    def __init__(
        self, stream: RequestStream, rids: Sequence[str], in_flight: resp.InFlight
    ) -> None:
        self.stream = stream
        self.rids = rids
        self.connection = in_flight  # the stream may send its next read behind the check

    def receive(self) -> set[str]:
        """The request ids whose cancel key existed."""
        [values] = resp.raise_first_error(self.connection.receive(1))
        return {rid for rid, value in zip(self.rids, values, strict=True) if value is not None}

    def abandon(self) -> None:
        """Drop the connection with whatever it still owes."""
        self.connection.abandon()


def ask(stream: RequestStream, rids: Sequence[str]) -> CancelQuery:
    """Send the MGET of ``rids``' cancel keys now; the answer is read from the query later."""
    return CancelQuery(stream, rids, stream.send_cancel_keys(rids))


def cancelled(stream: RequestStream, rids: Sequence[str]) -> set[str]:
    """The rids among ``rids`` whose cancel key exists: one MGET, waited for."""
    return ask(stream, rids).receive() if rids else set()


# -- at read time ----------------------------------------------------------------------------


class ReadCheck:
    """One read's check on the reading thread: asked before the hand-over, answered after it.

    The MGET goes out with the stream's next read behind it (``worker.redisio.readahead``); this
    only turns its answer into the check's, asking again when it was lost.
    """

    def __init__(self, check: CancelCheck, rids: list[str]) -> None:
        self.check = check
        self.rids = rids
        self._cancelled: set[str] = set()
        self._before_hand_over = False
        check.asked_at = time.monotonic()

    def sent(self, asked: bool) -> None:
        """Whether the MGET went out before the hand-over: if the hand-over then fails, the
        check is still answered as asked before it (``close``)."""
        self._before_hand_over = asked

    def settle(self, answer: set[str] | None, ask_again: Callable[[list[str]], set[str]]) -> None:
        """Take the answer of the MGET sent before the hand-over; when it was not sent or its
        answer was lost (None), ``ask_again(rids)`` asks after the hand-over."""
        self._before_hand_over = answer is not None
        self._cancelled = ask_again(self.rids) if answer is None else answer

    def close(self) -> None:
        """Answer the check, with nothing cancelled unless ``settle`` got an answer: always
        called, so that no batch waits for it for good."""
        self.check.answer(self._cancelled, asked_before_hand_over=self._before_hand_over)


# -- around a run ----------------------------------------------------------------------------


class RunCheck:
    """The cancel steps of one run: the second check, sent as the run starts for the requests
    whose first check is stale and read after it, then the verdict on each request that ran.
    A failed second check reads as nothing cancelled (the first check still counts)."""

    def __init__(self, stream_of: Callable[[str], RequestStream], items: Sequence[Checked]) -> None:
        oldest = time.monotonic() - RECHECK_AFTER_S
        stale: dict[str, list[str]] = {}  # per shard: a run may mix shards' requests
        for item in items:
            if item.cancel.asked_at < oldest:
                stale.setdefault(item.shard, []).append(item.rid)
        self._queries: list[CancelQuery] = []
        self._rechecked: set[tuple[str, str]] = set()
        for shard, rids in stale.items():
            try:
                self._queries.append(ask(stream_of(shard), rids))
            except redis.RedisError as exc:
                log.debug("cancel recheck not sent: %s", exc)

    def run_ended(self) -> None:
        """Read the second check's answers (also when the run raised, which would otherwise
        leave their connections out of the pool)."""
        queries, self._queries = self._queries, []
        for query in queries:
            try:
                shard = query.stream.tag
                self._rechecked.update((shard, rid) for rid in query.receive())
            except redis.RedisError as exc:
                log.debug("cancel recheck lost: %s", exc)

    def cancelled(self, item: Checked) -> bool:
        """After the run: whether ``item``, which ran, is answered CANCELLED (waits for its
        first check's answer if it is not in yet)."""
        return (item.shard, item.rid) in self._rechecked or item.cancel.confirmed(item.rid)
