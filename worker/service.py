"""The worker: load and warm up, report ready, then read, batch, run and answer until stopped.

The worker's path is five stages, each a module: ``read`` (the reading thread: stream reads,
reclaims, the hand-over), ``admit`` (an entry into an item: ``worker.items``), ``batcher`` (the
window), ``run`` (a sub-batch on the model) and ``answer`` (outcomes into replies and finish
steps), then the reply ``writer``, which finishes each batch in Redis. A request flows one way
through them; the one edge back is the writer releasing the leases of what it finished, as an
ack (``worker.answer.finisher``). What the stages share is handed down from here: the
``ShardMap`` (each shard's stream and leases, entered by the lanes, looked up by the answerer
and the writer) and the ``Stuck`` flag (marked by the answerer, read by the lease keepers).
``run()`` reads as the table of contents; this module wires the stages and owns the lifecycle.
Shutdown has one path: a signal sets ``stop``, the reading thread stops reading, and everything
already read is batched, run and answered before the worker exits. When Redis refuses or cannot
be reached meanwhile, the worker gives up after ``STOP_GRACE_S`` without a step forward
(``worker.ops.progress``): it cuts its Redis calls, leaves what it holds pending for another
worker to claim, says how many, and exits 0.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import redis

from producer.protocol.replies import ReplyEncoder
from producer.redisio.connection import redact_url
from producer.redisio.memory import MemoryReading, fuller
from producer.redisio.shards import read_shards
from producer.redisio.topology import Topology
from worker.answer.answerer import Answerer
from worker.answer.batcher import Batcher
from worker.answer.finisher import Finisher
from worker.answer.parts import class_rank, splittable
from worker.answer.pressure import MemoryPressure
from worker.answer.scheduler import LaneQueue
from worker.answer.writer import ReplyWriter
from worker.errors import WorkerError
from worker.events import Events, Fanout
from worker.intake.lanes import Lanes
from worker.intake.laneset import Weights
from worker.intake.leases import LeaseKeeper, Leases, Stuck
from worker.intake.read import Reader
from worker.intake.settings import IntakeSettings
from worker.intake.shardmap import ShardMap
from worker.items import Item
from worker.model.held import HeldModel
from worker.ops.memalarm import MemoryAlarm
from worker.ops.metrics import Metrics
from worker.ops.progress import GiveUpAfter, Progress, RunClock, cut_connections
from worker.ops.record import Registry
from worker.pipeline.prep import PrepStage
from worker.redisio.retry import OutageRetry, is_transient
from worker.redisio.stream import RequestStream
from worker.warmup import Prepared, prepare

__all__ = ["Prepared", "Worker", "prepare"]

log = logging.getLogger(__name__)

_POLL_S = 0.1  # how often an idle loop looks at the stop flag
_DAMAGE_SHOWN = 10  # the newest damage notes a worker record keeps, over all its shards
#: After a stop signal, how long the worker waits without a step forward (Redis refusing or
#: unreachable) before it gives up on what it holds.
STOP_GRACE_S = 3.0


class Worker:
    """Serves one model from its request stream as one consumer of the ``workers`` group.

    ``faults`` (``worker.ops.faults.FaultPoints``, built by the CLI) hears every event along with
    the metrics; without it the metrics alone do.
    """

    def __init__(
        self,
        prepared: Prepared,
        client: redis.Redis,
        *,
        burst: bool = False,
        metrics: Metrics | None = None,
        faults: Events | None = None,
        topology: Topology | None = None,
    ) -> None:
        cfg = prepared.config
        self.config = cfg
        self.model = prepared.model
        self.schema = prepared.schema
        self.model_ref = prepared.model_ref
        self.pipeline = prepared.pipeline
        self.name = prepared.record["name"]
        self.burst = burst
        self.stop = threading.Event()
        self.hard_stop = threading.Event()
        self.ready = threading.Event()  # set once the worker reads from the stream
        # One code path for a single Redis and a cluster: a client per shard (producer/topology)
        self.topology = topology or Topology(client)
        self.metrics = metrics or Metrics()
        self.progress = Progress()
        if self.pipeline is not None:
            pool = self.pipeline.pool
            self.progress.hooks_busy = lambda: pool.busy
        self.events: Events = Fanout(self.metrics, self.progress, *([faults] if faults else []))
        self.finished = threading.Event()  # set when run() returns or raises
        self._gave_up = False
        self._stop_timed = False  # request_stop's grace is counting
        # Called when a stop that gave up on Redis still cannot end (the CLI exits the process)
        self.abandon: Callable[[], None] | None = None
        model_client = self.topology.client(cfg.model.name)
        # Its own stop: it beats until the drain ends (``_drain`` closes it), not until ``stop``.
        self.registry = Registry(
            model_client, cfg.redis.prefix, prepared.record, on_beat=self._on_beat
        )
        # Reads of up to max_batch_size entries, two per lane at most, handed out by class,
        # minimum share and tenant weight (worker/answer/scheduler.py).
        self.queue = LaneQueue(cfg.scheduling, cfg.batching.max_batch_size)
        self.prep: PrepStage | None = None
        if self.pipeline is not None:
            self.pipeline.events = self.events
            self.prep = PrepStage(self.pipeline, self.queue)
        self.batcher = Batcher(
            self.queue,
            cfg.batching.max_batch_size,
            cfg.batching.max_wait_ms,
            adaptive=cfg.batching.adaptive_wait,
            # worker/answer/parts.py: not with a pipeline (its hooks take requests whole)
            split=cfg.scheduling.split_requests and splittable(self.pipeline, prepared.schema),
            events=self.events,
        )
        self.stuck: Stuck = RunClock(cfg.delivery.max_run_s, self.progress)
        if isinstance(self.model, HeldModel):  # the hung-run clock starts with the run itself,
            self.model.on_turn = self.stuck.run_started  # not with a load or a wait for a turn
        self.shards = ShardMap(cfg.model.name)
        self.lanes = Lanes(
            self.topology,
            cfg.model.name,
            IntakeSettings(
                prefix=cfg.redis.prefix,
                consumer=self.name,
                schema=prepared.intake_schema,
                max_request_bytes=cfg.limits.max_request_bytes,
                max_element_bytes=cfg.limits.max_element_bytes,
                read_count=cfg.batching.max_batch_size,
                claim_idle_ms=cfg.delivery.claim_idle_ms,
                max_deliveries=cfg.delivery.max_deliveries,
                out=self.prep or self.queue,
                stop=self.stop,
                events=self.events,
                burst=burst,
                stuck=self.stuck,
                on_retry=self.topology.follow,
            ),
            self.shards,
            max_lanes=cfg.scheduling.max_lanes,
            lane_idle_s=cfg.scheduling.lane_idle_s,
        )
        self._weights = Weights()  # P:{M}:weights, read on each beat for the scheduler
        # A new lane is learnt in lane_watch_ms (a beat asked for), not at the next heartbeat.
        self.lane_watch = self.lanes.watch(self.registry.beat_soon, cfg.scheduling.lane_watch_ms)
        # Redis memory as the answer path sees it: error replies compact and short-lived past
        # half of maxmemory, error-only batches held past 1.25 x (worker/answer/pressure.py)
        pressure = MemoryPressure(lambda tag: self.shards.stream(tag).client)
        self.answers = Answerer(
            self.model,
            self.schema,
            self.shards.stream,
            ReplyEncoder(self.model_ref, self.name, labelled=True),
            cfg.delivery.reply_ttl_s,
            self.events,
            self.stuck,
            self.pipeline,
            max_reply_bytes=cfg.limits.max_reply_bytes,
            pressure=pressure,
        )
        self.writer = ReplyWriter(
            Finisher(self.shards),
            self.hard_stop,
            self.stop,
            events=self.events,
            on_retry=self.topology.follow,
            record=self.registry,
            pressure=pressure,
        )
        self._memory_alarm = MemoryAlarm()
        self.metrics.describe(prepared.record)

    @property
    def served(self) -> dict[str, int]:
        """The requests finished here and the batches that finished any (``ReplyWriter``)."""
        return self.writer.served

    # The first shard's parts: one shard is the common case, and tests reach them here.
    @property
    def stream(self) -> RequestStream:
        return self.lanes.first.stream

    @property
    def reader(self) -> Reader:
        return self.lanes.first.reader

    @property
    def keeper(self) -> LeaseKeeper:
        return self.lanes.first.keeper

    @property
    def leases(self) -> Leases:
        return self.lanes.first.leases

    def _on_beat(self) -> None:
        """Heartbeat hook: follow the cluster and the shard list, then sample the streams. Each
        step runs even when one before it failed (one master away must not stop the others'
        sampling); the first failure is raised after, for the heartbeat to log once."""
        failure: Exception | None = None
        steps = (self.topology.refresh, self._follow_shards, self._sample_stream)
        for step in steps if self.topology.cluster else steps[1:]:
            try:
                step()
            except (redis.RedisError, WorkerError) as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def _follow_shards(self) -> None:
        """Serve the shards ``P:{M}:shards`` lists now (and those retiring) and the lanes their
        lane sets list, and hand the tenant weights to the scheduler, without a restart."""
        if self.stop.is_set():
            return  # draining: no lane joins now
        cfg = self.config
        prefix, model = cfg.redis.prefix, cfg.model.name
        try:
            shards = read_shards(self.topology.client(model), prefix, model)
        except redis.exceptions.NoPermissionError as exc:
            raise WorkerError(
                f"Redis refused reading the shard list ({exc}): the worker's ACL user needs "
                f"(%R~{prefix}:{{*}}:shards +lrange) (%R~{prefix}:{{*}}:retiring +smembers) "
                "(docs/security.md, 'Upgrading')"
            ) from exc
        before = set(self.lanes.tags())
        self.lanes.sync(shards.serve)
        for gone in before - set(self.lanes.tags()):
            self.metrics.shard_gone(gone)
        self.registry.update(shards=self.lanes.tags())  # the record says what it serves
        weights = self._weights.read(self.topology.client(model), prefix, model)
        if weights is not None:
            self.queue.set_weights(weights)

    def _sample_stream(self) -> None:
        """Each lane's stream state and Redis memory, for metrics and the log; lanes empty for
        long are removed there (``Lanes.sample``), and their series dropped."""
        fullest: MemoryReading | None = None
        per_lane, damage, failed = self.lanes.sample()  # one master away: the others sampled
        seen = set()
        for lane, stats in per_lane:
            labels = (lane.tag, lane.cls, lane.tenant or "")
            self.metrics.stream_seen(stats, time.time() * 1000.0, *labels)
            seen.add(labels)
            fullest = fuller(fullest, stats.memory)
        if failed is None:  # a lane not sampled for an outage keeps its last values
            self.metrics.keep_lanes(seen)
        self.metrics.memory_seen(fullest)
        self._memory_alarm.seen(fullest)
        self.registry.update(stages=self.metrics.stages.snapshot())  # for status --watch
        if damage:
            self.registry.update(damage=damage[-_DAMAGE_SHOWN:])
        if failed is not None:
            raise failed  # the heartbeat logs it once per outage

    def healthy(self) -> bool:
        """For /healthz: alive unless ``health_problem`` names one."""
        return self.health_problem() is None

    def health_problem(self) -> str | None:
        """Why /healthz fails, or None: a batch has run past ``delivery.max_run_s``; as many
        hook calls hang as the pipeline has threads; or the worker holds work and has not
        moved for longer than ``claim_idle_ms`` (Redis refusing or unreachable: the leases
        it keeps renewing keep other workers from what it holds). A restart is the cure."""
        if self.stuck.is_set():
            return (
                f"a batch has run longer than delivery.max_run_s ({self.stuck.max_run_s:g} s); "
                "its leases lapse so other workers can claim them"
            )
        if self.pipeline is not None and not self.pipeline.pool.healthy:
            return "every pipeline hook thread is stuck in a call past its timeout"
        return self.progress.stalled(
            self.config.delivery.claim_idle_ms, self._held() or self._holds_work()
        )

    def _held(self) -> int:
        return sum(len(lane.leases) for lane in self.lanes)

    def _holds_work(self) -> bool:
        """Entries read and waiting, or batches waiting to be written (leases aside)."""
        return not self._intake_empty() or self.batcher.holding or not self.writer.idle()

    def request_stop(self) -> None:
        """First call: stop reading and finish what is held, giving up on Redis after
        ``STOP_GRACE_S`` without a step forward. Second call: give up on Redis now."""
        if self._stop_timed:
            self._give_up(True)
            return
        self._stop_timed = True
        self.stop_reading()  # the grace counts from the signal
        GiveUpAfter(self.progress, STOP_GRACE_S, self._give_up, self.finished, self.abandon).start()

    def stop_reading(self) -> None:
        """Stop reading and finish what is held, however long Redis takes: a new version takes
        over (``worker.fleet.reload``), and the process is not stopping."""
        self.progress.moved()
        self.stop.set()

    def _give_up(self, first: bool) -> None:
        """Stop waiting for Redis: end the retries and cut the calls in flight (a paused Redis
        would hold each for the socket timeout); what is held stays pending, for another
        worker to claim after ``claim_idle_ms``."""
        if first and not self._gave_up:
            self._gave_up = True
            log.warning(
                "stopping without waiting longer for Redis: no progress for %.0f s since the "
                "stop signal; the %d entries held stay pending, and another worker claims them "
                "after claim_idle_ms (%d ms)",
                self.progress.stalled_s(),
                self._held(),
                self.config.delivery.claim_idle_ms,
                extra={"fields": {"worker": self.name, "pending_left": self._held()}},
            )
        self.hard_stop.set()
        cut_connections(self.topology)

    def run(self) -> None:
        """Serve until stopped (or, in burst mode, until the stream is drained)."""
        try:
            self._run()
        finally:
            self.finished.set()

    def _run(self) -> None:
        if not self._start():
            return
        try:
            while not self.stop.is_set():
                batch = self.batcher.next_batch(_POLL_S)
                if batch:
                    self.process(batch)
                elif self.burst and self._drained():
                    break
        except WorkerError:
            if not self._gave_up:
                raise  # given up as asked: the drain below and _raise_failure say what is left
        finally:
            self.ready.clear()
            self._drain()
        self._raise_failure()

    def _start(self) -> bool:
        """Reach Redis (riding out an outage), then start the threads and report ready; False
        when stopped before Redis could be reached."""
        starting = OutageRetry(
            "starting up",
            give_up=self.stop,
            events=self.events,
            on_retry=self.topology.follow,
            where=redact_url(self.config.redis.url),
        )
        try:
            starting.call(self.topology.refresh)
            starting.call(self.stream.ensure_group)
            starting.call(self.lane_watch.poll)  # sizes first: a lane added after is seen
            starting.call(self._follow_shards)
            if not starting.call(self.registry.beat_first) and not starting.call(
                lambda: self.registry.take_over_name(self.stop)
            ):
                log.info("stopped while starting; nothing was read")
                return False
            starting.call(self._sample_stream)
            for lane in self.lanes:  # the reply bound, read now rather than at a first batch
                starting.call(functools.partial(self.answers.bound.of, lane.key))
        except (redis.RedisError, OSError) as exc:
            if not (self.stop.is_set() and is_transient(exc)):
                raise  # a refusal (a wrong password, a missing permission) is not an outage
            # Stopped while waiting for Redis: nothing was read, so nothing is left to answer.
            if self.registry.published:  # it went out before Redis went away
                self.registry.remove()
            log.info("stopped before Redis could be reached; nothing was read")
            return False
        self.registry.start()
        if self.lane_watch.interval_s > 0:
            self.lane_watch.start()
        self.writer.start()
        if self.prep is not None:
            self.prep.start()
        self.lanes.start()
        self.ready.set()
        # As /readyz says: warm, reading, and no batch hung past max_run_s
        self.metrics.ready.set_function(lambda: float(self.ready.is_set() and self.healthy()))
        streams = ", ".join(lane.stream.key for lane in self.lanes)
        log.info("ready", extra={"fields": {"worker": self.name, "stream": streams}})
        return True

    def _raise_failure(self) -> None:
        """Raise what stopped a thread, if one failed; not the Redis errors of a stop that gave
        up on Redis as asked (``_give_up`` said what it left)."""
        failures = self.lanes.failures()
        if self.writer.failure is not None:
            failures.append(("writer", self.writer.failure))
        for part, failure in failures:
            if self._gave_up and isinstance(failure, redis.RedisError | OSError):
                continue
            raise WorkerError(f"{part} failed: {failure}") from failure

    def _drained(self) -> bool:
        """Burst mode: nothing new to read, nothing pending on any consumer (the reader's
        ``idle``, worker/intake/read.py) and nothing held here."""
        return (
            self.lanes.idle()
            and self._intake_empty()
            and not self.batcher.holding
            and self.writer.idle()
        )

    def _intake_empty(self) -> bool:
        """Nothing read waits to be batched: not on the queue, nor being preprocessed."""
        return self.queue.empty() and (self.prep is None or self.prep.idle())

    def _drain(self) -> None:
        """Stop reading, then batch, run and answer every entry already read."""
        self.stop.set()
        self.registry.update(state="draining")
        self.registry.beat_soon()  # it keeps beating, as draining, until the drain ends
        clean = False
        try:
            while self.writer.failure is None and (
                self.lanes.reading() or not self._intake_empty() or self.batcher.holding
            ):
                batch = self.batcher.next_batch(0.05)
                if batch:
                    self._process_draining(batch)
            clean = self.writer.failure is None
        finally:
            if not clean:
                self.lanes.close_keepers()  # stop renewing: other workers may claim the rest
                self.registry.close(remove=False)  # it expires, still saying draining
        if not clean:
            return  # what is left stays pending in Redis; run() raises the writer's error
        if self.prep is not None and self.prep.is_alive():
            self.prep.close()
        if self.pipeline is not None:
            self.pipeline.pool.close()
        try:
            self._close_writer()
        finally:
            self.lanes.close_keepers()
            written = self.writer.failure is None
            if written and not self._gave_up:
                self.lanes.forget_self()
            self.registry.close(remove=written)  # ends the heartbeat, then removes the record
        log.info("stopped", extra={"fields": {"worker": self.name, **self.served}})

    def _close_writer(self) -> None:
        """Write what is queued, then stop the writer; a write that failed is not an error
        when the stop gave up on Redis as asked."""
        try:
            self.writer.close()
        except WorkerError:
            if not self._gave_up:
                raise

    def _process_draining(self, batch: Sequence[Item]) -> None:
        """``process``, which raises if the write failed on this thread: not an error when the
        stop gave up on Redis as asked."""
        try:
            self.process(batch)
        except WorkerError:
            if not self._gave_up:
                raise

    # -- one batch --------------------------------------------------------------------------

    def process(self, batch: Sequence[Item]) -> None:
        """Answer every item of the batch (worker/answer/answerer.py), then hand the finish steps
        to the writer, which finishes the batch in one round trip while the next one runs (or here,
        when no next one waits)."""
        if isinstance(self.model, HeldModel):  # its turn on the device goes by the batch's class
            self.model.batch_rank = lambda: min(class_rank(item) for item in batch)
        answered = self.answers.answer(batch)
        self.events.point("after_inference")
        self.writer.submit(answered, here=self._write_here(answered.runs))

    def _write_here(self, runs: Sequence[tuple[int, float]]) -> bool:
        """Write on this thread (worker/answer/writer.py) when no read waits to be batched and the
        batch ran for less than a typical write: its path is then mostly Redis and thread
        hand-offs, and the hand-off to the writer costs more than overlapping the write saves.
        A longer run means the model is the bottleneck, and no batch may wait on a write."""
        ran_s = sum(seconds for _, seconds in runs)
        return ran_s < self.writer.typical_s and self.queue.empty() and not self.batcher.holding
