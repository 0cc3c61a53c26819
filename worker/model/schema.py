"""The model's input schema, and the check every request passes before it may join a batch.

The schema comes from the model file (names, dtypes, fixed and symbolic dims) plus per-input
ranges from config. Rejections name the input, what was expected and what was received, with -1
for free dimensions, so a caller can fix the request without reading the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from producer.protocol.codec import RequestBody, wire_dtype
from worker.config import InputConfig, WorkerConfig
from worker.errors import ConfigError, ModelError, Rejected
from worker.model.axes import Axes
from worker.model.ranges import synthetic, value_range
from worker.model.session import TensorSpec

__all__ = ["InputRule", "Schema", "ValidRequest", "dtype_name"]

Signature = tuple[tuple[int, ...], ...]

_MAX_SHAPES_REMEMBERED = 1024  # distinct accepted request shapes whose checks are cached


@dataclass(frozen=True, slots=True)
class InputRule:
    """A model input with the value checks config adds to it."""

    spec: TensorSpec
    min: float | None
    max: float | None
    reject_non_finite: bool
    warmup_shape: tuple[int, ...] | None
    batch_axis: int | None = 0  # None: the input has no rows (all of it goes to every run)

    @property
    def is_float(self) -> bool:
        return self.spec.dtype.kind == "f"

    def describe(self) -> str:
        return f"{self.spec.name} ({dtype_name(self.spec.dtype)} {self.spec.shape})"


@dataclass(frozen=True, slots=True)
class ValidRequest:
    """A request that passed every check; ``signature`` groups requests that can share a run.

    ``inputs`` hold rows on axis 0 whatever axis the model keeps them on (``worker.model.axes``);
    ``fixed`` are the inputs without rows (``batch_axis = "none"``), whose values are part of
    the signature, so that only requests that sent equal ones share a run.
    """

    inputs: dict[str, np.ndarray]
    rows: int
    signature: Signature
    outputs: tuple[str, ...]
    fixed: Mapping[str, np.ndarray] | None = None
    first_row: int = 0  # of the whole request, when this is a part of it (worker/answer/parts.py)


class Schema:
    """Checks requests against the model and config; built once at start-up."""

    def __init__(
        self,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        config: WorkerConfig,
    ) -> None:
        self.max_batch_size = config.batching.max_batch_size
        self.axes = Axes.from_config(config, inputs, outputs)
        self.fixed_batch = _check_batchable(inputs, outputs, self.max_batch_size, self.axes)
        _check_input_config(config.inputs, inputs)
        self.inputs = {
            s.name: _rule(
                s,
                config.inputs.get(s.name),
                config.limits.reject_non_finite,
                self.axes.input_axis(s.name),
            )
            for s in inputs
        }
        self.outputs = {s.name: s for s in outputs}
        self.output_names = tuple(self.outputs)
        # A pipeline whose postprocess declares no outputs: requested names are checked once
        # it has run (worker/pipeline/hooks.py)
        self.open_outputs = False
        self._accepted: dict[Any, tuple[Signature, tuple[str, ...]]] = {}
        self._value_checked = [
            (name, rule)
            for name, rule in self.inputs.items()
            if rule.min is not None
            or rule.max is not None
            or (rule.is_float and rule.reject_non_finite)
        ]

    # -- per request ------------------------------------------------------------------------

    def validate(self, body: RequestBody) -> ValidRequest:
        """Check names, dtypes, shapes, rows and outputs; raise Rejected with the exact reason.

        Values (ranges, NaN and infinity) are checked per batch by ``screen``, before the run.
        A request shaped like one accepted before (same names, dtypes, ranks, non-batch dims and
        outputs) only needs its rows checked, which keeps steady traffic cheap.
        """
        key = (
            tuple(
                # dtype('O') is string or bytes alike: its wire name tells them apart
                (n, a.dtype.str if a.dtype.kind != "O" else wire_dtype(a), a.shape[1:], a.ndim)
                for n, a in body.inputs.items()
            ),
            body.outputs,
        )
        if not self.axes.trivial:
            return self._validate_axes(body)
        known = self._accepted.get(key)
        if known is not None:
            rows = self._check_rows(body.inputs)
            ordered = {name: body.inputs[name] for name in self.inputs}
            return ValidRequest(ordered, rows, known[0], known[1])
        valid = self._validate(body)
        if len(self._accepted) < _MAX_SHAPES_REMEMBERED:
            self._accepted[key] = (valid.signature, valid.outputs)
        return valid

    def _validate(self, body: RequestBody) -> ValidRequest:
        self._check_names(body.inputs)
        rows = self._check_rows(body.inputs)
        symbols: dict[str, tuple[str, int]] = {}
        ordered = {}
        for name, rule in self.inputs.items():
            arr = body.inputs[name]
            _check_dtype_and_shape(rule, arr, symbols)
            ordered[name] = arr
        outputs = self._check_outputs(body.outputs)
        signature = tuple(a.shape[1:] for a in ordered.values())
        return ValidRequest(ordered, rows, signature, outputs)

    def _validate_axes(self, body: RequestBody) -> ValidRequest:
        """``validate`` for a model with rows off axis 0 or inputs without rows: every check,
        each input's rows moved to axis 0, and unbatched values in the signature."""
        self._check_names(body.inputs)
        symbols: dict[str, tuple[str, int]] = {}
        batched: dict[str, np.ndarray] = {}
        fixed: dict[str, np.ndarray] = {}
        for name, rule in self.inputs.items():
            arr = body.inputs[name]
            if rule.batch_axis is None:
                _check_dtype_and_shape(rule, arr, symbols, skip_axis=None)
                _check_values(rule, arr)
                fixed[name] = arr
                continue
            if arr.ndim <= rule.batch_axis:
                raise Rejected(
                    "INVALID_INPUT",
                    f"input {name!r}: expected shape {rule.spec.shape} with its rows on axis "
                    f"{rule.batch_axis}, got {list(arr.shape)}.",
                )
            _check_dtype_and_shape(rule, arr, symbols, skip_axis=rule.batch_axis)
            batched[name] = np.moveaxis(arr, rule.batch_axis, 0)
        rows = self._check_rows(batched)
        outputs = self._check_outputs(body.outputs)
        signature = (
            *(a.shape[1:] for a in batched.values()),
            *((a.dtype.str, a.shape, _value_key(a)) for a in fixed.values()),
        )
        return ValidRequest(batched, rows, signature, outputs, fixed or None)

    def _check_names(self, given: Mapping[str, np.ndarray]) -> None:
        for name in given:
            if name not in self.inputs:
                raise Rejected(
                    "INVALID_INPUT",
                    f"unknown input {name!r}; the model takes {self._expected_inputs()}.",
                )
        for name, rule in self.inputs.items():
            if name not in given:
                raise Rejected("INVALID_INPUT", f"missing input {name!r}: {rule.describe()}.")

    def _expected_inputs(self) -> str:
        return ", ".join(rule.describe() for rule in self.inputs.values())

    def _check_rows(self, given: Mapping[str, np.ndarray]) -> int:
        counts = {}
        for name, arr in given.items():
            if arr.ndim == 0:
                raise Rejected(
                    "INVALID_INPUT",
                    f"input {name!r} is a scalar; expected shape {self.inputs[name].spec.shape}, "
                    "whose first dimension counts the request's rows.",
                )
            counts[name] = arr.shape[0]
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"{n} has {c}" for n, c in counts.items())
            raise Rejected(
                "INVALID_INPUT", f"inputs have unequal row counts ({listed}); they must match."
            )
        rows = next(iter(counts.values()))
        if rows < 1:
            names = ", ".join(repr(n) for n in counts)
            raise Rejected(
                "INVALID_INPUT",
                f"the request has 0 rows (first dimension of {names}); send at least 1.",
            )
        if rows > self.max_batch_size:
            raise Rejected(
                "TOO_LARGE",
                f"the request has {rows} rows; this worker's max_batch_size is "
                f"{self.max_batch_size}. Send at most {self.max_batch_size} rows a request: "
                "split larger inputs into several requests (each live worker's record, "
                "P:{M}:worker:NAME, gives its batching.max_batch_size).",
            )
        return rows

    def _check_outputs(self, wanted: tuple[str, ...] | None) -> tuple[str, ...]:
        if wanted is None:
            return self.output_names
        if not wanted:
            raise Rejected("INVALID_INPUT", "'outputs' is empty; leave it out to get every output.")
        if self.open_outputs:
            return tuple(dict.fromkeys(wanted))
        for name in wanted:
            if name not in self.outputs:
                raise Rejected(
                    "INVALID_INPUT",
                    f"unknown output {name!r}; the model has {', '.join(self.output_names)}.",
                )
        return tuple(dict.fromkeys(wanted))

    def screen(
        self, feeds: Mapping[str, np.ndarray], requests: Sequence[ValidRequest]
    ) -> dict[int, Rejected]:
        """Check the values of a batch about to run; returns rejections by request index.

        ``feeds`` are the requests' inputs concatenated in order. One vectorised pass over the
        whole batch settles the common case where every value is fine; only when it finds a bad
        value are the requests checked one by one, for their own exact messages.
        """
        try:
            for name, rule in self._value_checked:
                _check_values(rule, feeds[name])
        except Rejected:
            pass
        else:
            return {}
        rejected = {}
        for index, request in enumerate(requests):
            try:
                for name, rule in self._value_checked:
                    _check_values(rule, request.inputs[name], request.first_row)
            except Rejected as exc:
                rejected[index] = exc
        return rejected

    def check_values(self, request: ValidRequest) -> None:
        """One request's values (ranges, NaN, infinity); raise Rejected at the first bad one."""
        for name, rule in self._value_checked:
            if rule.batch_axis is not None:
                _check_values(rule, request.inputs[name])

    # -- warmup data --------------------------------------------------------------------------

    def synthetic_feeds(self, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
        """Inputs of ``rows`` rows whose values pass every check, for warmup runs, laid out
        as the model takes them (rows on each input's batch axis)."""
        rng = np.random.default_rng(seed)
        return {name: synthetic(rule, rows, rng) for name, rule in self.inputs.items()}


def _value_key(arr: np.ndarray) -> Any:
    """An unbatched input's value as a signature part: equal only for equal values."""
    return tuple(arr.ravel().tolist()) if arr.dtype.kind == "O" else arr.tobytes()


def dtype_name(dtype: np.dtype[Any]) -> str:
    """A dtype as errors name it: its wire name (``string``, ``bytes``, ``float32``)."""
    return wire_dtype(np.empty(0, dtype)) or str(dtype)


def _check_dtype_and_shape(
    rule: InputRule,
    arr: np.ndarray,
    symbols: dict[str, tuple[str, int]],
    skip_axis: int | None = 0,
) -> None:
    """Dtype, rank and every fixed and symbolic dimension but the rows' (``skip_axis``)."""
    spec = rule.spec
    if arr.dtype != spec.dtype or (
        spec.dtype.kind == "O" and wire_dtype(arr) != dtype_name(spec.dtype)
    ):
        raise Rejected(
            "INVALID_INPUT",
            f"input {spec.name!r}: expected dtype {dtype_name(spec.dtype)}, "
            f"got {wire_dtype(arr) or arr.dtype}.",
        )
    got = list(arr.shape)
    if arr.ndim != len(spec.dims) or any(
        isinstance(d, int) and d != g and axis != skip_axis
        for axis, (d, g) in enumerate(zip(spec.dims, got, strict=True))
    ):
        raise Rejected(
            "INVALID_INPUT",
            f"input {spec.name!r}: expected shape {spec.shape}, got {got}.",
        )
    for axis, dim in enumerate(spec.dims):
        if axis == skip_axis:
            continue
        if isinstance(dim, str):
            seen = symbols.setdefault(dim, (spec.name, got[axis]))
            if seen[1] != got[axis]:
                raise Rejected(
                    "INVALID_INPUT",
                    f"input {spec.name!r}: dimension {axis} ({dim!r}) is {got[axis]} but input "
                    f"{seen[0]!r} has {dim!r} = {seen[1]}; they must be equal.",
                )


def _check_values(rule: InputRule, arr: np.ndarray, first_row: int = 0) -> None:
    """Raise INVALID_INPUT at the first bad value; its row counted from ``first_row``."""
    name = rule.spec.name
    if rule.is_float and rule.reject_non_finite and arr.size:
        finite = np.isfinite(arr)
        if not finite.all():
            where = _first(~finite)
            raise Rejected(
                "INVALID_INPUT",
                f"input {name!r}: value {arr[where]} at {_at(where, first_row)} is not finite "
                "(limits.reject_non_finite = true).",
            )
    # fmin/fmax skip NaN, which min/max would return, letting every value of the batch pass
    # (with reject_non_finite = false, one request's NaN must not wave another's through)
    if rule.min is not None and arr.size and np.fmin.reduce(arr, axis=None) < rule.min:
        where = _first(arr < rule.min)
        raise Rejected(
            "INVALID_INPUT",
            f"input {name!r}: value {arr[where]} at {_at(where, first_row)} is below the minimum "
            f"{rule.min:g} (inputs.{name}.min).",
        )
    if rule.max is not None and arr.size and np.fmax.reduce(arr, axis=None) > rule.max:
        where = _first(arr > rule.max)
        raise Rejected(
            "INVALID_INPUT",
            f"input {name!r}: value {arr[where]} at {_at(where, first_row)} is above the maximum "
            f"{rule.max:g} (inputs.{name}.max).",
        )


def _at(where: tuple[int, ...], first_row: int) -> list[int]:
    return [where[0] + first_row, *where[1:]] if where else []


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def _rule(
    spec: TensorSpec, cfg: InputConfig | None, reject_non_finite: bool, batch_axis: int | None
) -> InputRule:
    lo = cfg.min if cfg else None
    hi = cfg.max if cfg else None
    if spec.dtype.kind == "f":
        # A bound past the dtype's range on its own side passes every finite value, but not
        # the infinity beyond it; clamped to the dtype's largest finite value, so that the
        # check never casts it to the dtype with an overflow.
        top = float(np.finfo(spec.dtype).max)
        lo = -top if lo is not None and lo < -top else lo
        hi = top if hi is not None and hi > top else hi
    return InputRule(
        spec=spec,
        min=lo,
        max=hi,
        reject_non_finite=reject_non_finite,
        warmup_shape=cfg.warmup_shape if cfg else None,
        batch_axis=batch_axis,
    )


def _check_batchable(
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    max_batch_size: int,
    axes: Axes | None = None,
) -> int | None:
    """Return the fixed batch size the model needs padding to, or None when it is free."""
    axes = axes or Axes()
    fixed: set[int] = set()
    leading: list[str] = []
    batched = 0
    for spec in inputs:
        axis = axes.input_axis(spec.name)
        if axis is None:
            continue
        batched += 1
        if len(spec.dims) <= axis:
            raise ModelError(
                f"Model input {spec.name!r} has shape {spec.shape}, with no axis {axis} to hold "
                "rows; redbatch batches every input along its batch axis (axis 0 unless "
                f'[inputs.{spec.name}] batch_axis says otherwise). Set its batch_axis, or "none" '
                "for an input without rows (every request then sends it whole)."
            )
        if isinstance(spec.dims[axis], int):
            fixed.add(spec.dims[axis])  # type: ignore[arg-type]
            leading.append(f"{spec.name!r} {spec.shape} has {spec.dims[axis]} on axis {axis}")
    if not batched:
        raise ModelError(
            'Every model input is batch_axis = "none"; at least one must hold the rows.'
        )
    if len(fixed) > 1:
        raise ModelError(
            f"Model inputs fix different batch sizes ({', '.join(leading)}); redbatch "
            "batches every input along its batch axis (axis 0 unless [inputs.NAME] batch_axis "
            "says otherwise), so that axis must hold the batch in every input. Set each "
            'input\'s batch_axis (or "none" for an input without rows), or export the model '
            "with a free batch axis (e.g. ['batch', ...]), or one fixed size K in all inputs "
            "with batching.max_batch_size <= K (K = 1 and batching.max_batch_size = 1 serves "
            "one request per run)."
        )
    fixed_batch = fixed.pop() if fixed else None
    if fixed_batch is not None and fixed_batch < max_batch_size:
        raise ConfigError(
            f"Config 'batching.max_batch_size' is {max_batch_size} but the model's inputs have "
            f"a fixed batch dimension of {fixed_batch}. Set batching.max_batch_size <= "
            f"{fixed_batch}, or export the model with a dynamic batch axis."
        )
    for spec in outputs:
        axis = axes.output_axis(spec.name)
        if axis is not None and not _has_batch_axis(spec, axis, fixed_batch, max_batch_size):
            raise ModelError(
                f"Model output {spec.name!r} has shape {spec.shape}, with no batch dimension on "
                f"axis {axis}; redbatch splits outputs by their batch axis. Set "
                f'[outputs.{spec.name}] batch_axis to the axis that holds the rows ("none" '
                "gives every request the whole output), or export the model so every output "
                "keeps the batch axis."
            )
    return fixed_batch if fixed_batch and fixed_batch > 1 else None


def _has_batch_axis(
    spec: TensorSpec, axis: int, fixed_batch: int | None, max_batch_size: int
) -> bool:
    if len(spec.dims) <= axis:
        return False
    first = spec.dims[axis]
    if not isinstance(first, int):
        return True
    if fixed_batch is not None:
        return first == fixed_batch
    return first == 1 and max_batch_size == 1


def _check_input_config(
    configured: Mapping[str, InputConfig], inputs: Sequence[TensorSpec]
) -> None:
    names = {s.name for s in inputs}
    for name, cfg in configured.items():
        if name not in names:
            raise ConfigError(
                f"Config [inputs.{name}] names no model input; the model's inputs are "
                f"{', '.join(sorted(names))}."
            )
        spec = next(s for s in inputs if s.name == name)
        if value_range(cfg.min, cfg.max, spec.dtype) is None:
            key = "max" if cfg.min is None else "min"
            bounds = " and ".join(
                f"{k} = {v:g}" for k, v in (("min", cfg.min), ("max", cfg.max)) if v is not None
            )
            raise ConfigError(
                f"Config 'inputs.{name}.{key}': {bounds} admits no value of input {name!r} "
                f"({spec.dtype} {spec.shape}), so every request would be refused. Widen the range."
            )
        if cfg.warmup_shape is not None and len(cfg.warmup_shape) != len(spec.dims) - (
            cfg.batch_axis is not None
        ):
            raise ConfigError(
                f"Config 'inputs.{name}.warmup_shape' has {len(cfg.warmup_shape)} dimensions but "
                f"input {name!r} {spec.shape} has {len(spec.dims) - 1} besides the batch axis."
            )
        if spec.dtype.kind not in "biuf" and (cfg.min is not None or cfg.max is not None):
            raise ConfigError(
                f"Config 'inputs.{name}.min/max': input {name!r} is {dtype_name(spec.dtype)}, "
                "which has no range. Remove min and max."
            )
