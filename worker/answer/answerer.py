"""Answering a batch: every item becomes its finish step, with the admitted ones run first.

This is the one place where replies and finish steps (``worker.redisio.stream.Finish``) are built. A
refused item is answered with its error; a dead letter is copied to the dead-letter stream (and
answered when it has a rid); an admitted one is answered CANCELLED or DEADLINE_EXCEEDED when
that is already known, else run with the requests of its shape (``worker.answer.run``) and answered
with its outputs or the error it alone caused. The ok replies of one run are encoded together,
so what they share is packed once; when that fails, each alone, and a reply UTF-8 cannot encode
(an output holding a lone surrogate) is answered INFERENCE_FAILED on its own. A reply over the
bound its Redis takes (``worker.answer.replybound``) is answered TOO_LARGE on its own; error
replies go compact and short-lived while Redis memory is high (``worker.answer.pressure``). The
writer then finishes the whole batch in one round trip.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import redis

from producer.protocol.codec import ErrorInfo
from producer.protocol.errors import WireFormatError
from producer.protocol.replies import ReplyEncoder
from worker.answer import parts
from worker.answer.assemble import FeedBuffers
from worker.answer.pressure import MemoryPressure, compact_error, compact_ttl
from worker.answer.replybound import (
    HEADROOM_BYTES,
    ReplyBound,
    numeric_bytes,
    run_fits,
    too_large,
)
from worker.answer.run import run_batch
from worker.answer.unicode import unencodable
from worker.answer.writer import Batch
from worker.errors import Rejected
from worker.events import Events
from worker.intake.leases import Stuck
from worker.items import Admitted, DeadLetter, Item, Outcome, Refused
from worker.model.held import HeldModel
from worker.model.schema import Schema
from worker.model.session import OnnxModel
from worker.pipeline.hooks import Pipeline
from worker.redisio import cancels
from worker.redisio.stream import Finish, RawEntry, RequestStream

__all__ = ["Answerer"]

log = logging.getLogger(__name__)


class Answerer:
    """Answers batches for one worker, on the main thread (its input buffers are reused)."""

    def __init__(
        self,
        model: OnnxModel | HeldModel,
        schema: Schema,
        stream_of: Callable[[str], RequestStream],
        encoder: ReplyEncoder,
        reply_ttl_s: int,
        events: Events,
        stuck: Stuck,
        pipeline: Pipeline | None = None,
        max_reply_bytes: int = 0,
        pressure: MemoryPressure | None = None,
    ) -> None:
        self.model = model
        self.pipeline = pipeline
        self.schema = schema
        self.stream_of = stream_of  # a shard's stream, for the cancel recheck (``ShardMap.stream``)
        self.encoder = encoder
        self.reply_ttl_s = reply_ttl_s
        self.events = events
        self.buffers = FeedBuffers(max(schema.max_batch_size, schema.fixed_batch or 0))
        self.stuck = stuck  # the service's: marks each run, for the lease keepers

        # the largest reply each shard's Redis takes (limits.max_reply_bytes, or learned)
        def client_of(tag: str) -> redis.Redis | None:
            return None if stream_of is None else stream_of(tag).client

        self.bound = ReplyBound(client_of, max_reply_bytes)
        self._least = 0  # the batch's smallest bound (``answer``)
        # Redis memory: error replies go compact past a watermark (worker/answer/pressure.py)
        self.pressure = pressure or MemoryPressure(client_of)

    def answer(self, batch: Sequence[Item]) -> Batch:
        """The batch's finish steps, with what metrics want to know once it is written."""
        started_ms = time.time() * 1000.0
        runs: list[tuple[int, float]] = []
        try:
            # the smallest reply bound of the batch's shards: one check per reply against it
            self._least = min(
                (self.bound.of(t).nbytes for t in {i.entry.shard for i in batch}), default=0
            )
            finishes = self._answer(batch, started_ms, runs)
        except Exception:  # a bug here must not stop the worker or leave requests unanswered
            log.exception("batch failed unexpectedly; answering its requests INTERNAL")
            error = Rejected("INTERNAL", "the worker failed on this batch; retry.", retryable=True)
            finishes = []
            for item in batch:  # a part's error waits for its request's other parts
                if isinstance(item, Admitted) and item.part is not None:
                    finishes += self._refusals([Outcome(item, None, error, 0, 0.0)], started_ms)
                else:
                    finishes.append(self._failure(item, error, started_ms))
        counted = [i for i in batch if not isinstance(i, Admitted) or i.counted]  # not tails
        return Batch(
            finishes,
            queued_s=[max(started_ms - item.entry.id_ms, 0.0) / 1000.0 for item in counted],
            decode_s=[item.decode_ms / 1000.0 for item in counted],
            runs=runs,
            classes=[parts.class_of(item) for item in counted],
        )

    def _answer(
        self, batch: Sequence[Item], started_ms: float, runs: list[tuple[int, float]]
    ) -> list[Finish]:
        finishes: list[Finish] = []
        runnable: list[Admitted] = []
        for item in batch:
            match item:
                case Admitted():
                    error = cancels.already(item) or _expired(item) or parts.failed(item)
                    if error is None:
                        runnable.append(item)
                    else:
                        finishes += self._refusals([Outcome(item, None, error, 0, 0.0)], started_ms)
                case Refused():
                    finishes.append(self._refusal(item, item.error, started_ms))
                case DeadLetter():
                    finishes.append(self._dead_letter(item, item.error, started_ms))
        for group in _by_signature(runnable):
            live = []
            for item in group:  # cancels and deadlines again, just before the run
                error = cancels.already(item) or _expired(item) or parts.failed(item)
                if error is not None:
                    finishes += self._refusals([Outcome(item, None, error, 0, 0.0)], started_ms)
                else:
                    live.append(item)
            if live:
                finishes += self._run(live, started_ms, runs)
        return finishes

    def _run(
        self, items: list[Admitted], started_ms: float, runs: list[tuple[int, float]]
    ) -> list[Finish]:
        check = cancels.RunCheck(self.stream_of, items)
        self.stuck.run_started()
        try:
            outcomes = run_batch(
                self.model,
                self.schema,
                items,
                self._output_names(items),
                runs=runs,
                buffers=self.buffers,
                pad_rows=self.model.padded_rows,
                events=self.events,
            )
        finally:
            self.stuck.run_ended()
            check.run_ended()
        return self._finish_run(outcomes, started_ms, check)

    def _output_names(self, items: Iterable[Admitted]) -> list[str]:
        wanted = {n for item in items for n in item.request.outputs}
        return [n for n in self.schema.output_names if n in wanted]

    def _finish_run(
        self, outcomes: Sequence[Outcome], started_ms: float, check: cancels.RunCheck
    ) -> list[Finish]:
        """The finish steps of a sub-batch's outcomes; the ok replies of each run are encoded
        together (what they share is packed once)."""
        finishes = []
        runs: dict[tuple[int, float], list[Outcome]] = {}
        for outcome in parts.join(self._cancelled_after(outcomes, check)):
            item = outcome.item
            if outcome.error is None:
                runs.setdefault((outcome.batch_rows, outcome.inference_ms), []).append(outcome)
                continue
            if outcome.error.code == "INFERENCE_FAILED":
                log.warning(
                    "request failed in the runtime",
                    extra={"fields": {"rid": item.rid, "error": outcome.error.message}},
                )
            finishes.append(self._refusal(item, outcome.error, started_ms, outcome.inference_ms))
        if self.pipeline is not None:
            return finishes + self._finish_pipeline(runs, started_ms)
        for (rows, inference_ms), done in runs.items():
            finishes += self._ok_run(done, rows, round(inference_ms, 3), started_ms)
        return finishes

    def _cancelled_after(
        self, outcomes: Sequence[Outcome], check: cancels.RunCheck
    ) -> list[Outcome]:
        """``outcomes``, those whose cancel check answered after the run started CANCELLED."""
        kept = []
        for o in outcomes:
            if not check.cancelled(o.item):
                kept.append(o)
                continue
            self.events.cancelled_after_run()
            kept.append(
                Outcome(o.item, None, cancels.cancelled_error(), o.batch_rows, o.inference_ms)
            )
        return kept

    def _refusals(self, outcomes: Sequence[Outcome], started_ms: float) -> list[Finish]:
        """Error outcomes refused before a run: a part's only once its request is joined."""
        return [self._refusal(o.item, o.error, started_ms) for o in parts.join(outcomes) if o.error]

    def _ok_run(
        self, done: Sequence[Outcome], rows: int, inference_ms: float, started_ms: float
    ) -> list[Finish]:
        """The ok replies of one run, encoded together. Only when that fails (an output holds
        a string UTF-8 cannot encode) is each encoded alone, so that the request at fault is
        answered with its own error and its run-mates as usual."""
        finishes = []
        fits = not done or run_fits(done[0].outputs or {}, rows, self._least)  # the common case
        if not fits:
            fitting = []
            for outcome in done:  # one too large for Redis is answered before it is joined
                over = self._over_bound(outcome.item, outcome.outputs or {})
                if over is None:
                    fitting.append(outcome)
                else:
                    error, taken = over, outcome.inference_ms
                    finishes.append(self._refusal(outcome.item, error, started_ms, taken))
            done = fitting
        requests = [
            (o.item.rid, o.outputs or {}, _queued_ms(o.item.entry, started_ms), o.item.meta_raw)
            for o in done
        ]
        replies: list[bytes | None]
        try:
            replies = list(
                self.encoder.encode_run(requests, batch_rows=rows, inference_ms=inference_ms)
            )
        except WireFormatError:
            replies = [self._encode_alone(request, rows, inference_ms) for request in requests]
        for outcome, reply in zip(done, replies, strict=True):
            item = outcome.item
            if reply is None:
                error = unencodable("the model's", outcome.outputs or {}, item.rid)
                finishes.append(self._refusal(item, error, started_ms, outcome.inference_ms))
            elif fits:
                finishes.append(self._finish(item, reply, "OK", item.reply_ttl_s))
            else:
                finishes.append(self._ok(item, reply, outcome.outputs or {}, started_ms))
        return finishes

    def _encode_alone(
        self,
        request: tuple[str, Mapping[str, np.ndarray], float, bytes | None],
        rows: int,
        inference_ms: float,
    ) -> bytes | None:
        """One request's ok reply as ``encode_run`` writes it; None when it cannot be encoded."""
        try:
            [reply] = self.encoder.encode_run([request], batch_rows=rows, inference_ms=inference_ms)
        except WireFormatError:
            return None
        return reply

    def _finish_pipeline(
        self, runs: dict[tuple[int, float], list[Outcome]], started_ms: float
    ) -> list[Finish]:
        """The ok outcomes' replies through the pipeline's postprocess: each request's own
        outputs, or the error its postprocess alone caused; timings add its pre and post."""
        assert self.pipeline is not None
        done = [o for group in runs.values() for o in group]
        post_started = time.perf_counter()
        results = self.pipeline.postprocess(done)
        post_ms = (time.perf_counter() - post_started) * 1000.0 / max(len(done), 1)
        finishes = []
        for outcome, result in zip(done, results, strict=True):
            item = outcome.item
            if isinstance(result, Rejected):
                if result.code == "INFERENCE_FAILED":
                    log.warning(
                        "postprocess failed on a request",
                        extra={"fields": {"rid": item.rid, "error": result.message}},
                    )
                finishes.append(self._refusal(item, result, started_ms, outcome.inference_ms))
                continue
            timings = {
                "queued": _queued_ms(item.entry, started_ms),
                "inference": round(outcome.inference_ms, 3),
                "preprocess": round(item.preprocess_ms, 3),
                "postprocess": round(post_ms, 3),
            }
            try:
                reply = self.encoder.encode(
                    item.rid,
                    outputs=result,
                    batch_rows=outcome.batch_rows,
                    timings_ms=timings,
                    meta_raw=item.meta_raw,
                )
            except WireFormatError:  # postprocess refuses such outputs; kept per request anyway
                error = unencodable("the pipeline's postprocess", result, item.rid)
                finishes.append(self._refusal(item, error, started_ms, outcome.inference_ms))
                continue
            finishes.append(self._ok(item, reply, result, started_ms))
        return finishes

    # -- the reply bound -------------------------------------------------------------------------

    def _ok(
        self, item: Admitted, reply: bytes, outputs: Mapping[str, Any], started_ms: float
    ) -> Finish:
        """``item`` answered with its ok ``reply``, or TOO_LARGE when Redis would not take it."""
        if len(reply) <= self._least:  # the common case: one compare
            return self._finish(item, reply, "OK", item.reply_ttl_s)
        bound = self.bound.of(item.entry.shard)
        if len(reply) <= bound.nbytes:
            return self._finish(item, reply, "OK", item.reply_ttl_s)
        error = too_large(len(reply), bound, self._output_sizes(outputs))
        return self._refusal(item, self._too_large_logged(item, error), started_ms)

    def _over_bound(self, item: Admitted, outputs: Mapping[str, Any]) -> Rejected | None:
        """TOO_LARGE when ``outputs`` alone are over the reply bound, so that such a reply is
        never built (its bytes would be joined only to be refused); None when they fit."""
        if numeric_bytes(outputs) + HEADROOM_BYTES <= self._least:
            return None  # the common case, without encoding anything
        bound = self.bound.of(item.entry.shard)
        if numeric_bytes(outputs) + HEADROOM_BYTES <= bound.nbytes:
            return None
        sizes = self._output_sizes(outputs)
        size = sum(sizes.values()) + len(item.meta_raw or b"")
        if size <= bound.nbytes:
            return None
        return self._too_large_logged(item, too_large(size, bound, sizes))

    def _output_sizes(self, outputs: Mapping[str, Any]) -> dict[str, int]:
        """Each output's bytes in a reply; 0 for one the encoder refuses (answered apart)."""
        sizes = {}
        for name, array in outputs.items():
            try:
                sizes[name] = self.encoder.tensor_bytes(name, array)
            except (WireFormatError, UnicodeEncodeError, ValueError, TypeError):
                sizes[name] = 0
        return sizes

    @staticmethod
    def _too_large_logged(item: Admitted, error: Rejected) -> Rejected:
        log.warning(
            "a reply is too large for Redis; answering TOO_LARGE",
            extra={"fields": {"rid": item.rid, "error": error.message}},
        )
        return error

    # -- replies without outputs ---------------------------------------------------------------

    def _failure(self, item: Item, error: Rejected, started_ms: float) -> Finish:
        """``item`` answered with ``error`` whatever its variant (a dead letter without a rid
        has no reply key: the dead-letter stream is its answer)."""
        if isinstance(item, DeadLetter):
            return self._dead_letter(item, error, started_ms)
        return self._refusal(item, error, started_ms)

    def _refusal(
        self,
        item: Admitted | Refused,
        error: Rejected,
        started_ms: float,
        inference_ms: float = 0.0,
    ) -> Finish:
        if self.pressure.compact(item.entry.shard):  # no meta, a short message and TTL
            reply = self._error_reply(
                item.rid, item.entry, None, compact_error(error), started_ms, inference_ms
            )
            return self._finish(item, reply, error.code, compact_ttl(item.reply_ttl_s))
        reply = self._error_reply(
            item.rid, item.entry, item.meta_raw, error, started_ms, inference_ms
        )
        return self._finish(item, reply, error.code, item.reply_ttl_s)

    def _dead_letter(self, item: DeadLetter, error: Rejected | None, started_ms: float) -> Finish:
        log.warning(
            "dead-lettered an entry",
            extra={
                "fields": {
                    "entry": item.entry.entry_id.decode(),
                    "rid": item.rid,
                    "reason": item.reason,
                }
            },
        )
        if item.rid is None:  # no reply key can be named: the dead-letter stream is its answer
            return self._finish(item, None, "DEAD_LETTER", dead_reason=item.reason)
        assert error is not None
        ttl_s = None
        if self.pressure.compact(item.entry.shard):
            error, ttl_s = compact_error(error), compact_ttl(None)
        reply = self._error_reply(item.rid, item.entry, None, error, started_ms, 0.0)
        return self._finish(item, reply, error.code, ttl_s, dead_reason=item.reason)

    def _finish(
        self,
        item: Item,
        reply: bytes | None,
        code: str,
        requested_ttl_s: int | None = None,
        dead_reason: str | None = None,
    ) -> Finish:
        """The one place a finish step is built: ``item``'s entry answered with ``reply`` (None:
        no reply key to write) in its own shard, dead-lettered too with a ``dead_reason``."""
        return Finish(
            item.entry.entry_id,
            item.rid,
            reply,
            self._ttl(requested_ttl_s),
            dead_reason,
            code,
            item.entry.shard,
        )

    def _error_reply(
        self,
        rid: str,
        entry: RawEntry,
        meta_raw: bytes | None,
        error: Rejected,
        started_ms: float,
        inference_ms: float,
    ) -> bytes:
        info = ErrorInfo(error.code, error.message, error.retryable)
        timings = {"queued": _queued_ms(entry, started_ms), "inference": round(inference_ms, 3)}
        try:
            return self.encoder.encode(rid, error=info, timings_ms=timings, meta_raw=meta_raw)
        except WireFormatError:  # a message UTF-8 cannot encode (a hook's ValueError's, say)
            message = error.message.encode("utf-8", "backslashreplace").decode()
            info = ErrorInfo(error.code, message, error.retryable)
            return self.encoder.encode(rid, error=info, timings_ms=timings, meta_raw=meta_raw)

    def _ttl(self, requested_s: int | None) -> int:
        """The reply's TTL: the request's own when it asks for less than the worker's."""
        own = self.reply_ttl_s
        return min(requested_s, own) if requested_s else own


def _queued_ms(entry: RawEntry, started_ms: float) -> float:
    """From enqueue (the stream id's time) to the batch's start, as replies report it."""
    return round(max(started_ms - entry.id_ms, 0.0), 3)


def _expired(item: Admitted) -> Rejected | None:
    now_ms = time.time() * 1000.0
    if item.deadline_ms is None or item.deadline_ms > now_ms:
        return None
    return Rejected(
        "DEADLINE_EXCEEDED",
        f"the request's deadline_ms {item.deadline_ms} passed before it could run (the "
        f"worker's clock read {now_ms:.0f}, {now_ms - item.deadline_ms:.0f} ms later).",
    )


def _by_signature(items: Sequence[Admitted]) -> list[list[Admitted]]:
    """Group requests that can share a run (equal non-batch shapes), oldest group first."""
    groups: dict[Any, list[Admitted]] = {}
    for item in items:
        groups.setdefault(item.request.signature, []).append(item)
    return list(groups.values())
