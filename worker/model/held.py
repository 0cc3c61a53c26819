"""A model whose session the worker may release and load again: several models, one budget.

A worker serving several models holds at most ``max_loaded_models`` sessions at once (contract
section 8). ``HeldModel`` is what the rest of the worker sees of one of them, the ``Model`` seam
(specs in, arrays out) with the specs of its first load: a run takes a turn on the device
(``worker.model.device``) and finds the session held, or has the ``Budget`` load and warm it
first, releasing the least recently used one to make room. Its requests wait meanwhile; the
other models keep running, since loading takes no turn. A load that fails is answered batch by
batch (``ModelUnavailable``), and tried again no sooner than ``RETRY_LOAD_S`` later, so a broken
file is not reloaded for every batch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from worker.errors import ModelUnavailable
from worker.model.device import Device
from worker.model.session import OnnxModel, TensorSpec

__all__ = ["DEVICE_MARGIN", "RETRY_LOAD_S", "Budget", "HeldModel", "HeldState"]

log = logging.getLogger(__name__)

#: After a load failed, how long batches are answered with that failure before a new try.
RETRY_LOAD_S = 5.0
#: On a GPU, a load goes ahead once the device's free memory holds this many times what the
#: model's session took last time (its arena grows with the batches it runs).
DEVICE_MARGIN = 1.25


@dataclass(frozen=True, slots=True)
class HeldState:
    """One model's session as metrics, its record and ``status`` show it."""

    loaded: bool
    loads: int
    evictions: int
    load_s: float  # the last load's, warmup included
    held_bytes: int  # the process's resident memory the last load added (approximate)
    error: str | None = None  # the last load's failure, while it stands
    device_bytes: int = 0  # GPU memory the last load took (CUDA; 0 elsewhere)

    def as_record(self) -> dict[str, object]:
        return {
            "loaded": self.loaded,
            "loads": self.loads,
            "evictions": self.evictions,
            "load_ms": round(self.load_s * 1000.0, 3),
            "held_bytes": self.held_bytes,
            "device_bytes": self.device_bytes,
            "error": self.error,
        }


class HeldModel:
    """One model's session, held or not; ``load`` builds and warms a new one.

    ``on_change`` hears each load and release (metrics, the worker record).
    """

    def __init__(
        self,
        name: str,
        session: OnnxModel,
        load: Callable[[], OnnxModel],
        budget: Budget,
        device: Device,
        load_s: float = 0.0,
        device_memory: Callable[[], int | None] | None = None,
        device_bytes: int = 0,
    ) -> None:
        self.name = name
        self.inputs: tuple[TensorSpec, ...] = session.inputs
        self.outputs: tuple[TensorSpec, ...] = session.outputs
        self.buckets = session.buckets  # the config's: every session of the model has them
        self._session: OnnxModel | None = session
        self._load = load
        self._budget = budget
        self._device = device
        # The batch about to run (set by the worker): its highest class is its rank at the device
        self.batch_rank: Callable[[], int] = lambda: 1
        self.on_turn: Callable[[], None] = lambda: None  # the run starts (the hung-run clock)
        self.on_change: Callable[[HeldState], None] = lambda state: None
        self._loads = 1
        self._evictions = 0
        self._load_s = load_s
        self._held_bytes = 0
        self._failed: tuple[float, str] | None = None  # (monotonic time, why)
        # On a GPU: the device's free memory now, and what this model's session took of it
        self.device_memory = device_memory
        self.device_bytes = device_bytes
        # Runs between taking the session and ending (this model's thread alone changes it):
        # the budget releases others first, so a session waiting for its turn stays held
        self._pins = 0

    def padded_rows(self, rows: int) -> int:
        """As the session pads (``OnnxModel.padded_rows``), held or not: no reference to a
        session outlives its release, or its memory would."""
        return next((size for size in self.buckets if size >= rows), rows)

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        session = self._budget.hold(self)  # pinned: not released while this run needs it
        try:
            self._device.acquire(self.batch_rank)
            try:
                self.on_turn()
                return session.run(feeds, output_names)
            finally:
                self._device.release()
        finally:
            self._budget.unpin(self)

    @property
    def loaded(self) -> bool:
        return self._session is not None

    def state(self) -> HeldState:
        failed = self._failed[1] if self._failed is not None else None
        return HeldState(
            self.loaded,
            self._loads,
            self._evictions,
            self._load_s,
            self._held_bytes,
            failed,
            self.device_bytes,
        )

    # -- for the budget ---------------------------------------------------------------------

    def _held(self) -> OnnxModel | None:
        return self._session

    def _check_retry(self) -> None:
        """Raise the standing failure while it is younger than ``RETRY_LOAD_S``."""
        if self._failed is not None and time.monotonic() - self._failed[0] < RETRY_LOAD_S:
            raise ModelUnavailable(self._failed[1])

    def _do_load(self, started: float) -> OnnxModel:
        """Load; ``started`` is when making room for it began (a release is part of the
        wait a load causes, so it is part of the time reported)."""
        before = _resident_bytes()
        free_before = self.device_memory() if self.device_memory is not None else None
        try:
            session = self._load()
        except Exception as exc:  # a file gone or changed, out of memory, the runtime's own
            why = (
                f"model {self.name!r} could not be loaded on this worker ({exc}); the worker "
                f"goes on serving its other models and tries again in {RETRY_LOAD_S:g} s"
            )
            self._failed = (time.monotonic(), why)
            log.error("%s", why, extra={"fields": {"model": self.name}})
            self.on_change(self.state())
            raise ModelUnavailable(why) from exc
        self._failed = None
        self._load_s = time.perf_counter() - started
        self._held_bytes = max(_resident_bytes() - before, 0)
        free_after = self.device_memory() if self.device_memory is not None else None
        if free_before is not None and free_after is not None:
            self.device_bytes = max(free_before - free_after, 0)
        self._loads += 1
        self._session = session
        log.info(
            "model loaded",
            extra={"fields": {"model": self.name, "load_ms": round(self._load_s * 1000.0, 1)}},
        )
        self.on_change(self.state())
        return session

    def close(self) -> None:
        """Let the session go for good (no counts, no listener): the model is dropped."""
        self._session = None
        self.on_change = lambda state: None
        self.on_turn = lambda: None

    def _release(self, evicted: bool = True) -> None:
        self._session = None  # a run in progress keeps its own reference until it ends
        self._evictions += evicted
        log.info("model released", extra={"fields": {"model": self.name}})
        self.on_change(self.state())


