"""The pipeline: a handler's hooks around the model, one request's failure its own
(docs/protocol.md section 11).

``preprocess`` turns each admitted request's raw inputs (already checked against the handler's
declared ``inputs``) into model inputs, which are then checked against the model's schema
(dtype, shape, rows, ranges, non-finite values) before any batch is assembled. ``postprocess``
turns each request's rows of the model's outputs into the reply's outputs, which are checked
too. Hooks run on the hook pool (``worker.pipeline.hookpool``). A hook that raises ``ValueError``
answers
its request ``INVALID_INPUT`` with the exception's message; anything else it raises, a return
value of the wrong form, or a call past ``pipeline.timeout_s`` answers it ``INFERENCE_FAILED``.

A handler may also offer batch forms, ``preprocess_batch(list)`` and ``postprocess_batch``, for
vectorised work (a tokenizer's batch encode). A batch call that fails is split in halves and
each half called again, down to single requests, as failing runs are (``worker.answer.run``): only
the requests that fail alone are answered with an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from producer.protocol.codec import RequestBody, as_tensor, wire_dtype
from producer.protocol.text import utf8_encodable
from worker.config import WorkerConfig
from worker.errors import Rejected
from worker.events import NO_EVENTS, Events
from worker.items import Admitted, Item, Outcome, Refused
from worker.model.schema import Schema, ValidRequest
from worker.pipeline.handler import Handler
from worker.pipeline.hookpool import Call, HookPool, HookTimeout

__all__ = ["Pipeline", "raw_schema"]

Inputs = dict[str, np.ndarray]
Result = Any  # a hook's checked result, or the Rejected that answers its request


def raw_schema(handler: Handler, model_schema: Schema, config: WorkerConfig) -> Schema:
    """The schema requests are admitted by: the handler's declared raw inputs, and as reply
    outputs its declared ones (the model's without a postprocess; any name when a postprocess
    declares none, checked once it has run)."""
    plain = dataclasses.replace(config, inputs={}, outputs={})
    schema = Schema(handler.inputs, (), plain)
    if handler.outputs is not None:
        schema.outputs = {s.name: s for s in handler.outputs}
    elif not handler.has_postprocess:
        schema.outputs = dict(model_schema.outputs)
    else:
        schema.open_outputs = True
    schema.output_names = tuple(schema.outputs)
    return schema


@dataclass(slots=True)
class Pending:
    """A read's preprocessing in flight: its calls and which items each covers."""

    items: list[Item]
    calls: list[tuple[Call, list[int]]]


