"""The worker: load and warm up, report ready, then read, batch, run and answer until stopped.

``run()`` reads as the table of contents; each step is a call into the module that owns it.
Shutdown has one path: a signal sets ``stop``, intake stops reading, and everything already read
is batched, run and answered before the worker exits.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from producer.codec import ErrorInfo, ModelRef
from worker import faults
from worker.assemble import FeedBuffers
from worker.batcher import Batcher
from worker.cancels import CancelCheck, Recheck, cancelled_error
from worker.claims import Claims
from worker.config import WorkerConfig
from worker.errors import Rejected, WorkerError
from worker.execute import Outcome, run_batch
from worker.intake import Intake, WorkItem
from worker.leases import LeaseKeeper, Leases
from worker.memalarm import MemoryAlarm
from worker.metrics import Metrics
from worker.model import OnnxModel, check_sha256, read_model_file
from worker.reclaim import Reclaimer
from worker.record import Registry, build_record
from worker.replies import ReplyEncoder
from worker.retry import Outage, is_transient
from worker.schema import Schema
from worker.stream import Finish, RequestStream
from worker.warmup import warm_up
from worker.writer import Batch, ReplyWriter

__all__ = ["Prepared", "Worker", "prepare"]

log = logging.getLogger(__name__)

_POLL_S = 0.1  # how often an idle loop looks at the stop flag


@dataclass(frozen=True, slots=True)
class Prepared:
    """A loaded, checked and warmed model: everything done before Redis is touched."""

    config: WorkerConfig
    model: OnnxModel
    schema: Schema
    model_ref: ModelRef
    record: dict[str, Any]


def prepare(config: WorkerConfig, name: str) -> Prepared:
    """Load the model, derive its schema, warm it up and build the validation record."""
    model_file = read_model_file(config.model.path)
    check_sha256(model_file, config.model.sha256)
    model = OnnxModel(config.model, config.batching.max_batch_size)
    if config.model.sha256:  # hashed, then loaded by path: hash again to close the gap
        check_sha256(read_model_file(config.model.path), config.model.sha256)
    schema = Schema(model.inputs, model.outputs, config)
    warmup = warm_up(model, schema, config.warmup.runs, model.buckets)
    record = build_record(name, config, model, model_file, schema, warmup)
    ref = ModelRef(config.model.name, config.model.version, model_file.sha256)
    return Prepared(config, model, schema, ref, record)


class Worker:
    """Serves one model from its request stream as one consumer of the ``workers`` group."""

    def __init__(
        self,
        prepared: Prepared,
        client: redis.Redis,
        *,
        burst: bool = False,
        metrics: Metrics | None = None,
    ) -> None:
        cfg = prepared.config
        self.config = cfg
        self.model = prepared.model
        self.schema = prepared.schema
        self.model_ref = prepared.model_ref
        self.name = prepared.record["name"]
        self.burst = burst
        self.stop = threading.Event()
        self.hard_stop = threading.Event()
        self.ready = threading.Event()  # set once the worker reads from the stream
        self.stream = RequestStream(client, cfg.redis.prefix, cfg.model.name, self.name)
        self.metrics = metrics or Metrics()
        # Its own stop: it beats until the drain ends (``_drain`` closes it), not until ``stop``.
        self.registry = Registry(
            client, cfg.redis.prefix, prepared.record, on_beat=self._sample_stream
        )
        # Lists of up to max_batch_size entries, one per read: at most two reads wait here.
        self.queue: queue.Queue[list[WorkItem]] = queue.Queue(maxsize=2)
        self.batcher = Batcher(
            self.queue,
            cfg.batching.max_batch_size,
            cfg.batching.max_wait_ms,
            adaptive=cfg.batching.adaptive_wait,
        )
        self.leases = Leases()
        claims = Claims(self.stream)
        self.keeper = LeaseKeeper(
            claims,
            self.leases,
            cfg.delivery.claim_idle_ms,
            on_renewed=self.metrics.leases_renewed,
            on_forgotten=self.metrics.consumers_forgotten,
            on_failure=self.stop.set,
            is_stuck=self.stuck,
        )
        self.intake = Intake(
            self.stream,
            self.schema,
            cfg.limits.max_request_bytes,
            self.queue,
            self.stop,
            read_count=cfg.batching.max_batch_size,
            leases=self.leases,
            reclaimer=Reclaimer(
                claims,
                self.leases,
                cfg.delivery.claim_idle_ms,
                cfg.delivery.max_deliveries,
                on_claimed=self.metrics.claimed,
            ),
            on_outage=self.metrics.redis_down,
            burst=burst,
        )
        self._claims = claims
        self.writer = ReplyWriter(
            self.stream,
            self.hard_stop,
            self._written,
            self.stop.set,
            on_outage=self.metrics.redis_down,
        )
        self._encoder = ReplyEncoder(self.model_ref, self.name)
        rows = max(cfg.batching.max_batch_size, self.schema.fixed_batch or 0)
        self.buffers = FeedBuffers(rows)  # main thread only: batches are assembled there
        self._running_since: float | None = None  # monotonic start of the run in progress
        self.served = {"requests": 0, "batches": 0}
        self._memory_alarm = MemoryAlarm()
        self.metrics.describe(prepared.record)

    def _sample_stream(self) -> None:
        """Heartbeat hook: the stream's state and Redis memory, for metrics and the log."""
        stats = self.stream.stats()
        self.metrics.stream_seen(stats, time.time() * 1000.0)
        self._memory_alarm.seen(stats.memory)

    def stuck(self) -> bool:
        """True while one batch has been running longer than ``delivery.max_run_s``."""
        limit = self.config.delivery.max_run_s
        started = self._running_since
        return bool(limit) and started is not None and time.monotonic() - started > limit

    def healthy(self) -> bool:
        """For /healthz: alive unless a batch hangs (then a restart is the cure)."""
        return not self.stuck()

    def request_stop(self) -> None:
        """First call: stop reading and finish what is held. Second call: give up on Redis."""
        if self.stop.is_set():
            self.hard_stop.set()
        self.stop.set()

    def run(self) -> None:
        """Serve until stopped (or, in burst mode, until the stream is drained)."""
        starting = Outage("starting up", give_up=self.stop, on_down=self.metrics.redis_down)
        try:
            starting.call(self.stream.ensure_group)
            if not starting.call(self.registry.beat_first):
                self._warn_name_taken()
            starting.call(self._sample_stream)
        except (redis.RedisError, OSError) as exc:
            if not (self.stop.is_set() and is_transient(exc)):
                raise  # a refusal (a wrong password, a missing permission) is not an outage
            # Stopped while waiting for Redis: nothing was read, so nothing is left to answer.
            if self.registry.published:  # it went out before Redis went away
                self.registry.remove()
            log.info("stopped before Redis could be reached; nothing was read")
            return
        self.registry.start()
        self.keeper.start()
        self.writer.start()
        self.intake.start()
        self.ready.set()
        # As /readyz says: warm, reading, and no batch hung past max_run_s
        self.metrics.ready.set_function(lambda: float(self.ready.is_set() and self.healthy()))
        log.info("ready", extra={"fields": {"worker": self.name, "stream": self.stream.key}})
        try:
            while not self.stop.is_set():
                batch = self.batcher.next_batch(_POLL_S)
                if batch:
                    self.process(batch)
                elif self.burst and self._drained():
                    break
        finally:
            self.ready.clear()
            self._drain()
        parts = ("intake", self.intake), ("writer", self.writer), ("leases", self.keeper)
        for part, failure in ((name, thread.failure) for name, thread in parts):
            if failure is not None:
                raise WorkerError(f"{part} failed: {failure}") from failure

    def _warn_name_taken(self) -> None:
        log.warning(
            "a live worker record already held the name %r: another worker under this name, or "
            "this worker's previous run within the last %.0f s (or a start-up write retried "
            "after its answer was lost). Two live workers must not share a name, as they would "
            "share one consumer of the group; give each its own --name",
            self.name,
            self.registry.interval_s * 3,
            extra={"fields": {"worker": self.name}},
        )

    def _drained(self) -> bool:
        """Burst mode: nothing new to read, nothing pending on any consumer (the intake's
        ``idle``, worker/intake.py) and nothing held here."""
        return (
            self.intake.idle.is_set()
            and self.queue.empty()
            and not self.batcher.holding
            and self.writer.idle()
        )

    def _drain(self) -> None:
        """Stop reading, then batch, run and answer every entry already read."""
        self.stop.set()
        self.registry.update(state="draining")
        self.registry.beat_soon()  # it keeps beating, as draining, until the drain ends
        clean = False
        try:
            while self.writer.failure is None and (
                self.intake.is_alive() or not self.queue.empty() or self.batcher.holding
            ):
                batch = self.batcher.next_batch(0.05)
                if batch:
                    self.process(batch)  # raises if the write failed on this thread
            clean = self.writer.failure is None
        finally:
            if not clean:
                self.keeper.close()  # stop renewing, so that other workers can claim the rest
                self.registry.close(remove=False)  # it expires, still saying draining
        if not clean:
            return  # what is left stays pending in Redis; run() raises the writer's error
        try:
            self.writer.close()
        finally:
            self.keeper.close()
            written = self.writer.failure is None
            if written:
                self._forget_self()
            self.registry.close(remove=written)  # ends the heartbeat, then removes the record
        log.info("stopped", extra={"fields": {"worker": self.name, **self.served}})

    def _forget_self(self) -> None:
        """Leave the group on a clean exit, so restarts do not pile up consumers."""
        try:
            if self._claims.forget_self():
                log.debug("removed consumer %s from the group", self.name)
        except (redis.RedisError, OSError) as exc:
            log.warning("could not remove consumer %s from the group (%s)", self.name, exc)

    # -- one batch --------------------------------------------------------------------------

    def process(self, batch: Sequence[WorkItem]) -> None:
        """Answer every item of the batch: run the valid ones, then hand all replies to the
        writer, which finishes the batch in one round trip while the next one runs (or here,
        when no next one waits)."""
        started_ms = time.time() * 1000.0
        runs: list[tuple[int, float]] = []
        try:
            finishes = self._answer(batch, started_ms, runs)
        except Exception:  # a bug here must not stop the worker or leave requests unanswered
            log.exception("batch failed unexpectedly; answering its requests INTERNAL")
            error = Rejected("INTERNAL", "the worker failed on this batch; retry.", retryable=True)
            finishes = [self._failure(item, error, started_ms) for item in batch]
        if faults.ACTIVE:
            faults.hit("after_inference")
        self.writer.submit(
            Batch(
                finishes,
                queued_s=[max(started_ms - item.entry.id_ms, 0.0) / 1000.0 for item in batch],
                decode_s=[item.decode_ms / 1000.0 for item in batch],
                runs=runs,
            ),
            here=self._write_here(runs),
        )

    def _write_here(self, runs: Sequence[tuple[int, float]]) -> bool:
        """Write on this thread (worker/writer.py) when no read waits to be batched and the
        batch ran for less than a typical write: its path is then mostly Redis and thread
        hand-offs, and the hand-off to the writer costs more than overlapping the write saves.
        A longer run means the model is the bottleneck, and no batch may wait on a write."""
        ran_s = sum(seconds for _, seconds in runs)
        return ran_s < self.writer.typical_s and self.queue.empty() and not self.batcher.holding

    def _written(self, batch: Batch, write_s: float) -> None:
        """Called once a batch is in Redis, on the thread that wrote it (one at a time)."""
        self.leases.release(f.entry_id for f in batch.finishes)
        # Counted as served: the entries finished here, not those another consumer holds now
        # (a hung batch's, claimed meanwhile) or that a flush took; the others get their reply
        # from whoever finishes them.
        codes = [f.code for f, done in zip(batch.finishes, batch.finished, strict=True) if done]
        self.metrics.batch_done(
            codes=codes,
            queued_s=batch.queued_s,
            decode_s=batch.decode_s,
            runs=batch.runs,
            write_s=write_s,
        )
        self.served["requests"] += len(codes)
        self.served["batches"] += 1 if codes else 0
        self.registry.update(served=dict(self.served))

    def _answer(
        self, batch: Sequence[WorkItem], started_ms: float, runs: list[tuple[int, float]]
    ) -> list[Finish]:
        finishes: list[Finish] = []
        runnable: list[WorkItem] = []
        for item in batch:
            error = item.rejection or _cancelled_already(item) or _expired(item)
            if item.dead_reason is not None or error is not None:
                finishes.append(self._failure(item, error, started_ms))
            else:
                runnable.append(item)
        for group in _by_signature(runnable):
            live = []
            for item in group:  # cancels and deadlines again, just before the run
                error = _cancelled_already(item) or _expired(item)
                if error is not None:
                    finishes.append(self._failure(item, error, started_ms))
                else:
                    live.append(item)
            if live:
                recheck = Recheck.stale(self.stream, _checks(live))
                self._running_since = time.monotonic()
                try:
                    outcomes = run_batch(
                        self.model,
                        self.schema,
                        live,
                        self._output_names(live),
                        on_run=lambda rows, seconds: runs.append((rows, seconds)),
                        buffers=self.buffers,
                        pad_rows=self.model.padded_rows,
                    )
                finally:
                    self._running_since = None
                    # read also when the run raised, which would leave its connection out
                    rechecked = recheck.cancelled()
                finishes += self._finish_run(outcomes, started_ms, rechecked)
        return finishes

    def _output_names(self, items: Iterable[WorkItem]) -> list[str]:
        wanted = {n for item in items if item.request is not None for n in item.request.outputs}
        return [n for n in self.schema.output_names if n in wanted]

    def _finish_run(
        self, outcomes: Sequence[Outcome], started_ms: float, rechecked: frozenset[str]
    ) -> list[Finish]:
        """The finish steps of a sub-batch's outcomes; the ok replies of each run are encoded
        together (what they share is packed once)."""
        finishes = []
        runs: dict[tuple[int, float], list[Outcome]] = {}
        for outcome in outcomes:
            item = outcome.item
            if item.rid in rechecked or _cancelled_during_run(item):
                # a cancel check answered after the run started (worker/cancels.py)
                self.metrics.cancelled_after_run()
                finishes.append(
                    self._failure(item, cancelled_error(), started_ms, outcome.inference_ms)
                )
                continue
            if outcome.error is None:
                runs.setdefault((outcome.batch_rows, outcome.inference_ms), []).append(outcome)
                continue
            if outcome.error.code == "INFERENCE_FAILED":
                log.warning(
                    "request failed in the runtime",
                    extra={"fields": {"rid": outcome.item.rid, "error": outcome.error.message}},
                )
            finishes.append(
                self._failure(outcome.item, outcome.error, started_ms, outcome.inference_ms)
            )
        for (rows, inference_ms), done in runs.items():
            items = [o.item for o in done]
            replies = self._encoder.encode_run(
                [
                    (item.rid or "", o.outputs or {}, _queued_ms(item, started_ms), item.meta_raw)
                    for item, o in zip(items, done, strict=True)
                ],
                batch_rows=rows,
                inference_ms=round(inference_ms, 3),
            )
            finishes += [
                Finish(item.entry.entry_id, item.rid, reply, self._ttl(item), code="OK")
                for item, reply in zip(items, replies, strict=True)
            ]
        return finishes

    def _failure(
        self, item: WorkItem, error: Rejected | None, started_ms: float, inference_ms: float = 0.0
    ) -> Finish:
        if item.dead_reason is not None:
            log.warning(
                "dead-lettered an entry",
                extra={
                    "fields": {
                        "entry": item.entry.entry_id.decode(),
                        "rid": item.rid,
                        "reason": item.dead_reason,
                    }
                },
            )
        if item.rid is None:  # no reply key can be named: the dead-letter stream is its answer
            return Finish(
                item.entry.entry_id, dead_reason=item.dead_reason or "no rid", code="DEAD_LETTER"
            )
        assert error is not None
        info = ErrorInfo(error.code, error.message, error.retryable)
        reply = self._reply(item, started_ms, inference_ms, info)
        return Finish(
            item.entry.entry_id,
            item.rid,
            reply,
            self._ttl(item),
            dead_reason=item.dead_reason,
            code=error.code,
        )

    def _reply(
        self, item: WorkItem, started_ms: float, inference_ms: float, error: ErrorInfo
    ) -> bytes:
        assert item.rid is not None
        timings = {"queued": _queued_ms(item, started_ms), "inference": round(inference_ms, 3)}
        return self._encoder.encode(
            item.rid, error=error, timings_ms=timings, meta_raw=item.meta_raw
        )

    def _ttl(self, item: WorkItem) -> int:
        own = self.config.delivery.reply_ttl_s
        return min(item.reply_ttl_s, own) if item.reply_ttl_s else own


