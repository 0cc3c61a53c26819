"""The worker process: every model its config lists, each on a ``Worker`` of its own, sharing one
device, one session budget and one connection per Redis node (contract section 8).

Each model keeps what it would have alone (keys, shards, lanes, limits, pipeline, validation
record, metrics); what the models share is the process: the device takes one run at a time by
class, then in turn (``worker.model.device``), and the budget holds at most
``max_loaded_models`` sessions (``worker.model.held``). One model is the common case, and takes
the same path. On SIGHUP the config is read again and applied on a thread of its own
(``worker.fleet.reload``), so a stop signal is heard while a new version loads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from producer.redisio.topology import Topology
from worker.config import WorkerConfig
from worker.config.served import ServedConfig
from worker.errors import WorkerError
from worker.events import Events
from worker.fleet.exposition import FleetMetrics
from worker.fleet.loading import prepare_held
from worker.fleet.reload import plan
from worker.fleet.slot import Slot
from worker.model.device import Device
from worker.model.held import Budget, HeldModel
from worker.model.session import share_cpu_arena
from worker.ops.metrics import Metrics
from worker.ops.record import utc_now
from worker.service import Worker
from worker.warmup import Prepared

__all__ = ["Fleet"]

log = logging.getLogger(__name__)

_WAIT_S = 0.2  # how often the main thread looks at the slots (signals are heard between)


class Fleet:
    """The models of one worker process, prepared before Redis is touched, then served."""

    def __init__(
        self,
        served: ServedConfig,
        name: str,
        *,
        burst: bool = False,
        faults: Events | None = None,
        read_config: Callable[[], ServedConfig] | None = None,
    ) -> None:
        self.served = served
        self.name = name
        self.burst = burst
        self.faults = faults
        self.read_config = read_config
        self.device = Device()
        self.budget = Budget(served.worker.max_loaded_models)
        self.prepared: list[Prepared] = []
        self.slots: dict[str, Slot] = {}
        self.metrics = FleetMetrics(self._registries)
        self.stop = threading.Event()
        self.abandon: Callable[[], None] | None = None
        self.topology: Topology | None = None
        self._client: redis.Redis | None = None
        self._lock = threading.RLock()  # the slots, as reloads change them
        self._wake = threading.Event()  # a slot ended, or a reload was asked
        self._reload_asked = threading.Event()
        self._reloading: threading.Thread | None = None

    # -- before Redis ---------------------------------------------------------------------

    def prepare(
        self, on_model: Callable[[WorkerConfig], None] = lambda config: None
    ) -> list[Prepared]:
        """Load, check and warm every model in config order; sessions past the budget are
        released once prepared (contract section 8), so at most one more than it is held."""
        if len(self.served.models) > 1 and self.served.worker.shared_arena:
            share_cpu_arena()
        for config in self.served.models:
            on_model(config)
            prepared = prepare_held(config, self.name, self.budget, self.device)
            assert isinstance(prepared.model, HeldModel)
            self.budget.start(prepared.model)
            self.prepared.append(prepared)
        return self.prepared

    # -- serving --------------------------------------------------------------------------

    def run(self, client: redis.Redis) -> None:
        """Serve every model until stopped (in burst mode, until each stream is drained);
        raises the first failure of any model's worker, after stopping the others."""
        self._client = client
        self.topology = Topology(client)
        with self._lock:
            for prepared in self.prepared:
                self.slots[prepared.config.model.name] = self.new_slot(prepared)
            self.prepared = []  # the slots hold them now
            for slot in self.slots.values():
                slot.start()
        failure: BaseException | None = None
        while True:
            if self._reload_asked.is_set() and not self.stop.is_set():
                self._start_reload()
            with self._lock:
                slots = list(self.slots.values())
                reloading = self._reloading is not None and self._reloading.is_alive()
            failed = next((s.failure for s in slots if s.failure is not None), None)
            if failed is not None and failure is None:
                failure = failed
                self.request_stop()
            if all(s.done.is_set() for s in slots) and not reloading:
                break
            self._wake.wait(_WAIT_S)
            self._wake.clear()
        if failure is not None:
            raise failure

    def new_slot(self, prepared: Prepared, metrics: Metrics | None = None) -> Slot:
        return Slot(prepared, self._make_worker, self._wake.set, metrics)

    def _make_worker(self, prepared: Prepared, metrics: Metrics) -> Worker:
        assert self._client is not None
        assert self.topology is not None
        worker = Worker(
            prepared,
            self._client,
            burst=self.burst,
            metrics=metrics,
            faults=self.faults,
            topology=self.topology,
        )
        worker.abandon = self.abandon
        return worker

    def request_stop(self) -> None:
        """First call: every model stops reading and answers what it read. Second call: give
        up on Redis now (``Worker.request_stop``)."""
        self.stop.set()
        with self._lock:
            slots = list(self.slots.values())
        for slot in slots:
            slot.stop()
        self._wake.set()

    def request_reload(self) -> None:
        """SIGHUP: read the config again, on the reload thread (never in a signal handler)."""
        self._reload_asked.set()
        self._wake.set()

    def _start_reload(self) -> None:
        with self._lock:
            if self._reloading is not None and self._reloading.is_alive():
                return  # asked again while one runs: the next pass reads the newer file
            self._reload_asked.clear()
            self._reloading = threading.Thread(
                target=self._reload, name="redbatch-reload", daemon=True
            )
            self._reloading.start()

    # -- reload (SIGHUP) ------------------------------------------------------------------

    def _reload(self) -> None:
        """Read the config again and apply it: removed models drained and dropped, changed ones
        swapped, added ones served; a model that fails to load changes nothing of its own."""
        if self.read_config is None:
            log.warning("SIGHUP: this worker has no config file to read again")
            return
        try:
            served = self.read_config()
        except WorkerError as exc:
            log.error("reload: config not applied, every model serves on as it was: %s", exc)
            self._tell(None, f"config not applied: {exc}")
            return
        with self._lock:
            current = {
                name: (slot.prepared.config, slot.prepared.record["model"]["sha256"])
                for name, slot in self.slots.items()
            }
        change = plan(current, served)
        if change.restart_only:
            log.warning(
                "reload: %s changed; the worker-wide tables take effect at a restart",
                ", ".join(change.restart_only),
            )
        self.budget.set_limit(change.max_loaded_models)
        log.info("reload", extra={"fields": change.summary()})
        for name in change.removed:
            self._retire(name)
        for config in change.changed:
            self._swap(config)
        for config in change.added:
            self._add(config)

    def _load(self, config: WorkerConfig, instead_of: Slot | None) -> Prepared | None:
        """A new version prepared beside what serves; None (and why, in the log and the old
        version's record) when it cannot load or warm up."""
        try:
            return prepare_held(config, self.name, self.budget, self.device)
        except WorkerError as exc:
            keeps = (
                f"; version {instead_of.config_version!r} serves on"
                if instead_of is not None
                else ""
            )
            why = f"version {config.model.version!r} of {config.model.name!r} not loaded: {exc}"
            log.error("reload: %s%s", why, keeps)
            self._tell(instead_of, why + keeps)
            return None

    def _swap(self, config: WorkerConfig) -> None:
        """The old version stops reading and answers what it read; the new one, loaded and
        warmed already, reads from that moment on under the same consumer name."""
        old = self.slots[config.model.name]
        prepared = self._load(config, old)
        if prepared is None or self.stop.is_set():
            return
        old.swapping = True
        old.stop()
        old.join()
        new = self.new_slot(prepared, old.metrics)
        self.budget.forget(old.held)
        self.budget.admit(new.held)
        with self._lock:
            if self.stop.is_set():
                return  # stopped meanwhile: the old slot, done, ends the fleet
            self.slots[config.model.name] = new
            new.start()
        log.info(
            "model swapped",
            extra={
                "fields": {
                    "model": config.model.name,
                    "from": old.config_version,
                    "to": config.model.version,
                }
            },
        )

    def _add(self, config: WorkerConfig) -> None:
        prepared = self._load(config, None)
        if prepared is None or self.stop.is_set():
            return
        slot = self.new_slot(prepared)
        self.budget.admit(slot.held)
        with self._lock:
            if self.stop.is_set():
                return
            self.slots[config.model.name] = slot
            slot.start()
        log.info("model added", extra={"fields": {"model": config.model.name}})

    def _retire(self, name: str) -> None:
        """Stop reading the model's lanes, answer what was read, then drop it."""
        slot = self.slots[name]
        slot.stop()
        slot.join()
        self.budget.forget(slot.held)
        with self._lock:
            if slot.failure is None:
                del self.slots[name]  # a failure stays, for run() to raise
        log.info("model removed", extra={"fields": {"model": name}})

    def _tell(self, slot: Slot | None, why: str) -> None:
        """Put a reload's failure in the record of ``slot`` (None: every model's)."""
        with self._lock:
            slots = [slot] if slot is not None else list(self.slots.values())
        for each in slots:
            each.worker.registry.update(reload={"error": why, "at": utc_now()})
            each.worker.registry.beat_soon()

    # -- health ---------------------------------------------------------------------------

    def ready(self) -> bool:
        """/readyz: every model warm and reading (or swapping in a new version)."""
        with self._lock:
            slots = list(self.slots.values())
        return bool(slots) and all(slot.ready() for slot in slots)

    def health_problem(self) -> str | None:
        with self._lock:
            slots = list(self.slots.values())
        for slot in slots:
            problem = slot.worker.health_problem()
            if problem is not None:
                return problem if len(slots) == 1 else f"model {slot.name!r}: {problem}"
        return None

    def served_counts(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {name: slot.worker.served for name, slot in self.slots.items()}

    def close(self) -> None:
        if self.topology is not None:
            self.topology.close()

    def wake(self) -> None:
        self._wake.set()

    def _registries(self) -> dict[str, Any]:
        with self._lock:
            return {name: slot.metrics.registry for name, slot in self.slots.items()}
