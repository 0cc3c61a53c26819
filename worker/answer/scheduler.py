"""Lane scheduling: which lane's requests the batcher takes next (docs/protocol.md, "Lanes").

``LaneQueue`` stands where a ``queue.Queue`` of reads stood between the reading threads (or the
preprocessing stage) and the ``Batcher``, with the same ``put``/``get`` surface. What it adds:

- **Capacity per lane.** Each lane holds ``maxsize`` reads at most, so a full low lane blocks
  its own reader only; a high read is taken at once.
- **Classes.** ``get`` hands out class high first, then normal, then low; except that a lower
  class that has work and got less than its minimum share (``[scheduling] min_share_normal``,
  ``min_share_low``) of the rows handed out over the last ``window_rows`` goes first, so none
  starves under a saturating higher class.
- **Tenants.** Within a class, deficit round-robin by rows across the flows with work: a flow's
  quantum is its weight (``set_weights``; 1 when unset) times ``max_rows`` rows, the same
  ratios as a quantum of ``weight`` rows with one hand-out per batch, so a batch mostly comes
  from one lane and takes one finish step (a batch mixing lanes takes one per lane). Rows carry
  over within a turn, so a tenant's share over any 100 batches is its weight's within a
  quantum. An item larger than a quantum waits for its flow's deficit to reach it.
- **One lane, no cost.** While a single flow has work (the common case), ``get`` hands out its
  next read whole, as the plain queue did, counting its items as its rows in the window (exact
  rows are counted only where lanes compete, where the hand-outs are split anyway).

Contended hand-outs hold at most ``max_rows`` rows and one flow's turn; the batcher gives what
did not fit its batch back (``putback``) when the batch closes, so a high request that arrives
while a batch runs is first in the next one: it waits for the running batch, then its own.

Extension: a flow is a ``(class, key)`` pair found once per lane by ``describe(lane)``, and a
lane is whatever ``lane_of(item)`` returns (here ``item.entry.lane``, None for a shard's default
lane). Today the key is the tenant (``""`` without one). Several models in one worker (issue
29) reuse this class with ``lane_of`` returning ``(model, lane)``, ``describe`` returning
``(class, (model, tenant))`` and weights keyed by ``(model, tenant)``: classes stay first across
models and the flows of one class take turns by rows. For turns among models before tenants,
give each model's flows a quantum divided by the number of its tenants with work, or nest a
second ring per model inside ``_Flow``; the class choice and the window stay as they are.

A pipeline's preprocessing stage holds a read's room in its lane with ``reserve`` before it
preprocesses it and queues it with ``put_reserved``, so a full low lane blocks its own reader
there too, never the stage. It has one consumer: ``putback`` returns items of the last ``get``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from producer.protocol.lanes import CLASSES, DEFAULT_CLASS
from worker.config.settings import SchedulingConfig
from worker.items import Item

__all__ = ["LaneQueue", "class_and_tenant", "entry_lane"]

_CLASS_INDEX = {cls: index for index, cls in enumerate(CLASSES)}
_DEFAULT_INDEX = _CLASS_INDEX[DEFAULT_CLASS]
_PRUNE_AT = 1024  # lanes known before idle ones are forgotten


def entry_lane(item: Item) -> Hashable:
    """The lane an item was read from: its entry's (None for the shard's default lane)."""
    return item.entry.lane


def class_and_tenant(lane: Any) -> tuple[int, Hashable]:
    """A lane's class (its index in ``CLASSES``) and its tenant, ``""`` for none."""
    if lane is None:
        return _DEFAULT_INDEX, ""
    return _CLASS_INDEX.get(lane.cls, _DEFAULT_INDEX), lane.tenant or ""


class _Flow:
    """The reads of one ``(class, key)`` waiting in arrival order, and its round-robin state."""

    __slots__ = ("cls", "deficit", "key", "quantum", "reads", "ringed")

    def __init__(self, cls: int, key: Hashable, quantum: int) -> None:
        self.cls = cls
        self.key = key
        self.quantum = quantum
        self.deficit = 0  # rows it may still take in its turn
        self.reads: deque[tuple[_Lane, list[Item]]] = deque()
        self.ringed = False  # in its class's ring: it has work


