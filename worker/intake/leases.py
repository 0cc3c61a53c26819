"""Leases: the entries this worker holds, kept from being claimed while it works on them.

An entry's idle time starts when it is read, so a batch that waits in the window or runs longer
than ``claim_idle_ms`` would be claimed by another worker and run twice. The keeper renews every
held entry every ``claim_idle_ms / 3`` from its own thread; ``session.run`` releases the GIL, so
a long run does not delay it. The same thread removes consumers left behind by crashed workers.

A batch that hangs must not hold its entries for good: the answerer marks each run on a shared
``Stuck`` flag, and past ``delivery.max_run_s`` the keepers read it set and let the leases lapse.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterable

from worker.events import NO_EVENTS, Events
from worker.redisio.claims import Claims
from worker.redisio.retry import is_transient

__all__ = ["LeaseKeeper", "Leases", "Stuck"]

log = logging.getLogger(__name__)

_MIN_RENEW_S = 0.01
_MIN_FORGET_IDLE_MS = 1000


class Leases:
    """The set of entry ids held, from read or claim until finished; thread-safe."""

    def __init__(self) -> None:
        self._held: dict[bytes, bool] = {}  # id -> redelivered
        self._redelivered = 0  # how many of the held are redelivered, so checks cost O(1)
        self._changed = threading.Condition()

    def hold(self, entry_ids: Iterable[bytes], redelivered: bool = False) -> None:
        with self._changed:
            for entry_id in entry_ids:
                self._redelivered += redelivered - self._held.get(entry_id, False)
                self._held[entry_id] = redelivered

    def release(self, entry_ids: Iterable[bytes]) -> None:
        with self._changed:
            for entry_id in entry_ids:
                self._redelivered -= self._held.pop(entry_id, False)
            self._changed.notify_all()

    def ids(self) -> list[bytes]:
        with self._changed:
            return list(self._held)

    def __contains__(self, entry_id: object) -> bool:
        with self._changed:
            return entry_id in self._held

    def __len__(self) -> int:
        with self._changed:
            return len(self._held)

    def holds_redelivered(self) -> bool:
        """True while a redelivered entry is being worked on."""
        with self._changed:
            return self._redelivered > 0

    def wait_redelivered_done(self, timeout_s: float) -> bool:
        """Block until no redelivered entry is held (or the timeout); True when none is."""
        with self._changed:
            return self._changed.wait_for(lambda: self._redelivered == 0, timeout_s)


class Stuck:
    """Set while the run in progress has run longer than ``max_run_s`` (0: never set), like a
    ``threading.Event`` that sets itself: the answerer marks each run's start and end, the lease
    keepers and ``/healthz`` ask ``is_set()``."""

    def __init__(self, max_run_s: float = 0.0) -> None:
        self.max_run_s = max_run_s
        self._since: float | None = None  # monotonic start of the run in progress

    def run_started(self) -> None:
        self._since = time.monotonic()

    def run_ended(self) -> None:
        self._since = None

    def is_set(self) -> bool:
        since = self._since
        return (
            bool(self.max_run_s) and since is not None and time.monotonic() - since > self.max_run_s
        )


class LeaseKeeper(threading.Thread):
    """Renews held entries and forgets idle, empty consumers until ``close()``.

    A failure no retry can fix sets ``stop``. While ``stuck`` is set a batch has hung: its
    leases then lapse. An outage is logged once when the keeper cannot reach Redis, and once
    when a call of its own reached Redis again (a turn with nothing held sends none).
    """

    def __init__(
        self,
        claims: Claims,
        leases: Leases,
        claim_idle_ms: int,
        stuck: Stuck,
        events: Events = NO_EVENTS,
        stop: threading.Event | None = None,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(name="redbatch-leases", daemon=True)
        self.claims = claims
        self.leases = leases
        self.renew_s = max(claim_idle_ms / 3000.0, _MIN_RENEW_S)
        self.forget_idle_ms = max(2 * claim_idle_ms, _MIN_FORGET_IDLE_MS)
        self.events = events
        self.stop = stop
        self.stuck = stuck  # the service's, which the answerer marks around each run
        self._stuck_logged = False
        self.failure: BaseException | None = None
        self._rng = rng or random.Random()
        self._done = threading.Event()
        self._down = False

    def close(self) -> None:
        """Stop renewing: called once nothing held remains to be answered."""
        self._done.set()
        if self.is_alive():
            self.join(timeout=5)

    def run(self) -> None:
        forget_every = max(round(self.forget_idle_ms / 1000.0 / self.renew_s), 1)
        tick = self._rng.randrange(forget_every)  # workers started together spread their sweeps
        while not self._done.wait(self.renew_s):
            tick += 1
            try:
                reached = self._renew()
                if tick % forget_every == 0:
                    self._forget()
                    reached = True
                if reached:
                    self._up()
            except Exception as exc:
                if is_transient(exc):
                    self._note_down(exc)
                    continue
                self._fail(exc)
                return

    def _fail(self, exc: BaseException) -> None:
        """E.g. NOPERM or a changed password: without leases, held work would run twice."""
        self.failure = exc
        log.error("lease renewal stopped (%s); stopping the worker", exc, exc_info=exc)
        if self.stop is not None:
            self.stop.set()

    def _renew(self) -> bool:
        """Renew what is held; True when that took a call to Redis (False: nothing to renew,
        or a hung batch's leases lapse)."""
        held = self.leases.ids()
        if not held or self._hung():
            return False
        renewed = self.claims.renew(held)
        self.events.leases_renewed(renewed)
        if renewed < len(held):  # finished meanwhile, or claimed away: the finish step decides
            log.debug("%d held entries were not pending on this worker", len(held) - renewed)
        return True

    def _hung(self) -> bool:
        """A hung batch must not hold its entries forever: let the leases lapse."""
        if not self.stuck.is_set():
            self._stuck_logged = False
            return False
        if not self._stuck_logged:
            self._stuck_logged = True
            log.error(
                "a batch has run longer than delivery.max_run_s; no longer renewing the %d "
                "entries held, so other workers can claim them",
                len(self.leases),
            )
        return True

    def _forget(self) -> None:
        gone = self.claims.forget_consumers(self.forget_idle_ms)
        if gone:
            log.info(
                "removed %d idle consumers with nothing pending",
                len(gone),
                extra={"fields": {"consumers": gone[:20]}},
            )
            self.events.consumers_forgotten(len(gone))

    def _note_down(self, exc: BaseException) -> None:
        if not self._down:
            self._down = True
            log.warning("lease renewal cannot reach Redis (%s); will keep trying", exc)

    def _up(self) -> None:
        if self._down:
            self._down = False
            log.warning("lease renewal reached Redis again")
