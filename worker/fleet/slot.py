"""One model in a fleet: its ``Worker``, the thread it runs on, and the metrics it keeps.

The metrics outlive the worker: a new version swapped in (``worker.fleet.reload``) gets a new
``Worker`` on the same ``Metrics``, so a model's counters run on across versions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from worker.model.held import HeldModel, HeldState
from worker.ops.metrics import Metrics
from worker.service import Worker
from worker.warmup import Prepared

__all__ = ["Slot"]

MakeWorker = Callable[[Prepared, Metrics], Worker]


class Slot:
    """A model served in the fleet; ``on_end`` is called from its thread when ``run`` ends."""

    def __init__(
        self,
        prepared: Prepared,
        make: MakeWorker,
        on_end: Callable[[], None],
        metrics: Metrics | None = None,
    ) -> None:
        self.name = prepared.config.model.name
        self.prepared = prepared
        self.metrics = metrics or Metrics()
        self.worker = make(prepared, self.metrics)
        self.failure: BaseException | None = None
        self.done = threading.Event()
        # A swap (worker.fleet.reload): the old version hands over (drains), the new one takes
        # over (starts); /readyz stays 200 through it, as reading stops only for a moment
        self.handing_over = False
        self.taking_over = False
        self._stopping = False
        self._on_end = on_end
        self._thread = threading.Thread(target=self._run, name=f"model-{self.name}", daemon=True)
        held = self.held
        held.on_change = self._held_changed
        self._held_changed(held.state())

    @property
    def held(self) -> HeldModel:
        model = self.prepared.model
        assert isinstance(model, HeldModel)
        return model

    @property
    def config_version(self) -> str:
        return self.prepared.config.model.version

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """The process stops: stop reading; what was read is answered before ``done`` is set,
        giving up on Redis after the worker's grace (``Worker.request_stop``). Once only: a
        second stop of the process is ``give_up``."""
        if not self._stopping:
            self._stopping = True
            self.worker.request_stop()

    def give_up(self) -> None:
        """The process's second stop signal: give up on Redis now."""
        self.stop()
        self.worker.request_stop()

    def hand_over(self) -> None:
        """A new version takes over (or the model is dropped): stop reading and answer what was
        read, however long Redis takes, while the process goes on (``Worker.stop_reading``)."""
        self.handing_over = True  # still ready, as far as /readyz goes
        self.worker.stop_reading()

    def join(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def ready(self) -> bool:
        """/readyz for this model: warm, reading and healthy; or one version handing over to
        the next (the old one draining, the new one starting), which reads again in a moment."""
        if self.handing_over:
            return True
        if self.worker.ready.is_set():
            self.taking_over = False  # the new version reads: from now on it answers for itself
            return self.worker.healthy()
        return self.taking_over

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:  # handed to the fleet, which stops the rest and raises it
            self.failure = exc
        finally:
            self.done.set()
            self._on_end()

    def _held_changed(self, state: HeldState) -> None:
        self.metrics.held_seen(state)
        self.worker.registry.update(session=state.as_record())
