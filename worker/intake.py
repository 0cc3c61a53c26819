"""Intake: read entries from the stream, decode and validate each, hand them to the batcher.

It runs on its own thread so that reading, decoding and validating overlap with inference, and
it blocks on Redis (which wakes at once when data arrives) rather than polling. Its queue is
bounded, so the worker holds a few batches of entries at most whatever the backlog. Between
reads it asks the reclaimer for entries other workers left behind, and hands each over alone.

``idle`` tells a burst worker that the stream is drained: a read came back empty and, with
``burst``, no entry is pending on another consumer either. Those are answered by their holder
or, once idle past ``claim_idle_ms`` (a worker that crashed), claimed here, so a burst worker
does not exit while a dead worker's entries wait in the group.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from producer.codec import decode_request
from producer.errors import WireFormatError
from producer.keys import is_valid_rid
from worker import faults
from worker.cancels import CancelCheck
from worker.errors import Rejected
from worker.layouts import Layouts
from worker.leases import Leases
from worker.reclaim import Reclaimer, Redelivery
from worker.retry import Outage, is_transient
from worker.schema import Schema, ValidRequest
from worker.stream import CancelQuery, RawEntry, RequestStream

__all__ = ["Intake", "WorkItem", "admit"]

log = logging.getLogger(__name__)

_RECLAIM_WAIT_S = 0.1  # while redelivering: how long to wait for the entry in flight per turn


@dataclass(slots=True)
class WorkItem:
    """One entry on its way through the worker, with whatever is known about it so far."""

    entry: RawEntry
    rid: str | None = None
    request: ValidRequest | None = None
    rejection: Rejected | None = None
    dead_reason: str | None = None
    deadline_ms: int | None = None
    meta_raw: bytes | None = None
    reply_ttl_s: int | None = None
    decode_ms: float = 0.0
    deliveries: int = 1
    cancel: CancelCheck | None = None  # its read's cancel check, for requests that may run

    @property
    def alone(self) -> bool:
        """Redelivered entries run in a batch of their own: one may be what killed a worker."""
        return self.deliveries > 1

    @property
    def rows(self) -> int:
        """Rows this item adds to a batch: 0 unless it is valid and will run."""
        return self.request.rows if self.request is not None else 0


def admit(
    entry: RawEntry,
    schema: Schema,
    max_request_bytes: int,
    deliveries: int = 1,
    layouts: Layouts | None = None,
) -> WorkItem:
    """Turn a raw entry into a WorkItem: valid, rejected with a code, or bound for dead letters.
    With ``layouts``, a body laid out like one admitted before skips decoding."""
    started = time.perf_counter()
    item = WorkItem(entry, deliveries=deliveries)
    try:
        _admit(item, schema, max_request_bytes, layouts)
    except Rejected as exc:
        item.rejection = exc
    except Exception:  # a decoder bug must fail this request only, never stop the intake thread
        log.exception("unexpected error decoding entry %s", entry.entry_id.decode())
        item.request = None
        item.rejection = Rejected(
            "INTERNAL", "the worker could not decode this request (a worker bug; it is logged)."
        )
    item.decode_ms = (time.perf_counter() - started) * 1000.0
    return item


def poisoned(redelivery: Redelivery, max_deliveries: int) -> WorkItem:
    """A WorkItem for an entry delivered ``max_deliveries`` times: dead-letter it, never run it."""
    assert redelivery.claimed.entry is not None
    item = WorkItem(redelivery.claimed.entry, deliveries=redelivery.deliveries)
    item.rid = _rid(item)
    times = redelivery.deliveries - 1
    item.dead_reason = (
        f"delivered {times} times without an answer (max_deliveries {max_deliveries}); "
        f"last held by consumer {redelivery.previous_consumer!r}"
    )
    if item.rid is not None:
        item.rejection = Rejected(
            "POISONED",
            f"the request was delivered {times} times and each time its worker stopped before "
            f"answering (max_deliveries {max_deliveries}); it was moved to the dead-letter "
            "stream and was not run again.",
        )
    return item


def _rid(item: WorkItem) -> str | None:
    """The entry's rid, or None (with ``dead_reason`` set) when it cannot name a reply key."""
    raw_rid = item.entry.fields.get(b"rid")
    rid = raw_rid.decode("ascii", "replace") if raw_rid is not None else None
    if rid is not None and is_valid_rid(rid):
        return rid
    item.dead_reason = (
        "entry has no 'rid' field"
        if rid is None
        else f"rid {rid[:140]!r} does not match [A-Za-z0-9_.:-]{{1,128}}; no reply key is "
        "written for it"
    )
    return None


