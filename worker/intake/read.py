"""Reading: the thread that reads entries, admits them, and hands them to the batcher.

It runs on its own thread so that reading and admitting overlap with inference, and it blocks
on Redis (which wakes at once when data arrives) rather than polling. Its queue is bounded, so
the worker holds a few batches of entries at most whatever the backlog. Each read's cancel check
goes out with the hand-over, and the next read behind it on the same connection
(``worker.redisio.readahead``): one round trip a read. Between reads it asks the reclaimer for
entries other workers left behind, and hands each over alone.

``idle`` tells a burst worker that the stream is drained: a read came back empty and, with
``burst``, no entry is pending on another consumer either. Those are answered by their holder
or, once idle past ``claim_idle_ms`` (a worker that crashed), claimed here, so a burst worker
does not exit while a dead worker's entries wait in the group.

What a read brought is held no longer than its admission: admission drops the fields of what it
refuses (an entry with fields other than ``rid`` and ``body``, a body over the limit), and this
thread lets go of the read's entries before it reads again, so a flood of oversized entries costs
the worker one read's bytes at its peak, not one read's bytes for as long as it waits for the next.
After a read whose refused entries brought more than ``TRIM_AFTER_BYTES`` it reads one entry at
a time until a read brings rows again, and hands the freed memory back to the system
(``worker.intake.trim``).
"""

from __future__ import annotations

import logging
import threading

from worker.intake.admit import admit, poisoned
from worker.intake.layouts import Layouts
from worker.intake.leases import Leases
from worker.intake.reclaim import Reclaimer
from worker.intake.settings import IntakeSettings
from worker.intake.trim import TRIM_AFTER_BYTES, release_freed
from worker.items import Admitted, Item
from worker.redisio import cancels
from worker.redisio.cancels import CancelCheck
from worker.redisio.readahead import CheckThenRead
from worker.redisio.retry import OutageRetry
from worker.redisio.stream import RawEntry, RequestStream

__all__ = ["Reader"]

log = logging.getLogger(__name__)

_RECLAIM_WAIT_S = 0.1  # while redelivering: how long to wait for the entry in flight per turn


