"""Reclaim: take over entries that a crashed or stuck worker left pending, one at a time.

A worker first takes the entries pending on its own name (a restart under a stable ``--name``),
then, on a jittered timer of about ``claim_idle_ms / 2``, entries idle longer than
``claim_idle_ms`` on any other consumer. Redelivered entries are claimed one at a time and each
runs in a batch of its own: claiming one only after the previous one is answered means that a
request which kills its worker raises no other request's delivery count, so healthy requests
never reach ``max_deliveries`` because they shared a batch with a poison pill.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from worker.events import NO_EVENTS, Events
from worker.intake.leases import Leases
from worker.redisio.claims import Claimed, Claims

__all__ = ["Reclaimer", "Redelivery"]

log = logging.getLogger(__name__)

_SCAN = 16  # pending entries looked at per claim attempt


@dataclass(frozen=True, slots=True)
class Redelivery:
    """A claimed entry and what its history says should happen to it."""

    claimed: Claimed
    deliveries: int  # including this one
    poisoned: bool  # delivered max_deliveries times already: dead-letter it, do not run it
    previous_consumer: str


class Reclaimer:
    """Decides when to claim and claims the next redelivered entry; used by the reading thread."""

    def __init__(
        self,
        claims: Claims,
        leases: Leases,
        claim_idle_ms: int,
        max_deliveries: int,
        events: Events = NO_EVENTS,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.claims = claims
        self.leases = leases
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self.events = events
        self.clock = clock
        self._rng = rng or random.Random()
        self._own = True  # look at this consumer's own pending entries first
        self._busy = True  # more candidates may be waiting: claim again as soon as one is done
        self._announced: set[str] = set()  # consumers this round of claims has logged
        self._next_at = 0.0
        self._others_after = 0.0  # no scan of other consumers' entries before this time

    @property
    def busy(self) -> bool:
        """True while claimed work is in flight or more candidates may remain."""
        return self._busy or self.leases.holds_redelivered()

    def left_elsewhere(self) -> bool:
        """True while entries are pending that this worker does not hold: other consumers'
        (answered by their holder, or claimed here once idle past ``claim_idle_ms``) or its own
        left pending by a finish step (reclaimed here). A burst worker waits for them before it
        calls the stream drained."""
        return self.claims.pending_unheld(len(self.leases)) > 0

    def after_outage(self) -> None:
        """A Redis call failed: look at this consumer's own entries at once, others' later.

        A read or claim whose reply was lost leaves entries pending on this consumer that it
        does not hold: adopt them now rather than after ``claim_idle_ms``. Other consumers'
        entries look idle after an outage only because their keepers could not renew either,
        so give those keepers ``claim_idle_ms`` to catch up first.
        """
        self._own = True
        self._busy = True
        self._announced.clear()  # a new round: say again whose entries it takes over
        self._others_after = self.clock() + self.claim_idle_ms / 1000.0

    def next(self) -> Redelivery | None:
        """The next entry to redeliver, when it is time to claim one; None otherwise."""
        if self.leases.holds_redelivered():
            return None
        if not self._busy and self.clock() < self._next_at:
            return None
        while True:
            found = self._claim_one()
            if found is not None:
                self._busy = True
                return found
            if not self._own:
                break
            self._own = False  # own entries done: now the other consumers' idle ones
            if self.clock() < self._others_after:
                break
        self._busy = False
        self._announced.clear()  # a later round of claims from the same consumer says so again
        self._next_at = max(self.clock() + self._interval_s(), self._others_after)
        return None

    def _interval_s(self) -> float:
        """About half of claim_idle_ms, jittered so that workers do not scan in step."""
        return self.claim_idle_ms / 2000.0 * self._rng.uniform(0.75, 1.25)

    def _claim_one(self) -> Redelivery | None:
        for pending in self.claims.idle(self.claim_idle_ms, _SCAN, own=self._own):
            if pending.entry_id in self.leases:
                continue
            min_idle = 0 if self._own else self.claim_idle_ms
            for claimed in self.claims.claim([pending.entry_id], min_idle, own=self._own):
                if claimed.entry is None:
                    self._note("deleted")
                    log.warning(
                        "entry %s was deleted while pending on %s; dropped from the group "
                        "(its request id is unknown, so no reply can be written)",
                        claimed.entry_id.decode(),
                        pending.consumer,
                    )
                    continue
                poisoned = claimed.deliveries_before >= self.max_deliveries
                self.leases.hold([claimed.entry_id], redelivered=True)
                self._note("poisoned" if poisoned else "own" if self._own else "reclaimed")
                self._announce(pending.consumer)
                return Redelivery(
                    claimed, claimed.deliveries_before + 1, poisoned, pending.consumer
                )
        return None

    def _announce(self, consumer: str) -> None:
        """One log line per consumer whose entries a round of claims takes over."""
        if consumer in self._announced:
            return
        self._announced.add(consumer)
        if self._own or consumer == self.claims.consumer:
            log.info(
                "adopting entries pending on this worker's name that it does not hold (left by "
                "its previous run, or by a read whose answer was lost); each runs alone"
            )
            return
        log.info(
            "redelivering entries of consumer %r, idle for over %d ms (its worker stopped or "
            "hung); each runs in a batch of its own",
            consumer,
            self.claim_idle_ms,
        )

    def _note(self, kind: str) -> None:
        self.events.claimed(kind)