class Budget:
    """At most ``limit`` sessions held at once (0: no limit), the least recently used released
    first. Loads happen one at a time, so the count is exact."""

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._loading = threading.Lock()
        self._used: OrderedDict[str, HeldModel] = OrderedDict()  # held, least recent first

    def start(self, model: HeldModel) -> None:
        """A model prepared at start, in config order: held while the budget has room, else
        released at once (it is loaded on its first request)."""
        with self._lock:
            if not self.limit or len(self._used) < self.limit:
                self._used[model.name] = model
                return
        model._release(evicted=False)

    def admit(self, model: HeldModel) -> None:
        """Count a model swapped in as held and most recently used, releasing others past the
        limit."""
        with self._lock:
            self._used[model.name] = model
            self._used.move_to_end(model.name)
            self._make_room(keep=model.name, room_for=0)

    def hold(self, model: HeldModel) -> OnnxModel:
        """The model's session, loaded (and warmed) first when it is not held; pinned until
        ``unpin``."""
        model._pins += 1
        try:
            return self._hold(model)
        except BaseException:
            model._pins -= 1
            raise

    def unpin(self, model: HeldModel) -> None:
        model._pins -= 1

    def _hold(self, model: HeldModel) -> OnnxModel:
        if not self.limit:  # no budget: nothing is released, so no order to keep
            session = model._held()
            if session is not None:
                return session
        with self._lock:
            session = model._held()
            if session is not None:
                self._used[model.name] = model
                self._used.move_to_end(model.name)
                return session
        with self._loading:
            session = model._held()  # loaded meanwhile (a swap)
            if session is not None:
                return session
            model._check_retry()
            started = time.perf_counter()
            with self._lock:
                self._make_room(keep=model.name, room_for=1)
                self._fit_on_device(model)
            session = model._do_load(started)
            with self._lock:
                self._used[model.name] = model
        return session

    def forget(self, model: HeldModel) -> None:
        """A model dropped from the worker (or replaced by a new version): not counted, and its
        session let go now (a worker's objects live in cycles, some frozen out of the cyclic
        collector at start: the session must not wait for them to be collected)."""
        with self._lock:
            if self._used.get(model.name) is model:
                del self._used[model.name]
        model.close()

    def set_limit(self, limit: int) -> None:
        with self._lock:
            self.limit = limit
            self._make_room(keep="", room_for=0)

    @property
    def held(self) -> list[str]:
        with self._lock:
            return [name for name, model in self._used.items() if model.loaded]

    def _make_room(self, keep: str, room_for: int) -> None:
        """Release the least recently used sessions past the limit; one a run waits to use
        stays (the limit is then exceeded until that run ends: never a session freed under a
        batch, nor one loaded again at once)."""
        if not self.limit:
            return
        for name in list(self._used):
            if len(self._used) + room_for <= self.limit:
                return
            if name != keep and not self._used[name]._pins:
                self._used.pop(name)._release()

    def _fit_on_device(self, model: HeldModel) -> None:
        """On a GPU: release the least recently used sessions until the device's free memory
        holds what ``model`` took when it last loaded, with ``DEVICE_MARGIN`` to spare (the
        count is not the only bound: models differ in size). Loads anyway when nothing more
        can go; the runtime then says whether it fits."""
        probe, need = model.device_memory, model.device_bytes * DEVICE_MARGIN
        if probe is None or not need:
            return
        for name in list(self._used):
            free = probe()
            if free is None or free >= need:
                return
            if name != model.name and not self._used[name]._pins:
                released = self._used.pop(name)
                log.info(
                    "releasing a session for GPU memory",
                    extra={"fields": {"model": released.name, "for": model.name, "free": free}},
                )
                released._release()


def _resident_bytes() -> int:
    """The process's resident set size, from /proc (0 where there is none)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")