def _queued_ms(item: WorkItem, started_ms: float) -> float:
    """From enqueue (the stream id's time) to the batch's start, as replies report it."""
    return round(max(started_ms - item.entry.id_ms, 0.0), 3)


def _cancelled_already(item: WorkItem) -> Rejected | None:
    """CANCELLED when the item's cancel check has answered that it was; never waits."""
    if item.cancel is not None and item.rid is not None and item.cancel.known(item.rid):
        return cancelled_error()
    return None


def _checks(items: Iterable[WorkItem]) -> Iterator[tuple[str, CancelCheck]]:
    """Each runnable item's rid and its read's cancel check."""
    for item in items:
        if item.cancel is not None and item.rid is not None:
            yield item.rid, item.cancel


def _cancelled_during_run(item: WorkItem) -> bool:
    """After its run: whether the item's cancel check, answered late, cancels it (waits)."""
    return item.cancel is not None and item.rid is not None and item.cancel.confirmed(item.rid)


def _expired(item: WorkItem) -> Rejected | None:
    now_ms = time.time() * 1000.0
    if item.deadline_ms is None or item.deadline_ms > now_ms:
        return None
    return Rejected(
        "DEADLINE_EXCEEDED",
        f"the request's deadline_ms {item.deadline_ms} passed before it could run (the "
        f"worker's clock read {now_ms:.0f}, {now_ms - item.deadline_ms:.0f} ms later).",
    )


def _by_signature(items: Sequence[WorkItem]) -> list[list[WorkItem]]:
    """Group requests that can share a run (equal non-batch shapes), oldest group first."""
    groups: dict[Any, list[WorkItem]] = {}
    for item in items:
        assert item.request is not None
        groups.setdefault(item.request.signature, []).append(item)
    return list(groups.values())
