"""Cancel checks whose answer may come while the batch runs.

Intake sends one ``MGET`` of a read's cancel keys and hands the read over at once, instead of
waiting for the answer first: that round trip (about 0.35 ms on a busy 2-core machine) sat
between every read and its batch. The main thread leaves out of the run the requests whose
answer is in and says cancelled, and answers ``CANCELLED`` after the run those whose answer came
later: they ran for nothing, which costs a rare cancel some compute. The MGET is sent before
the hand-over and Redis runs it one network delay later, so the keys it sees existed when the
batch was formed, as the contract has it, give or take that delay (a key set within it may
still count). Only when that round trip fails is it asked again after the hand-over; that
answer cannot tell whether a key was set before or after a batch already started, so it only
keeps requests out of runs not yet started: a cancel may then be missed. With a
backlog, where cancels matter (callers give up on requests that wait long), reads wait in the
queue and their answers are in before their batch starts.

That answer is as of the read, though, and a read may wait in the worker behind a few batches
(or a long ``max_wait_ms``) before its batch forms. So a batch whose requests were checked more
than ``RECHECK_AFTER_S`` before it formed asks again (``Recheck``): one MGET sent on the main
thread as the run starts and read after it, so the run never waits on it; a request it finds
cancelled ran for nothing and is answered ``CANCELLED``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence

import redis

from worker.errors import Rejected
from worker.stream import CancelQuery, RequestStream

__all__ = ["RECHECK_AFTER_S", "CancelCheck", "Recheck", "cancelled_error"]

log = logging.getLogger("worker.cancels")

#: A check older than this when its batch forms is asked again. Not less: on the tiny model with
#: 64 callers every batch's check is 1 to 3 ms old, and at 2 ms the second round trip, which a
#: 0.1 ms run cannot hide, cost a fifth of the throughput (three A/B pairs: 13,576, 15,048,
#: 11,936 against 18,928, 16,744, 15,560 requests/s); at 20 ms none (13,240, 12,864, 11,112
#: against 10,904, 13,008, 11,496). A cancel set less than this before its batch forms may be
#: missed; callers cancel requests that waited far longer.
RECHECK_AFTER_S = 0.02


def cancelled_error() -> Rejected:
    """The reply's error for a request whose cancel key existed."""
    return Rejected("CANCELLED", "the request was cancelled (its cancel key was set).")


class CancelCheck:
    """One read's cancel check: answered once by intake, read by the main thread."""

    def __init__(self) -> None:
        self.asked_at = time.monotonic()
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
        answer if it is not in yet (intake always answers, with nothing cancelled if it fails
        or stops during an outage); False for an answer asked for after the hand-over."""
        self._answered.wait()
        return self._binds_runs and rid in self._cancelled


class Recheck:
    """A second cancel check for the requests of one run whose first check is stale: sent as
    the run starts, read after it. Any failure reads as nothing cancelled (the first check
    still counts): a missed cancel costs compute, a wrong one would lose an answer."""

    def __init__(self, stream: RequestStream, rids: Sequence[str]) -> None:
        self._query: CancelQuery | None = None
        if rids:
            try:
                self._query = stream.ask_cancelled(rids)
            except redis.RedisError as exc:
                log.debug("cancel recheck not sent: %s", exc)

    @classmethod
    def stale(cls, stream: RequestStream, checks: Iterable[tuple[str, CancelCheck]]) -> Recheck:
        """Ask again for the rids whose check was asked more than RECHECK_AFTER_S ago."""
        oldest = time.monotonic() - RECHECK_AFTER_S
        return cls(stream, [rid for rid, check in checks if check.asked_at < oldest])

    def cancelled(self) -> frozenset[str]:
        """The rids found cancelled; reads the answer once (after the run)."""
        query, self._query = self._query, None
        if query is None:
            return frozenset()
        try:
            return frozenset(query.receive())
        except redis.RedisError as exc:
            log.debug("cancel recheck lost: %s", exc)
            return frozenset()
