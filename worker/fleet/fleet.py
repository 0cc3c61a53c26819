"""The worker process: every model its config lists, each on a ``Worker`` of its own, sharing one
device, one session budget and one connection per Redis node (contract section 8).

Each model keeps what it would have alone (keys, shards, lanes, limits, pipeline, validation
record, metrics); what the models share is the process: the device takes one run at a time by
class, then in turn (``worker.model.device``), and the budget holds at most
``max_loaded_models`` sessions (``worker.model.held``). One model is the common case, and takes
the same path. On SIGHUP, or ``redbatch reload`` (an ask in Redis, taken about once a second),
the config is read again and applied on a thread of its own (``worker.fleet.reload``), so a stop
signal is heard while a new version loads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from producer.protocol.keys import reload_key
from producer.redisio.topology import Topology
from worker.config import WorkerConfig
from worker.config.served import ServedConfig
from worker.config.settings import WorkerTable
from worker.events import Events
from worker.fleet.exposition import FleetMetrics
from worker.fleet.loading import prepare_held
from worker.fleet.reload import Reload
from worker.fleet.slot import Slot
from worker.fleet.watch import ConfigWatch
from worker.model.device import Device
from worker.model.held import Budget, HeldModel
from worker.model.session import share_cpu_arena
from worker.ops.metrics import Metrics
from worker.service import Worker
from worker.warmup import Prepared

__all__ = ["Fleet"]

log = logging.getLogger(__name__)

_WAIT_S = 0.2  # how often the main thread looks at the slots (signals are heard between)
_ASK_POLL_S = 1.0  # how often it takes redbatch reload's asks


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
        watch: ConfigWatch | None = None,
    ) -> None:
        self.served = served
        self.name = name
        self.burst = burst
        self.faults = faults
        self.read_config = read_config
        self.watch = watch  # [worker] watch_config_s: a changed file reloads as SIGHUP does
        self.device = Device()
        self.budget = Budget(served.worker.max_loaded_models)
        self.prepared: list[Prepared] = []
        self.slots: dict[str, Slot] = {}
        self.model_metrics: dict[str, Metrics] = {}  # each model's series, from its first load
        self.metrics = FleetMetrics(self._registries)
        self.stop = threading.Event()
        self.abandon: Callable[[], None] | None = None
        self.topology: Topology | None = None
        self._client: redis.Redis | None = None
        self.lock = threading.RLock()  # the slots, as reloads change them
        self._wake = threading.Event()  # a slot ended, or a reload was asked
        self._reload_asked = threading.Event()
        self._reloading: threading.Thread | None = None
        self._tokens: list[str] = []  # redbatch reload's asks, for the next pass to answer
        self._asks_refused = False
        self._next_ask_poll = 0.0

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
            # its series from now on: /metrics says "not ready" while it loads and warms up
            self.model_metrics[config.model.name] = Metrics()
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
        with self.lock:
            for prepared in self.prepared:
                self.slots[prepared.config.model.name] = self.new_slot(prepared)
            self.prepared = []  # the slots hold them now
            for slot in self.slots.values():
                slot.start()
        failure: BaseException | None = None
        while True:
            if not self.stop.is_set():
                self._poll_asks()
                if self.watch is not None and self.watch.changed():
                    log.info("the config file changed: reading it again")
                    self.request_reload()
            if self._reload_asked.is_set() and not self.stop.is_set():
                self._start_reload()
            with self.lock:
                slots = list(self.slots.values())
                reloading = self._reloading is not None and self._reloading.is_alive()
            failed = next((s.failure for s in slots if s.failure is not None), None)
            if failed is not None and failure is None:
                failure = failed
                self.request_stop()
            # (a reload under way when the process stops is left: it starts nothing after)
            if all(s.done.is_set() for s in slots) and (not reloading or self.stop.is_set()):
                break
            self._wake.wait(_WAIT_S)
            self._wake.clear()
        if failure is not None:
            raise failure

    def new_slot(self, prepared: Prepared, metrics: Metrics | None = None) -> Slot:
        name = prepared.config.model.name
        with self.lock:
            metrics = metrics or self.model_metrics.get(name) or Metrics()
            self.model_metrics[name] = metrics
        return Slot(prepared, self._make_worker, self._wake.set, metrics)

    def forget_metrics(self, name: str) -> None:
        """A model dropped: its series go from /metrics."""
        with self.lock:
            self.model_metrics.pop(name, None)

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
        second = self.stop.is_set()
        self.stop.set()
        with self.lock:
            slots = list(self.slots.values())
        for slot in slots:
            if second:
                slot.give_up()
            else:
                slot.stop()
        self._wake.set()

    def request_reload(self) -> None:
        """SIGHUP: read the config again, on the reload thread (never in a signal handler)."""
        self._reload_asked.set()
        self._wake.set()

    def _start_reload(self) -> None:
        with self.lock:
            if self._reloading is not None and self._reloading.is_alive():
                return  # asked again while one runs: the next pass reads the newer file
            self._reload_asked.clear()
            tokens, self._tokens = self._tokens, []
            self._reloading = threading.Thread(
                target=self._run_reload, args=(tokens,), name="redbatch-reload", daemon=True
            )
            self._reloading.start()

    # -- reload (SIGHUP, redbatch reload) -------------------------------------------------

    def prepare_model(self, config: WorkerConfig) -> Prepared:
        return prepare_held(config, self.name, self.budget, self.device)

    def plan_base(self) -> WorkerTable:
        """The ``[worker]`` table in effect (a reload reports changes to it for a restart)."""
        return self.served.worker

    def _run_reload(self, tokens: list[str]) -> None:
        if self.read_config is None:
            log.warning("reload asked, but this worker has no config file to read again")
            return
        Reload(self, self.read_config, tokens).run()

    def _poll_asks(self) -> None:
        """Take ``redbatch reload``'s asks (``P:{M}:reload:NAME``, GETDEL) of every model
        served, about once a second, on the main thread."""
        now = time.monotonic()
        if self._asks_refused or self.topology is None or now < self._next_ask_poll:
            return
        if not self.ready():  # not before every model has reached Redis (it may refuse)
            return
        self._next_ask_poll = now + _ASK_POLL_S
        prefix = self.served.models[0].redis.prefix
        with self.lock:
            names = list(self.slots)
        for model in names:
            try:
                token = self.topology.client(model).getdel(reload_key(prefix, model, self.name))
            except redis.exceptions.NoPermissionError as exc:
                log.warning(
                    "redbatch reload cannot reach this worker: its ACL user may not GETDEL "
                    "%s (%s); SIGHUP still works (docs/security.md)",
                    reload_key(prefix, model, self.name),
                    exc,
                )
                self._asks_refused = True
                return
            except (redis.RedisError, OSError):
                return  # an outage: the workers say so, and the next poll tries again
            if token:
                with self.lock:
                    self._tokens.append(
                        token.decode("utf-8", "replace") if isinstance(token, bytes) else token
                    )
                self.request_reload()

    # -- health ---------------------------------------------------------------------------

    def ready(self) -> bool:
        """/readyz: every model warm and reading (or swapping in a new version)."""
        with self.lock:
            slots = list(self.slots.values())
        return bool(slots) and all(slot.ready() for slot in slots)

    def health_problem(self) -> str | None:
        with self.lock:
            slots = list(self.slots.values())
        for slot in slots:
            problem = slot.worker.health_problem()
            if problem is not None:
                return problem if len(slots) == 1 else f"model {slot.name!r}: {problem}"
        return None

    def close(self) -> None:
        if self.topology is not None:
            self.topology.close()

    def _registries(self) -> dict[str, Any]:
        with self.lock:
            return {name: metrics.registry for name, metrics in self.model_metrics.items()}