class Pipeline:
    """Runs a handler's hooks on the pool and checks what they return."""

    def __init__(
        self, handler: Handler, model_schema: Schema, pool: HookPool, events: Events = NO_EVENTS
    ) -> None:
        self.handler = handler
        self.schema = model_schema
        self.pool = pool
        self.events = events

    # -- preprocess ---------------------------------------------------------------------------

    def start_preprocess(self, items: list[Item]) -> Pending:
        """Submit the admitted items' preprocessing (one call each, or a batch call per pool
        thread when the handler has ``preprocess_batch``); the rest pass through."""
        todo = [i for i, item in enumerate(items) if type(item) is Admitted]
        raws = {i: _raw_inputs(items[i]) for i in todo}
        calls = []
        if self.handler.preprocess_batch is not None and len(todo) > 1:
            for part in _parts(todo, self.pool.threads):
                chunk = [raws[i] for i in part]
                calls.append((self.pool.submit(self._pre_many, chunk, label="preprocess"), part))
        else:
            calls = [
                (self.pool.submit(self._pre_many, [raws[i]], label="preprocess"), [i]) for i in todo
            ]
        return Pending(items, calls)

    def finish_preprocess(self, pending: Pending) -> list[Item]:
        """Wait for a read's preprocessing; each admitted item comes back with its model
        inputs, or refused with the error its own hook call gave."""
        self.pool.wait([call for call, _ in pending.calls])
        items = list(pending.items)
        for call, indexes in pending.calls:
            results = _results(call, len(indexes))
            per_ms = call.wall_s * 1000.0 / max(len(indexes), 1)
            self.events.hook_ran("preprocess", len(indexes), call.wall_s, call.cpu_s)
            for index, result in zip(indexes, results, strict=True):
                items[index] = _preprocessed(items[index], result, per_ms)  # type: ignore[arg-type]
        return items

    def _pre_many(self, raws: list[Inputs]) -> list[Result]:
        """On a pool thread: preprocess ``raws``, each result checked or a Rejected."""
        batch = self.handler.preprocess_batch
        if batch is None or (len(raws) == 1 and self.handler.preprocess is not None):
            return [self._pre_one(raw) for raw in raws]
        return _bisect(batch, (raws,), self._pre_batch_one, self._check_model_inputs, "preprocess")

    def _pre_one(self, raw: Inputs) -> Result:
        hook = self.handler.preprocess
        if hook is None:
            return self._pre_batch_one(raw)
        try:
            made = hook(raw)
        except Exception as exc:
            return _hook_error("preprocess", exc)
        return self._check_model_inputs(made, raw)

    def _pre_batch_one(self, raw: Inputs) -> Result:
        assert self.handler.preprocess_batch is not None
        return _single(
            self.handler.preprocess_batch, (raw,), self._check_model_inputs, "preprocess"
        )

    def _check_model_inputs(self, made: Any, raw: Inputs) -> Result:
        """What preprocess returned, as a request the model takes, or INFERENCE_FAILED."""
        if not isinstance(made, Mapping):
            return _wrong_form(
                "preprocess", f"returned {type(made).__name__}, not a dict of model inputs"
            )
        try:
            inputs = {str(name): as_tensor(value) for name, value in made.items()}
            valid = self.schema.validate(RequestBody(inputs=inputs))
            self.schema.check_values(valid)
        except Rejected as exc:
            return _wrong_form("preprocess", f"returned what the model cannot take: {exc.message}")
        except Exception as exc:  # as_tensor on something that is no array
            return _wrong_form("preprocess", f"returned a value that is no array: {exc}")
        rows = _rows(raw)
        if valid.rows != rows:
            return _wrong_form(
                "preprocess", f"returned {valid.rows} rows of model inputs for {rows} raw rows"
            )
        return valid

    # -- postprocess --------------------------------------------------------------------------

    def postprocess(self, outcomes: Sequence[Outcome]) -> list[Result]:
        """Each ok outcome's reply outputs (checked), or the Rejected that answers it."""
        if not self.handler.has_postprocess:
            return [_chosen(o.outputs or {}, o.item.wanted) for o in outcomes]
        args = [
            (o.outputs or {}, o.item.raw or {}, self._model_inputs(o.item.request))
            for o in outcomes
        ]
        if self.handler.postprocess_batch is not None and len(args) > 1:
            indexed = list(range(len(args)))
            parts = _parts(indexed, self.pool.threads)
            calls = [
                (
                    self.pool.submit(
                        self._post_many, [args[i] for i in part], urgent=True, label="postprocess"
                    ),
                    part,
                )
                for part in parts
            ]
        else:
            calls = [(self._submit_post([a]), [i]) for i, a in enumerate(args)]
        self.pool.wait([call for call, _ in calls])
        results: list[Result] = [None] * len(args)
        for call, indexes in calls:
            self.events.hook_ran("postprocess", len(indexes), call.wall_s, call.cpu_s)
            for index, result in zip(indexes, _results(call, len(indexes)), strict=True):
                results[index] = result
        return [
            r if isinstance(r, Rejected) else _chosen(r, o.item.wanted)
            for r, o in zip(results, outcomes, strict=True)
        ]

    def _submit_post(self, args: list[tuple[Inputs, Inputs, Inputs]]) -> Call:
        """Postprocessing goes ahead of queued preprocessing: the model's thread waits on it."""
        return self.pool.submit(self._post_many, args, urgent=True, label="postprocess")

    def _model_inputs(self, request: ValidRequest) -> Inputs:
        axes = self.schema.axes
        if axes.trivial:
            return request.inputs
        return axes.to_model(request.inputs, request.fixed or {})

    def _post_many(self, args: list[tuple[Inputs, Inputs, Inputs]]) -> list[Result]:
        batch = self.handler.postprocess_batch
        if batch is None or (len(args) == 1 and self.handler.postprocess is not None):
            return [self._post_one(*a) for a in args]
        columns = tuple(list(column) for column in zip(*args, strict=True))
        return _bisect(batch, columns, self._post_batch_one, self._check_reply, "postprocess")

    def _post_one(self, outputs: Inputs, raw: Inputs, model_inputs: Inputs) -> Result:
        hook = self.handler.postprocess
        if hook is None:
            return self._post_batch_one(outputs, raw, model_inputs)
        try:
            if self.handler.post_takes_model_inputs:
                made = hook(outputs, raw, model_inputs)
            else:
                made = hook(outputs, raw)
        except Exception as exc:
            return _hook_error("postprocess", exc)
        return self._check_reply(made, raw)

    def _post_batch_one(self, outputs: Inputs, raw: Inputs, model_inputs: Inputs) -> Result:
        assert self.handler.postprocess_batch is not None
        return _single(
            self.handler.postprocess_batch,
            (outputs, raw, model_inputs),
            self._check_reply,
            "postprocess",
        )

    def _check_reply(self, made: Any, raw: Inputs) -> Result:
        """What postprocess returned, as reply outputs the wire carries, or INFERENCE_FAILED."""
        if not isinstance(made, Mapping) or not made:
            return _wrong_form(
                "postprocess", f"returned {made!r:.80}, not a non-empty dict of reply outputs"
            )
        rows = _rows(raw)
        outputs = {}
        for name, value in made.items():
            try:
                arr = as_tensor(value)
            except Exception as exc:
                return _wrong_form("postprocess", f"output {name!r} is no array: {exc}")
            if not isinstance(name, str) or wire_dtype(arr) is None:
                return _wrong_form(
                    "postprocess", f"output {name!r} has dtype {arr.dtype}, which the wire lacks"
                )
            if arr.dtype.kind == "O" and not utf8_encodable(arr):
                return _wrong_form(
                    "postprocess", f"output {name!r} holds a string that is not valid Unicode"
                )
            if arr.ndim == 0 or arr.shape[0] != rows:
                return _wrong_form(
                    "postprocess",
                    f"output {name!r} has shape {list(arr.shape)}; it must lead with the "
                    f"request's {rows} rows",
                )
            outputs[name] = arr
        return outputs


