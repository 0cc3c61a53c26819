"""Warmup: run the model on synthetic in-range inputs before the first read from the stream.

The first runs of a session allocate memory, pick kernels and (on GPUs) build engines; paying
that before reporting ready keeps the first real requests at steady-state latency. ``prepare``
is everything a worker does before it touches Redis: load, check, warm up, build the record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from producer.protocol.codec import ModelRef, RequestBody, as_tensor
from worker.answer.run import run_batch
from worker.config import WorkerConfig
from worker.errors import ModelError, Rejected
from worker.items import Admitted, Refused
from worker.model.device import Device, Turned
from worker.model.held import HeldModel
from worker.model.schema import Schema, ValidRequest
from worker.model.session import Model, OnnxModel, check_sha256, read_model_file
from worker.ops.record import build_record
from worker.pipeline.handler import load_handler
from worker.pipeline.hookpool import HookPool
from worker.pipeline.hooks import Pipeline, raw_schema
from worker.redisio.cancels import CancelCheck
from worker.redisio.stream import RawEntry

__all__ = ["Prepared", "prepare", "warm_up", "warm_up_pipeline"]

log = logging.getLogger(__name__)

_GRAPH_RUNS = 3  # runs per bound batch size at least, however few warmup.runs asks for


def warm_up(
    model: Model, schema: Schema, runs: int, extra_sizes: Sequence[int] = ()
) -> dict[str, Any]:
    """Run ``runs`` times at batch 1, at max_batch_size and at ``extra_sizes`` (the bound batch
    sizes: their buffers are made, and their CUDA graphs captured, on their first run); returns
    timings for the record."""
    sizes = sorted({1, schema.max_batch_size, *extra_sizes})
    if extra_sizes:  # a few runs per bucket: the capture, then replays at steady-state speed
        runs = max(runs, _GRAPH_RUNS)
    names = list(schema.output_names)
    timings: dict[int, list[float]] = {size: [] for size in sizes}
    started = time.perf_counter()
    for size in sizes:
        feeds = schema.synthetic_feeds(schema.fixed_batch or size)  # as the model takes them
        for _ in range(runs):
            t0 = time.perf_counter()
            try:
                model.run(feeds, names)
            except Exception as exc:  # the runtime's errors are untyped
                raise ModelError(
                    f"Warmup failed at batch size {size}: {exc}. Check [inputs.NAME] "
                    "min/max/warmup_shape so synthetic inputs are valid for the model."
                ) from exc
            timings[size].append((time.perf_counter() - t0) * 1000.0)
    total_ms = (time.perf_counter() - started) * 1000.0
    summary: dict[str, Any] = {"runs": runs, "batch_sizes": sizes, "total_ms": round(total_ms, 3)}
    for size, values in timings.items():
        if values:
            summary[f"batch_{size}"] = {
                "first_ms": round(values[0], 3),
                "last_ms": round(values[-1], 3),
                "min_ms": round(min(values), 3),
            }
    log.info("warmup done", extra={"fields": summary})
    return summary


def warm_up_pipeline(
    pipeline: Pipeline, intake: Schema, model: Model, runs: int, max_batch_size: int
) -> dict[str, Any]:
    """Warm the whole pipeline, pre, model and post, on the handler's ``warmup_inputs()`` (or
    synthetic raw inputs) at batch sizes 1 and ``max_batch_size``: the hooks' first calls
    (imports, caches, thread start-up) cost as much as a model's first runs. Any failure
    stops the worker, naming the hook."""
    raw = _warmup_request(pipeline, intake)
    rows = next(iter(raw.values())).shape[0]
    sizes = sorted({1, max(1, max_batch_size // rows)})
    started = time.perf_counter()
    for copies in sizes:
        for _ in range(max(1, runs)):
            _warm_once(pipeline, model, raw, copies)
    summary = {
        "requests": sizes,
        "runs": max(1, runs),
        "total_ms": round((time.perf_counter() - started) * 1000.0, 3),
    }
    log.info("pipeline warmup done", extra={"fields": summary})
    return summary


def _warmup_request(pipeline: Pipeline, intake: Schema) -> dict[str, np.ndarray]:
    try:
        made = pipeline.handler.warmup_inputs()
    except Exception as exc:  # the handler's own code
        raise ModelError(
            f"Config 'pipeline.handler' ({pipeline.handler.config.handler!r}): warmup_inputs() "
            f"raised {type(exc).__name__}: {exc}. Fix the handler."
        ) from exc
    if made is None:
        return intake.synthetic_feeds(1)
    try:
        inputs = {str(k): as_tensor(v) for k, v in dict(made).items()}
        return intake.validate(RequestBody(inputs=inputs)).inputs
    except (Rejected, TypeError, ValueError) as exc:
        raise ModelError(
            f"Config 'pipeline.handler' ({pipeline.handler.config.handler!r}): warmup_inputs() "
            f"returned what the handler's own inputs refuse: {exc}. Return one request's raw "
            "inputs, as a producer sends them."
        ) from exc


def _warm_once(pipeline: Pipeline, model: Model, raw: dict[str, np.ndarray], copies: int) -> None:
    entry = RawEntry(b"0-0", {})
    items = [
        Admitted(entry, f"warmup-{i}", _raw_request(raw), CancelCheck()) for i in range(copies)
    ]
    prepared = pipeline.finish_preprocess(pipeline.start_preprocess(list(items)))
    ready = [i for i in prepared if type(i) is Admitted]
    if len(ready) != len(prepared):
        refused = next(i for i in prepared if type(i) is Refused)
        raise ModelError(
            f"Warmup: the pipeline's preprocess failed on warmup_inputs(): {refused.error}"
        )
    names = list(pipeline.schema.output_names)
    outcomes = run_batch(model, pipeline.schema, ready, names)
    failed = next((o.error for o in outcomes if o.error is not None), None)
    if failed is not None:
        raise ModelError(f"Warmup: the model failed on preprocessed warmup_inputs(): {failed}")
    for result in pipeline.postprocess(outcomes):
        if isinstance(result, Rejected):
            raise ModelError(
                f"Warmup: the pipeline's postprocess failed on warmup_inputs(): {result}"
            )


def _raw_request(raw: dict[str, np.ndarray]) -> ValidRequest:
    rows = next(iter(raw.values())).shape[0]
    return ValidRequest(raw, rows, (), ())


@dataclass(frozen=True, slots=True)
class Prepared:
    """A loaded, checked and warmed model: everything done before Redis is touched."""

    config: WorkerConfig
    model: OnnxModel | HeldModel  # HeldModel: one of several models (worker.fleet)
    schema: Schema
    model_ref: ModelRef
    record: dict[str, Any]
    pipeline: Pipeline | None = None
    intake: Schema | None = None  # what requests are admitted by: the pipeline's raw inputs

    @property
    def intake_schema(self) -> Schema:
        return self.intake or self.schema


def prepare(config: WorkerConfig, name: str, turns: Device | None = None) -> Prepared:
    """Load the handler and the model, derive their schemas, warm both up and build the
    validation record; with ``turns``, each warmup run takes a turn on that device (other
    models serve on it meanwhile)."""
    handler = None
    if config.pipeline is not None:  # first: a handler that cannot load costs no model load
        handler = load_handler(config.pipeline, config.source)
    model_file = read_model_file(config.model.path)
    check_sha256(model_file, config.model.sha256)
    model = OnnxModel(config.model, config.batching.max_batch_size)
    if config.model.sha256:  # hashed, then loaded by path: hash again to close the gap
        check_sha256(read_model_file(config.model.path), config.model.sha256)
    schema = Schema(model.inputs, model.outputs, config)
    runs: Model = model if turns is None else Turned(model, turns)
    warmup = warm_up(runs, schema, config.warmup.runs, model.buckets)
    pipeline = intake = None
    if handler is not None:
        intake = raw_schema(handler, schema, config)
        pool = HookPool(handler.config.threads, handler.config.timeout_s)
        pipeline = Pipeline(handler, schema, pool)
        try:
            warmup["pipeline"] = warm_up_pipeline(
                pipeline, intake, runs, config.warmup.runs, config.batching.max_batch_size
            )
        except BaseException:
            pool.close()  # a version that fails here is dropped: its threads go with it
            raise
    shrink = schema.synthetic_feeds(schema.fixed_batch or 1)
    if turns is None:
        model.shrink_arena(shrink)  # shared arena only
    else:
        with turns.turn(1):
            model.shrink_arena(shrink)
    record = build_record(name, config, model, model_file, schema, warmup)
    if handler is not None:
        record["pipeline"] = handler.record()
    ref = ModelRef(
        config.model.name,
        config.model.version,
        model_file.sha256,
        None if handler is None else handler.ref,
    )
    return Prepared(config, model, schema, ref, record, pipeline, intake)