class Reader(threading.Thread):
    """Stream -> admit -> bounded queue (a list per read), until ``stop``."""

    def __init__(
        self,
        stream: RequestStream,
        leases: Leases,
        settings: IntakeSettings,
        reclaimer: Reclaimer | None = None,
        retired: threading.Event | None = None,
    ) -> None:
        super().__init__(name="redbatch-intake", daemon=True)
        self.stream = stream
        self.leases = leases
        self.settings = settings
        self.reclaimer = reclaimer
        self.out = settings.out
        self.stop = settings.stop
        self.events = settings.events
        # Entries per read, fitted to the requests' rows after each read (the first one, with
        # nothing to go by, takes max_batch_size)
        self.read_count = settings.read_count
        # Bodies are matched byte for byte only where inputs keep rows on axis 0 (model/axes.py)
        self.layouts = Layouts() if settings.schema.axes.trivial else None
        self.idle = threading.Event()  # set when the stream is drained (module docstring)
        self.failure: BaseException | None = None
        self._trims_owed = 0  # reads after which to hand freed memory back (trim.py)
        # Set when this reader's shard is retired: it stops reading, as on ``stop``.
        self.retired = retired or threading.Event()
        self._outage = OutageRetry(
            "reading requests",
            give_up=settings.stop,
            events=settings.events,
            on_retry=settings.on_retry,
        )

    def run(self) -> None:
        try:
            read_ahead: list[RawEntry] | None = None  # read behind the last cancel check
            while not self._stopping() or read_ahead:
                self._check_interrupted()
                if self._redeliver():  # read_ahead, if any, waits for the next turn
                    continue
                reclaiming = self.reclaimer is not None and self.reclaimer.busy
                block_ms = 0 if reclaiming else self.settings.block_ms
                entries = self._read(block_ms) if read_ahead is None else read_ahead
                read_ahead = None
                if self._trims_owed:
                    self._trims_owed -= 1
                    release_freed(self.stream.client)
                if not entries:
                    if reclaiming:  # wait for the redelivered entry rather than spin on Redis
                        self.leases.wait_redelivered_done(_RECLAIM_WAIT_S)
                    elif self._left_elsewhere():  # the next read blocks: no spin here either
                        self.idle.clear()
                    else:
                        self.idle.set()
                    continue
                self.idle.clear()
                self.events.point("after_read")
                check = CancelCheck()
                items = self._admit_read(entries, check)
                # Refused entries kept none of their fields, and this list must not hold them
                # either, through the next read (or the read ahead, which comes back during
                # the hand-over) while it blocks.
                del entries
                read_next = None if self._stopping() else (self.read_count, block_ms)
                read_ahead = self._hand_over(items, check, read_next)
                del items  # the batcher's now: hold none of it here while reading again
        except BaseException as exc:  # surfaced by the service, which stops the worker
            self.failure = exc
            log.exception("intake stopped on an unexpected error")
            self.stop.set()

    def _admit_read(self, entries: list[RawEntry], check: CancelCheck) -> list[Item]:
        """Admit a read, and fit the next read's count to it: after a read whose refused
        entries brought more than ``TRIM_AFTER_BYTES``, one entry at a time (more of them may
        follow) until a read brings rows, and the freed memory is handed back after the next
        two reads (once a large reply's parser buffer is freed too: ``trim.py``)."""
        items = [self._admit(e, check) for e in entries]
        sized = self._fit_read_count(items)
        if sized < len(items) and _refused_bytes(entries, items) > TRIM_AFTER_BYTES:
            self._trims_owed = 2
            self.read_count = 1
        return items

    def _stopping(self) -> bool:
        """Stopped, retired, or its lane's stream removed under it (``RequestStream.vanished``)."""
        return self.stop.is_set() or self.retired.is_set() or self.stream.vanished

    def _fit_read_count(self, items: list[Item]) -> int:
        """Read about one batch of rows at a time: ``max_batch_size`` entries of one row, fewer
        of several (from this read's mean), so that the worker holds a few batches of rows
        whatever the requests' size, and a drain at shutdown is as short as documented.
        Returns how many items bring rows (the others were refused)."""
        rows = sum(item.rows for item in items)
        if not rows:
            return 0
        sized = sum(1 for item in items if item.rows)
        most = self.settings.read_count
        self.read_count = max(1, min(most, most * sized // rows))
        return sized

    def _left_elsewhere(self) -> bool:
        """In burst mode, after an empty read: whether entries are still pending on other
        consumers (one ``XPENDING``); always False otherwise, or once stopping."""
        if not self.settings.burst or self.reclaimer is None or self.stop.is_set():
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
            found = None if self._stopping() else self._outage.call(reclaimer.next)
        except Exception:
            if self.stop.is_set():  # stopping during an outage: claim nothing more
                return False
            raise
        if found is None or found.claimed.entry is None:
            return False
        self.idle.clear()
        check = CancelCheck()
        item: Item
        if found.poisoned:
            item = poisoned(found, reclaimer.max_deliveries)
        else:
            item = self._admit(found.claimed.entry, check, found.deliveries)
        self._hand_over([item], check)
        return True

    def _admit(self, entry: RawEntry, check: CancelCheck, deliveries: int = 1) -> Item:
        s = self.settings
        return admit(
            entry,
            s.schema,
            s.max_request_bytes,
            deliveries,
            self.layouts,
            check,
            s.max_element_bytes,
        )

    def _hand_over(
        self, items: list[Item], check: CancelCheck, read_next: tuple[int, int] | None = None
    ) -> list[RawEntry] | None:
        """Ask for the read's cancel keys, hand the read over, then take the answer: the batch
        gathers, and may run, while it comes. With ``read_next`` (count, block_ms) the next read
        goes out behind the check, on its connection, and its entries are returned: one round
        trip a read instead of two. That read is sent only once the queue has taken this one
        (so what the worker holds stays bounded) and not after a stop, and its entries are held
        (their leases renewed) as soon as it comes back."""
        rids = [item.rid for item in items if type(item) is Admitted]
        if not rids:  # nothing that may run: no check to ask
            self.out.put(items)
            return None
        asking = cancels.ReadCheck(check, rids)
        ahead = CheckThenRead(self.stream, rids)  # the MGET on the wire during the put
        asking.sent(ahead.asked)
        try:
            # Entries already read are ours: hand every one over, even while stopping.
            self.out.put(items)
            if read_next is not None and not self._stopping():
                ahead.read_next(*read_next)
            asking.settle(ahead.cancelled(), self._cancelled)
        finally:
            asking.close()  # always answered, so that no batch waits for it for good
        entries = ahead.entries()
        if ahead.lost:  # a read may have gone out and its reply been lost: let reclaim look
            self._outage.interrupted = True
        if entries is not None:
            self.leases.hold(e.entry_id for e in entries)  # held at once, as _read holds its own
        return entries

    def _cancelled(self, rids: list[str]) -> set[str]:
        """The rids among ``rids`` whose cancel key exists, asked again through the outage's
        retries (a transient error is retried, another one raised)."""
        try:
            return self._outage.call(lambda: cancels.cancelled(self.stream, rids))
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


def _refused_bytes(entries: list[RawEntry], items: list[Item]) -> int:
    """The bytes of fields the read's refused entries brought (admission dropped them)."""
    return sum(
        sum(map(len, entry.fields.values()))
        for entry, item in zip(entries, items, strict=True)
        if type(item) is not Admitted
    )