def _admit(item: WorkItem, schema: Schema, max_request_bytes: int, layouts: Layouts | None) -> None:
    fields = item.entry.fields
    rid = _rid(item)
    if rid is None:
        return
    item.rid = rid
    body = fields.get(b"body")
    if body is None:
        raise Rejected("MALFORMED", "the stream entry has no 'body' field.")
    known = layouts.match(body) if layouts is not None else None
    if known is not None:
        item.request, item.reply_ttl_s, item.deadline_ms = known
        return
    try:
        decoded = decode_request(body, max_request_bytes)
    except WireFormatError as exc:
        item.meta_raw, item.reply_ttl_s = exc.meta_raw, exc.reply_ttl_s
        raise Rejected(exc.code, exc.message) from exc
    item.deadline_ms = decoded.deadline_ms
    item.meta_raw = decoded.meta_raw
    item.reply_ttl_s = decoded.reply_ttl_s
    item.request = schema.validate(decoded)
    if layouts is not None:
        layouts.learn(body, decoded, item.request)


class Intake(threading.Thread):
    """The reading thread: stream -> admit -> bounded queue (a list per read), until ``stop``."""

    def __init__(
        self,
        stream: RequestStream,
        schema: Schema,
        max_request_bytes: int,
        out: queue.Queue[list[WorkItem]],
        stop: threading.Event,
        read_count: int,
        leases: Leases,
        reclaimer: Reclaimer | None = None,
        block_ms: int = 500,
        on_outage: Callable[[str], None] | None = None,
        burst: bool = False,
    ) -> None:
        super().__init__(name="redbatch-intake", daemon=True)
        self.stream = stream
        self.schema = schema
        self.max_request_bytes = max_request_bytes
        self.out = out
        self.stop = stop
        # Entries per read, fitted to the requests' rows after each read (the first one, with
        # nothing to go by, takes max_batch_size)
        self.read_count = read_count
        self.max_read_count = read_count
        self.leases = leases
        self.reclaimer = reclaimer
        self.block_ms = block_ms
        self.layouts = Layouts()
        self.burst = burst
        self.idle = threading.Event()  # set when the stream is drained (module docstring)
        self.failure: BaseException | None = None
        self._outage = Outage("reading requests", give_up=stop, on_down=on_outage)

    def run(self) -> None:
        try:
            read_ahead: list[RawEntry] | None = None  # read behind the last cancel check
            while not self.stop.is_set() or read_ahead:
                self._check_interrupted()
                if self._redeliver():  # read_ahead, if any, waits for the next turn
                    continue
                reclaiming = self.reclaimer is not None and self.reclaimer.busy
                block_ms = 0 if reclaiming else self.block_ms
                entries = self._read(block_ms) if read_ahead is None else read_ahead
                read_ahead = None
                if not entries:
                    if reclaiming:  # wait for the redelivered entry rather than spin on Redis
                        self.leases.wait_redelivered_done(_RECLAIM_WAIT_S)
                    elif self._left_elsewhere():  # the next read blocks: no spin here either
                        self.idle.clear()
                    else:
                        self.idle.set()
                    continue
                self.idle.clear()
                if faults.ACTIVE:
                    faults.hit("after_read")
                items = [self._admit(e) for e in entries]
                self._fit_read_count(items)
                read_next = None if self.stop.is_set() else (self.read_count, block_ms)
                read_ahead = self._hand_over(items, read_next)
        except BaseException as exc:  # surfaced by the service, which stops the worker
            self.failure = exc
            log.exception("intake stopped on an unexpected error")
            self.stop.set()

    def _fit_read_count(self, items: list[WorkItem]) -> None:
        """Read about one batch of rows at a time: ``max_batch_size`` entries of one row, fewer
        of several (from this read's mean), so that the worker holds a few batches of rows
        whatever the requests' size, and a drain at shutdown is as short as documented."""
        rows = sum(item.rows for item in items)
        if rows:
            sized = sum(1 for item in items if item.rows)
            self.read_count = max(1, min(self.max_read_count, self.max_read_count * sized // rows))

    def _left_elsewhere(self) -> bool:
        """In burst mode, after an empty read: whether entries are still pending on other
        consumers (one ``XPENDING``); always False otherwise, or once stopping."""
        if not self.burst or self.reclaimer is None or self.stop.is_set():
            return False
        try:
            return self._outage.call(self.reclaimer.left_elsewhere)
        except Exception:
            if self.stop.is_set():  # stopping during an outage: nothing more to wait for
                return False
            raise

    def _check_interrupted(self) -> None:
        """After a failed Redis call, entries may be pending here unheld: let reclaim look."""
        if self._outage.interrupted:
            self._outage.interrupted = False
            if self.reclaimer is not None:
                self.reclaimer.after_outage()

    def _redeliver(self) -> bool:
        """Claim and hand over one entry another worker left behind, when one is due."""
        if self.reclaimer is None:
            return False
        reclaimer = self.reclaimer
        try:
            found = None if self.stop.is_set() else self._outage.call(reclaimer.next)
        except Exception:
            if self.stop.is_set():  # stopping during an outage: claim nothing more
                return False
            raise
        if found is None or found.claimed.entry is None:
            return False
        self.idle.clear()
        if found.poisoned:
            item = poisoned(found, reclaimer.max_deliveries)
        else:
            item = self._admit(found.claimed.entry, found.deliveries)
        self._hand_over([item])
        return True

    def _admit(self, entry: RawEntry, deliveries: int = 1) -> WorkItem:
        return admit(entry, self.schema, self.max_request_bytes, deliveries, self.layouts)

    def _hand_over(
        self, items: list[WorkItem], read_next: tuple[int, int] | None = None
    ) -> list[RawEntry] | None:
        """Ask for the read's cancel keys, hand the read over, then take the answer: the batch
        gathers, and may run, while it comes (worker/cancels.py). With ``read_next`` (count,
        block_ms) the next read goes out behind the check, on its connection, and its entries
        are returned: one round trip a read instead of two. That read is sent only once the
        queue has taken this one (so what the worker holds stays bounded) and not after a stop,
        and its entries are held (their leases renewed) as soon as it comes back."""
        rids = [item.rid for item in items if item.request is not None and item.rid is not None]
        check = CancelCheck() if rids else None
        for item in items:
            if item.request is not None:
                item.cancel = check
        query = self._ask_cancelled(rids) if rids else None  # on the wire during the put
        cancelled: set[str] = set()
        try:
            # Entries already read are ours: hand every one over, even while stopping.
            self.out.put(items)
            if check is None:
                return None
            if self.stop.is_set():  # stopped while the put waited: read nothing more
                read_next = None
            if query is not None and read_next is not None:
                query = self._read_behind(query, read_next)
            answer = self._answer_of(query) if query is not None else None
            if answer is None:  # not sent, or lost: asked again, now after the hand-over
                query = None
                answer = self._cancelled(rids)
            cancelled = answer
        finally:
            if check is not None:  # always answered, so that no batch waits for it for good
                check.answer(cancelled, asked_before_hand_over=query is not None)
        return self._read_ahead(query, read_next)

    def _ask_cancelled(self, rids: list[str]) -> CancelQuery | None:
        """The check's MGET on the wire; None if it could not be sent (it is asked again)."""
        try:
            return self.stream.ask_cancelled(rids)
        except Exception:
            return None  # _cancelled asks again, through the outage's retries

    def _read_behind(self, query: CancelQuery, read_next: tuple[int, int]) -> CancelQuery | None:
        """Send the next read behind the check; None, with the check lost, if that failed."""
        try:
            query.read_behind(*read_next)
            return query
        except Exception:
            self._outage.interrupted = True  # a read may have gone out: let reclaim look
            return None  # _cancelled asks again; the loop reads as usual

    def _read_ahead(
        self, query: CancelQuery | None, read_next: tuple[int, int] | None
    ) -> list[RawEntry] | None:
        """The entries of the read sent behind the check; None when there is none to take
        (the loop then reads as usual)."""
        if query is None or read_next is None or not query.read_owed:
            return None
        try:
            entries = query.entries()
        except Exception as exc:
            if not is_transient(exc):
                raise
            self._outage.interrupted = True  # entries may have been delivered: let reclaim look
            return None
        self.leases.hold(e.entry_id for e in entries)  # held at once, as _read holds its own
        return entries

    def _answer_of(self, query: CancelQuery) -> set[str] | None:
        """The query's answer; None if it failed (the query is dropped, with the read behind
        it, and the caller asks again)."""
        try:
            return query.receive()
        except Exception:
            query.abandon()
            self._outage.interrupted = True  # a read may have gone out: let reclaim look
            return None

    def _cancelled(self, rids: list[str]) -> set[str]:
        """The rids among ``rids`` whose cancel key exists, asked again through the outage's
        retries (a transient error is retried, another one raised)."""
        try:
            return self._outage.call(lambda: self.stream.cancelled(rids))
        except Exception:
            if not self.stop.is_set():
                raise
            return set()  # stopping during an outage: run them rather than drop them

    def _read(self, block_ms: int) -> list[RawEntry]:
        """Read and hold new entries: held, reclaim never takes them for lost ones."""
        try:
            entries = self._outage.call(lambda: self.stream.read(self.read_count, block_ms))
        except Exception:
            if self.stop.is_set():
                return []
            raise
        self.leases.hold(e.entry_id for e in entries)
        return entries
