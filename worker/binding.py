"""I/O binding: each batch shape's inputs and outputs in buffers preallocated on the device.

``session.run`` allocates device memory for every input and output on every call. With
``[model.cuda] io_binding = true`` the worker keeps, per batch shape, input and output buffers
on the GPU, copies a batch into them in place and reads the outputs back, so a run allocates
nothing. ``cuda_graph = true`` goes further: onnxruntime captures the model's kernels once per
shape as a CUDA graph and then replays each run with one launch, which needs fixed addresses
(these buffers) and fixed shapes, so batches are padded up to a few bucket sizes (powers of two
up to max_batch_size, and max_batch_size itself), each with its own graph, all captured during
warmup.

The runner is device-generic (``device = "cpu"`` binds host memory), which is how the tests run
it on machines without a GPU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from worker.errors import ModelError
from worker.model import TensorSpec

__all__ = ["BoundRunner", "buckets_for", "check_graph_shapes"]

_SLOTS_KEPT = 64  # shapes with buffers kept; more evict the least recently used


def buckets_for(max_rows: int) -> tuple[int, ...]:
    """Batch sizes a CUDA graph is captured for: powers of two below max_rows, and max_rows."""
    sizes, size = [], 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return (*sizes, max_rows)


def check_graph_shapes(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> None:
    """CUDA graphs replay fixed shapes: refuse a model whose non-batch dimensions are free."""
    for what, specs in (("input", inputs), ("output", outputs)):
        for spec in specs:
            if not all(isinstance(d, int) and d > 0 for d in spec.dims[1:]):
                raise ModelError(
                    f"[model.cuda] cuda_graph = true needs every dimension but the first fixed, "
                    f"but model {what} {spec.name!r} has shape {spec.shape}. Export the model "
                    "with fixed non-batch dimensions, or set cuda_graph = false (io_binding "
                    "alone works with any shapes)."
                )


@dataclass(slots=True)
class _Slot:
    """One batch shape's binding: its buffers and, with graphs, its graph id."""

    binding: Any
    inputs: dict[str, Any]
    outputs: dict[str, Any] | None  # None: onnxruntime allocates them (shapes not known ahead)
    run_options: Any


class BoundRunner:
    """Runs a session through I/O bindings kept per batch shape."""

    def __init__(
        self,
        ort: Any,
        session: Any,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        *,
        device: str = "cuda",
        device_id: int = 0,
        buckets: Sequence[int] | None = None,
    ) -> None:
        self._ort = ort
        self._session = session
        self._inputs = {spec.name: spec for spec in inputs}
        self._outputs = tuple(outputs)
        self._device = device
        self._device_id = device_id
        self.buckets = tuple(sorted(buckets)) if buckets else None
        if self.buckets:
            check_graph_shapes(inputs, outputs)
        self._slots: OrderedDict[tuple[Any, ...], _Slot] = OrderedDict()

    @property
    def graphs(self) -> bool:
        return self.buckets is not None

    def run(self, feeds: Mapping[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        """Copy ``feeds`` into the shape's bound inputs, run, and return host copies of the
        outputs, sliced back to the batch's rows when it was padded to a bucket."""
        rows = next(iter(feeds.values())).shape[0]
        size = self._bucket(rows)
        tails = tuple(feeds[name].shape[1:] for name in self._inputs)
        slot = self._slot(size, tails)
        for name, value in slot.inputs.items():
            value.update_inplace(_padded(feeds[name], size))
        self._session.run_with_iobinding(slot.binding, slot.run_options)
        if slot.outputs is None:
            results = dict(
                zip(self._output_names(), slot.binding.copy_outputs_to_cpu(), strict=True)
            )
        else:
            results = {name: value.numpy() for name, value in slot.outputs.items()}
        host = self._device == "cpu"  # numpy() of a host buffer is a view the next run overwrites
        return [
            results[name][:rows].copy() if host else results[name][:rows] for name in output_names
        ]

    def _bucket(self, rows: int) -> int:
        if self.buckets is None:
            return rows
        for size in self.buckets:
            if size >= rows:
                return size
        raise ValueError(
            f"a batch of {rows} rows exceeds the largest graph size {self.buckets[-1]}"
        )

    def _output_names(self) -> list[str]:
        return [spec.name for spec in self._outputs]

    def _slot(self, rows: int, tails: tuple[tuple[int, ...], ...]) -> _Slot:
        key = (rows, tails)
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
            return slot
        if len(self._slots) >= _SLOTS_KEPT:
            self._slots.popitem(last=False)
        slot = self._make_slot(rows, tails)
        self._slots[key] = slot
        return slot

    def _make_slot(self, rows: int, tails: tuple[tuple[int, ...], ...]) -> _Slot:
        ort, binding = self._ort, self._session.io_binding()
        inputs = {}
        for (name, spec), tail in zip(self._inputs.items(), tails, strict=True):
            inputs[name] = self._alloc([rows, *tail], spec.dtype)
            binding.bind_ortvalue_input(name, inputs[name])
        outputs = self._bind_outputs(binding, rows)
        run_options = ort.RunOptions()
        if self.buckets is not None:
            # One graph per bucket; ids start at 1 (-1 tells onnxruntime not to capture).
            run_options.add_run_config_entry("gpu_graph_id", str(self.buckets.index(rows) + 1))
        return _Slot(binding, inputs, outputs, run_options)

    def _bind_outputs(self, binding: Any, rows: int) -> dict[str, Any] | None:
        """Preallocated outputs when the model file fixes their shapes, else None: onnxruntime
        allocates them on the device on each run."""
        shapes = [_known_shape(spec, rows) for spec in self._outputs]
        if any(shape is None for shape in shapes):
            for spec in self._outputs:
                binding.bind_output(spec.name, self._device, self._device_id)
            return None
        outputs = {}
        for spec, shape in zip(self._outputs, shapes, strict=True):
            assert shape is not None
            outputs[spec.name] = self._alloc(shape, spec.dtype)
            binding.bind_ortvalue_output(spec.name, outputs[spec.name])
        return outputs

    def _alloc(self, shape: list[int], dtype: np.dtype) -> Any:
        return self._ort.OrtValue.ortvalue_from_shape_and_type(
            shape, dtype.type, self._device, self._device_id
        )


def _known_shape(spec: TensorSpec, rows: int) -> list[int] | None:
    """The output's shape for ``rows`` when the model file fixes every other dimension."""
    tail = spec.dims[1:]
    if not spec.dims or not all(isinstance(d, int) and d > 0 for d in tail):
        return None
    return [rows, *tail]  # type: ignore[list-item]


def _padded(arr: np.ndarray, rows: int) -> np.ndarray:
    """``arr`` grown to ``rows`` by repeating its first row (always valid input), C-ordered."""
    if arr.shape[0] < rows:
        arr = np.concatenate([arr, np.repeat(arr[:1], rows - arr.shape[0], axis=0)])
    return np.ascontiguousarray(arr)
