"""A config read again, applied to a running fleet (contract section 8), on a thread of its own.

Removed models stop reading, answer what they read and are dropped. A changed model's new
version is loaded and warmed beside the old one first; then the old one stops reading and
answers what it read, and the new one reads from that moment on under the same consumer name,
so no request is lost or answered twice, and each reply names the version that ran it. A model
that fails to load changes nothing: the old version serves on. What was done, and what was not
and why, goes into every model's record (``reload``), where ``redbatch reload`` reads it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from worker.config import WorkerConfig
from worker.config.served import ServedConfig
from worker.config.settings import WorkerTable
from worker.errors import WorkerError
from worker.fleet.plan import plan
from worker.fleet.slot import Slot
from worker.model.held import Budget, HeldModel
from worker.ops.metrics import Metrics
from worker.ops.record import utc_now
from worker.warmup import Prepared

__all__ = ["Reload"]

log = logging.getLogger(__name__)


class Serving(Protocol):
    """What a reload changes of the fleet (``worker.fleet.fleet.Fleet``)."""

    slots: dict[str, Slot]
    budget: Budget
    stop: threading.Event
    lock: threading.RLock

    def new_slot(self, prepared: Prepared, metrics: Metrics | None = None) -> Slot: ...

    def prepare_model(self, config: WorkerConfig) -> Prepared: ...

    def plan_base(self) -> WorkerTable: ...

    def forget_metrics(self, name: str) -> None: ...


class Reload:
    """One pass: read the config, work out the changes, apply them, say what happened."""

    def __init__(
        self, fleet: Serving, read_config: Callable[[], ServedConfig], tokens: list[str]
    ) -> None:
        self.fleet = fleet
        self.read_config = read_config
        self.tokens = tokens  # the ``redbatch reload`` asks this pass answers
        self.errors: list[str] = []
        self.restart: list[str] = []  # changes that take effect at a restart

    def run(self) -> None:
        summary: dict[str, list[str]] = {}
        try:
            summary = self._apply(self.read_config())
        except WorkerError as exc:
            log.error("reload: config not applied, every model serves on as it was: %s", exc)
            self.errors.append(f"config not applied: {exc}")
        except Exception as exc:  # never leave the asks unanswered, nor the thread dead silently
            log.exception("reload failed; the models serve on as they were")
            self.errors.append(f"reload failed: {type(exc).__name__}: {exc}")
        self._answer(summary)

    def _apply(self, served: ServedConfig) -> dict[str, list[str]]:
        fleet = self.fleet
        with fleet.lock:
            current = {
                name: (slot.prepared.config, slot.prepared.record["model"]["sha256"])
                for name, slot in fleet.slots.items()
            }
        change = plan(current, served, fleet.plan_base())
        if change.restart_only:
            log.warning(
                "reload: %s changed; that takes effect at a restart",
                ", ".join(change.restart_only),
            )
            self.restart += change.restart_only
        fleet.budget.set_limit(change.max_loaded_models)
        log.info("reload", extra={"fields": change.summary()})
        for name in change.removed:
            self._retire(name)
        for config in change.changed:
            self._swap(config)
        for config in change.added:
            self._add(config)
        return change.summary()

    def _load(self, config: WorkerConfig, instead_of: Slot | None) -> Prepared | None:
        """A version prepared beside what serves; None (and why) when it cannot load."""
        try:
            return self.fleet.prepare_model(config)
        except WorkerError as exc:
            keeps = ""
            if instead_of is not None:
                keeps = f"; version {instead_of.config_version!r} serves on"
            why = f"version {config.model.version!r} of {config.model.name!r} not loaded: {exc}"
            log.error("reload: %s%s", why, keeps)
            self.errors.append(why + keeps)
            return None

    def _swap(self, config: WorkerConfig) -> None:
        """The new version prepared and its worker built first; then the old one stops reading
        and answers what it read, and the new one reads from that moment on."""
        fleet = self.fleet
        old = fleet.slots[config.model.name]
        prepared = self._load(config, old)
        if prepared is None:
            return
        if fleet.stop.is_set():
            _discard(prepared)
            return
        new = fleet.new_slot(prepared, old.metrics)
        new.taking_over = True  # ready, as far as /readyz goes, until it reads
        old.hand_over()
        old.join()
        fleet.budget.forget(old.held)  # its session goes now, not when its objects are collected
        fleet.budget.admit(new.held)
        with fleet.lock:
            if fleet.stop.is_set():
                _discard(prepared)
                return  # stopped meanwhile: the old slot, done, ends the fleet
            fleet.slots[config.model.name] = new
            new.start()
        fields = {"model": config.model.name, "from": old.config_version, "to": new.config_version}
        log.info("model swapped", extra={"fields": fields})

    def _add(self, config: WorkerConfig) -> None:
        fleet = self.fleet
        prepared = self._load(config, None)
        if prepared is None:
            return
        slot = fleet.new_slot(prepared)
        fleet.budget.admit(slot.held)
        with fleet.lock:
            if fleet.stop.is_set():
                fleet.budget.forget(slot.held)
                _discard(prepared)
                return
            fleet.slots[config.model.name] = slot
            slot.start()
        log.info("model added", extra={"fields": {"model": config.model.name}})

    def _retire(self, name: str) -> None:
        fleet = self.fleet
        slot = fleet.slots[name]
        slot.hand_over()
        slot.join()
        fleet.budget.forget(slot.held)
        with fleet.lock:
            if slot.failure is None:
                del fleet.slots[name]  # a failure stays, for the fleet to raise
                fleet.forget_metrics(name)
        log.info("model removed", extra={"fields": {"model": name}})

    def _answer(self, summary: dict[str, Any]) -> None:
        """Every model's record says what this pass did (``redbatch reload`` waits for it)."""
        answer = {
            "tokens": self.tokens,
            "at": utc_now(),
            "changes": summary,
            "errors": self.errors,
            "restart": self.restart,
        }
        with self.fleet.lock:
            slots = list(self.fleet.slots.values())
        for slot in slots:
            slot.worker.registry.update(reload=answer)
            slot.worker.registry.beat_soon()


def _discard(prepared: Prepared) -> None:
    """A version prepared and never served: its session and its hook threads go now."""
    model = prepared.model
    if isinstance(model, HeldModel):
        model.close()
    if prepared.pipeline is not None:
        prepared.pipeline.pool.close()