class _Lane:
    """One lane: the flow it feeds, how many reads it holds, and where its reader waits."""

    __slots__ = ("flow", "held", "not_full")

    def __init__(self, flow: _Flow, mutex: threading.Lock) -> None:
        self.flow = flow
        self.held = 0
        self.not_full = threading.Condition(mutex)


class _Window:
    """Rows handed out per class over roughly the last ``rows``: two halves, the older dropped
    whole when the newer fills, so that adding is O(1)."""

    __slots__ = ("_half", "_new", "_new_total", "_old", "_old_total")

    def __init__(self, rows: int) -> None:
        self._half = max(1, rows // 2)
        self._new = [0] * len(CLASSES)
        self._old = [0] * len(CLASSES)
        self._new_total = self._old_total = 0

    def add(self, cls: int, rows: int) -> None:
        self._new[cls] += rows
        self._new_total += rows
        if self._new_total >= self._half:
            self._old, self._new = self._new, self._old
            self._old_total, self._new_total = self._new_total, 0
            self._new[0] = self._new[1] = self._new[2] = 0

    def remove(self, cls: int, rows: int) -> None:
        """Take back rows handed out and returned (from the newer half first)."""
        for half in (self._new, self._old):
            back = min(rows, half[cls])
            half[cls] -= back
            if half is self._new:
                self._new_total -= back
            else:
                self._old_total -= back
            rows -= back

    def share(self, cls: int) -> float:
        """``cls``'s share of the window's rows; 1.0 while nothing was counted (none starved)."""
        total = self._new_total + self._old_total
        return (self._new[cls] + self._old[cls]) / total if total > 0 else 1.0


class LaneQueue:
    """Reads in per lane, hand-outs by class, minimum share and weighted fairness; duck-typed
    like ``queue.Queue[list[Item]]`` for ``put``, ``get``, ``get_nowait``, ``empty``, ``qsize``,
    ``mutex`` and ``maxsize`` (here: reads held per lane)."""

    def __init__(
        self,
        scheduling: SchedulingConfig,
        max_rows: int,
        per_lane: int = 2,
        *,
        window_rows: int | None = None,
        lane_of: Callable[[Item], Hashable] = entry_lane,
        describe: Callable[[Any], tuple[int, Hashable]] = class_and_tenant,
    ) -> None:
        self.mutex = threading.Lock()
        self.not_empty = threading.Condition(self.mutex)
        self.maxsize = per_lane  # reads each lane may hold; 0 or less: unbounded
        self.max_rows = max_rows
        self._lane_of = lane_of
        self._describe = describe
        self._min_share = (0.0, scheduling.min_share_normal, scheduling.min_share_low)
        self._base = max(1, max_rows)
        self._share_rows = max(1, max_rows // 4)
        self._weights: Mapping[Hashable, int] = {}
        self._lanes: dict[Hashable, _Lane] = {}
        self._flows: dict[tuple[int, Hashable], _Flow] = {}
        self._rings: tuple[deque[_Flow], ...] = tuple(deque() for _ in CLASSES)
        self._busy = 0  # flows with work
        self._reads = 0  # reads (or returned parts of one) held
        self._window = _Window(window_rows or max(1024, 8 * max_rows))
        self._last: _Flow | None = None  # the flow of the last hand-out
        self._last_exact = False  # its rows were charged exactly (not by item count)

    # -- the queue.Queue surface -------------------------------------------------------------

    def put(self, items: list[Item], block: bool = True, timeout: float | None = None) -> None:
        """Queue one read (all of one lane); blocks while that lane holds ``maxsize`` reads."""
        lane_id = self._lane_of(items[0]) if items else None
        with self.mutex:
            lane = self._lanes.get(lane_id) or self._new_lane(lane_id)
            if 0 < self.maxsize <= lane.held:
                self._wait_room(lane, block, timeout)
            self._push(lane, items)
            self.not_empty.notify()

    def put_nowait(self, items: list[Item]) -> None:
        self.put(items, block=False)

    def reserve(
        self, items: list[Item], block: bool = True, timeout: float | None = None
    ) -> object:
        """Hold room in the lane of ``items`` for a read still being prepared (the pipeline's
        preprocessing), blocking as ``put`` would; ``put_reserved`` queues it with what this
        returns, whatever preparing made of its items."""
        lane_id = self._lane_of(items[0]) if items else None
        with self.mutex:
            lane = self._lanes.get(lane_id) or self._new_lane(lane_id)
            if 0 < self.maxsize <= lane.held:
                self._wait_room(lane, block, timeout)
            lane.held += 1
            return lane

    def put_reserved(self, reservation: _Lane, items: list[Item]) -> None:
        """Queue a read in the room ``reserve`` held for it: never blocks."""
        with self.mutex:
            reservation.held -= 1
            self._push(reservation, items)
            self.not_empty.notify()

    def get(self, block: bool = True, timeout: float | None = None) -> list[Item]:
        """What the batcher should take next; raises ``queue.Empty`` as ``Queue.get`` does."""
        with self.mutex:
            if not self._reads:
                self._wait_work(block, timeout)
            if self._busy == 1:
                return self._whole_read()
            return self._contended()

    def get_nowait(self) -> list[Item]:
        return self.get(block=False)

    def empty(self) -> bool:
        with self.mutex:
            return not self._reads

    def qsize(self) -> int:
        """Reads held, over all lanes (a read split by a hand-out counts once)."""
        with self.mutex:
            return self._reads

    def full(self) -> bool:
        """True when a lane holds all the reads it may (its reader waits), as ``Queue.full``."""
        with self.mutex:
            return self.maxsize > 0 and any(
                lane.held >= self.maxsize for lane in self._lanes.values()
            )

    # -- scheduling ----------------------------------------------------------------------------

    def putback(self, items: list[Item]) -> None:
        """Return the items of the last hand-out that did not fit the batch: first in their
        flow again, their rows uncounted. Never blocks."""
        if not items:
            return
        with self.mutex:
            lane_id = self._lane_of(items[0])
            lane = self._lanes.get(lane_id) or self._new_lane(lane_id)
            flow = lane.flow
            exact = self._last_exact and flow is self._last
            rows = sum(item.rows for item in items) if exact else len(items)
            self._window.remove(flow.cls, rows)
            if exact:
                flow.deficit += rows
            self._push(lane, items, first=True)
            self.not_empty.notify()

    def set_weights(self, weights: Mapping[Any, int]) -> None:
        """Each key's weight (``describe``'s key: the tenant); a key not named weighs 1."""
        with self.mutex:
            self._weights = dict(weights)
            for flow in self._flows.values():
                flow.quantum = self._quantum(flow.key)

    def _quantum(self, key: Hashable) -> int:
        return self._base * max(1, self._weights.get(key, 1))

    def _whole_read(self) -> list[Item]:
        """The one flow with work: its next read whole, as a plain queue hands it."""
        rings = self._rings
        ring = rings[0] or rings[1] or rings[2]
        flow = ring[0]
        lane, items = flow.reads.popleft()
        self._release(lane)
        if not flow.reads:
            ring.popleft()
            flow.ringed = False
            self._busy = 0
        self._window.add(flow.cls, len(items))
        self._last, self._last_exact = flow, False
        return items

    def _contended(self) -> list[Item]:
        """Several flows have work: the chosen class's flow in turn, at most its deficit and a
        batch of rows."""
        cls, for_share = self._pick_class()
        ring = self._rings[cls]
        # A class served for its minimum share takes a quarter batch at a time, so its share
        # is met closely; otherwise a turn is up to a batch, so that a batch mostly comes from
        # one lane (one finish step: 64 tenant lanes then cost 0.95 of one lane, not 0.84).
        most = self._share_rows if for_share else self.max_rows
        while True:
            flow = ring[0]
            items = flow.reads[0][1]
            head = items[0].rows if items else 0
            if flow.deficit < head:
                flow.deficit += flow.quantum
                if flow.deficit < head:  # a large item: it waits for more turns
                    ring.rotate(-1)
                    continue
            return self._take(ring, flow, head, most)

    def _take(self, ring: deque[_Flow], flow: _Flow, head: int, most: int) -> list[Item]:
        """From ``flow``'s oldest read, the items its deficit (and ``most`` rows) allows; the
        first always."""
        lane, items = flow.reads[0]
        cap = min(flow.deficit, most)
        n, rows, end = 1, head, len(items)
        while n < end:
            more = items[n].rows
            if rows + more > cap:
                break
            rows += more
            n += 1
        if n >= end:
            flow.reads.popleft()
            self._release(lane)
            chunk = items
        else:
            flow.reads[0] = (lane, items[n:])
            chunk = items[:n]
        flow.deficit -= rows
        self._window.add(flow.cls, rows)
        self._last, self._last_exact = flow, True
        if not flow.reads:  # no work left: out of the ring, its deficit with it
            ring.popleft()
            flow.ringed = False
            flow.deficit = 0
            self._busy -= 1
        elif flow.deficit < (flow.reads[0][1][0].rows if flow.reads[0][1] else 0):
            ring.rotate(-1)  # its turn ends
        return chunk

    def _pick_class(self) -> tuple[int, bool]:
        """The highest class with work, unless a lower one with work is below its share (then
        that one, and True)."""
        rings = self._rings
        top = 0 if rings[0] else 1 if rings[1] else 2
        for cls in range(top + 1, len(rings)):
            if rings[cls] and self._window.share(cls) < self._min_share[cls]:
                return cls, True
        return top, False

    # -- bookkeeping ---------------------------------------------------------------------------

    def _push(self, lane: _Lane, items: list[Item], first: bool = False) -> None:
        """Queue a read in its flow, last (a new read) or ``first`` (one given back), and the
        flow in its class's ring the same way when it was not there."""
        flow = lane.flow
        (flow.reads.appendleft if first else flow.reads.append)((lane, items))
        lane.held += 1
        self._reads += 1
        if not flow.ringed:
            flow.ringed = True
            self._busy += 1
            ring = self._rings[flow.cls]
            (ring.appendleft if first else ring.append)(flow)

    def _release(self, lane: _Lane) -> None:
        """A read of ``lane`` handed out: room for its reader."""
        lane.held -= 1
        self._reads -= 1
        lane.not_full.notify()

    def _new_lane(self, lane_id: Hashable) -> _Lane:
        if len(self._lanes) >= _PRUNE_AT:
            self._prune()
        cls, key = self._describe(lane_id)
        flow = self._flows.get((cls, key))
        if flow is None:
            flow = self._flows[cls, key] = _Flow(cls, key, self._quantum(key))
        lane = self._lanes[lane_id] = _Lane(flow, self.mutex)
        return lane

    def _prune(self) -> None:
        """Forget lanes that hold nothing (none of their readers waits: a reader waits only on a
        lane that holds reads), and flows no lane left feeds."""
        self._lanes = {k: lane for k, lane in self._lanes.items() if lane.held}
        fed = {id(lane.flow) for lane in self._lanes.values()}
        self._flows = {k: f for k, f in self._flows.items() if id(f) in fed or f.ringed}

    def _wait_room(self, lane: _Lane, block: bool, timeout: float | None) -> None:
        if not block:
            raise queue.Full
        if timeout is None:
            while 0 < self.maxsize <= lane.held:
                lane.not_full.wait()
            return
        if timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        end = time.monotonic() + timeout
        while 0 < self.maxsize <= lane.held:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise queue.Full
            lane.not_full.wait(remaining)

    def _wait_work(self, block: bool, timeout: float | None) -> None:
        if not block:
            raise queue.Empty
        if timeout is None:
            while not self._reads:
                self.not_empty.wait()
            return
        if timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        end = time.monotonic() + timeout
        while not self._reads:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise queue.Empty
            self.not_empty.wait(remaining)