def _raw_inputs(item: Item) -> Inputs:
    assert type(item) is Admitted
    return item.request.inputs


def _preprocessed(item: Admitted, result: Result, pre_ms: float) -> Item:
    """The item with its model inputs, or refused with its hook's error."""
    if isinstance(result, Rejected):
        return Refused(
            item.entry,
            item.rid,
            result,
            item.meta_raw,
            item.reply_ttl_s,
            item.decode_ms,
            item.deliveries,
        )
    raw = item.request
    return dataclasses.replace(
        item,
        request=result,
        raw=raw.inputs,
        wanted=raw.outputs or None,
        preprocess_ms=pre_ms,
    )


def _chosen(outputs: Mapping[str, np.ndarray], wanted: tuple[str, ...] | None) -> Result:
    """The outputs the request asked for; a name its reply lacks is INVALID_INPUT."""
    if not wanted:
        return dict(outputs)
    missing = [name for name in wanted if name not in outputs]
    if missing:
        return Rejected(
            "INVALID_INPUT",
            f"unknown output {missing[0]!r}; the pipeline answers {', '.join(outputs)}.",
        )
    return {name: outputs[name] for name in wanted}


def _bisect(
    hook: Callable[..., Any],
    columns: tuple[list[Any], ...],
    one: Callable[..., Result],
    check: Callable[[Any, Inputs], Result],
    stage: str,
) -> list[Result]:
    """A batch hook over ``columns`` (argument lists of equal length), halved on failure down
    to single requests (``one``); each result checked against its raw inputs."""
    count = len(columns[0])
    if count == 1:
        return [one(*(c[0] for c in columns))]
    raws = columns[1] if stage == "postprocess" else columns[0]
    try:
        made = hook(*columns)
        if not isinstance(made, Sequence) or len(made) != count:
            raise _WrongLength(f"returned {type(made).__name__} for {count} requests")
    except Exception:
        mid = count // 2
        return [
            *_bisect(hook, tuple(c[:mid] for c in columns), one, check, stage),
            *_bisect(hook, tuple(c[mid:] for c in columns), one, check, stage),
        ]
    return [check(m, raw) for m, raw in zip(made, raws, strict=True)]


class _WrongLength(Exception):
    """Raised when a batch hook returns a list of another length than it was given."""


def _single(
    hook: Callable[..., Any],
    args: tuple[Any, ...],
    check: Callable[[Any, Inputs], Result],
    stage: str,
) -> Result:
    """A batch hook called on one request: its error is that request's."""
    try:
        made = hook(*([a] for a in args))
    except Exception as exc:
        return _hook_error(stage, exc)
    if not isinstance(made, Sequence) or len(made) != 1:
        return _wrong_form(f"{stage}_batch", f"returned {type(made).__name__} for 1 request")
    raw = args[1] if stage == "postprocess" else args[0]
    return check(made[0], raw)


def _results(call: Call, count: int) -> list[Result]:
    """A call's results; a call that raised (a timeout, a bug) fails each of its requests."""
    try:
        results = call.future.result(timeout=0)
    except HookTimeout as exc:
        error = Rejected("INFERENCE_FAILED", f"{exc}.")
        return [error] * count
    except Exception as exc:
        error = Rejected("INTERNAL", f"the pipeline failed on this request: {exc}", True)
        return [error] * count
    return list(results)


def _hook_error(stage: str, exc: Exception) -> Rejected:
    if isinstance(exc, ValueError):
        return Rejected("INVALID_INPUT", str(exc) or f"{stage} refused this request.")
    return Rejected("INFERENCE_FAILED", f"{stage} raised {type(exc).__name__}: {exc}")


def _wrong_form(stage: str, problem: str) -> Rejected:
    return Rejected("INFERENCE_FAILED", f"the pipeline's {stage} {problem}.")


def _rows(inputs: Inputs) -> int:
    return next((a.shape[0] for a in inputs.values() if a.ndim), 1)


def _parts(indexes: list[int], count: int) -> list[list[int]]:
    """``indexes`` in ``count`` contiguous parts of near-equal length (none empty)."""
    count = max(1, min(count, len(indexes)))
    size, extra = divmod(len(indexes), count)
    parts, start = [], 0
    for k in range(count):
        stop = start + size + (k < extra)
        parts.append(indexes[start:stop])
        start = stop
    return parts
