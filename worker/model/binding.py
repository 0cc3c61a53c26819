"""I/O binding: batches copied into input and output buffers preallocated on the device.

``session.run`` allocates device memory for every input and output on every call. With
``[model.cuda] io_binding = true`` the worker keeps input and output buffers on the GPU per batch
size and copies each batch into them in place, so a run allocates nothing. Batches are padded up
to a few bucket sizes (powers of two up to max_batch_size, and max_batch_size itself): that bounds
the buffers to about twice one full batch, where one set per exact size would take sixteen times
as much. ``cuda_graph = true`` goes further: onnxruntime captures the model's kernels once per
bucket as a CUDA graph and replays each run with one launch, which needs these fixed addresses
and fixed shapes; every graph is captured during warmup.

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
from worker.model.tensorspec import TensorSpec

__all__ = ["BoundRunner", "buckets_for", "check_graph_shapes"]

_SLOTS_KEPT = 16  # without graphs: (bucket, shape) buffer sets kept, least recently used out


def buckets_for(max_rows: int) -> tuple[int, ...]:
    """Batch sizes bound runs are padded to (one CUDA graph each with graphs): powers of two
    below max_rows, and max_rows."""
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
    """Runs a session through I/O bindings kept per bucket size (and non-batch shape)."""

    def __init__(
        self,
        ort: Any,
        session: Any,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        buckets: Sequence[int],
        *,
        graphs: bool = False,
        device: str = "cuda",
        device_id: int = 0,
    ) -> None:
        if graphs:
            check_graph_shapes(inputs, outputs)
        self._ort = ort
        self._session = session
        self._inputs = {spec.name: spec for spec in inputs}
        self._outputs = tuple(outputs)
        self.buckets = tuple(sorted(buckets))
        self.graphs = graphs
        self._device = device
        self._device_id = device_id
        self._slots: OrderedDict[tuple[Any, ...], _Slot] = OrderedDict()

    def padded_rows(self, rows: int) -> int:
        """The bucket a batch of ``rows`` runs as: assemble it padded to this many rows."""
        for size in self.buckets:
            if size >= rows:
                return size
        raise ValueError(
            f"a batch of {rows} row{'s' if rows != 1 else ''} exceeds the largest bucket "
            f"{self.buckets[-1]}"
        )

    def run(self, feeds: Mapping[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        """Copy ``feeds`` into the bucket's bound inputs, run, and return host copies of the
        outputs asked for, with as many rows as ``feeds`` (padding rows dropped)."""
        rows = next(iter(feeds.values())).shape[0]
        size = self.padded_rows(rows)
        tails = tuple(feeds[name].shape[1:] for name in self._inputs)
        slot = self._slot(size, tails)
        for name, value in slot.inputs.items():
            value.update_inplace(self._checked(name, _padded(feeds[name], size), value))
        if self._device != "cpu":
            slot.binding.synchronize_inputs()  # the copies land before the run's stream reads
        self._session.run_with_iobinding(slot.binding, slot.run_options)
        values = slot.outputs or dict(
            zip(self._output_names(), slot.binding.get_outputs(), strict=True)
        )
        host = self._device == "cpu"  # numpy() of a host buffer is a view the next run overwrites
        return [
            values[name].numpy()[:rows].copy() if host else values[name].numpy()[:rows]
            for name in output_names
        ]

    def _checked(self, name: str, arr: np.ndarray, value: Any) -> np.ndarray:
        """update_inplace copies raw bytes: refuse an array that would not fit them exactly."""
        spec = self._inputs[name]
        if arr.dtype != spec.dtype or list(arr.shape) != list(value.shape()):
            raise ValueError(
                f"input {name!r} is {arr.dtype} {list(arr.shape)} but its bound buffer is "
                f"{spec.dtype} {list(value.shape())}"
            )
        return arr

    def _output_names(self) -> list[str]:
        return [spec.name for spec in self._outputs]

    def _slot(self, rows: int, tails: tuple[tuple[int, ...], ...]) -> _Slot:
        key = (rows, tails)
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
            return slot
        # A captured graph replays into its slot's buffers: with graphs, never free one (their
        # shapes are fixed, so there is one slot per bucket). Without, keep the recent few.
        if not self.graphs and len(self._slots) >= _SLOTS_KEPT:
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
        if self.graphs:
            # One graph per bucket; ids start at 1 (-1 tells onnxruntime not to capture).
            run_options.add_run_config_entry("gpu_graph_id", str(self.buckets.index(rows) + 1))
        return _Slot(binding, inputs, outputs, run_options)

    def _bind_outputs(self, binding: Any, rows: int) -> dict[str, Any] | None:
        """Preallocated outputs when the model file fixes their shapes, else None: onnxruntime
        allocates them on the device on each run (not with graphs: their shapes are fixed)."""
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
