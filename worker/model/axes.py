"""Batch axes: where each model input and output keeps its rows (docs/protocol.md section 11).

Most models keep rows on axis 0, and for them nothing here does anything (``Axes.trivial``).
A model like Silero VAD keeps them elsewhere (its state is ``[2, N, 128]``) or takes inputs
without rows (its scalar sample rate). Inside the worker every batched input and output holds
its rows on axis 0, so batching, screening and splitting stay one code path: requests' inputs
are moved to rows-first at admission (a view), moved back into the model's layout just before
the run (one copy, as the runtime wants contiguous arrays), and outputs the same way round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from worker.config import WorkerConfig
    from worker.model.tensorspec import TensorSpec

__all__ = ["Axes"]


@dataclass(frozen=True, slots=True)
class Axes:
    """The batch axis of every input and output that does not keep its rows on axis 0
    (None: it has no rows)."""

    inputs: Mapping[str, int | None] = field(default_factory=dict)
    outputs: Mapping[str, int | None] = field(default_factory=dict)

    @classmethod
    def from_config(
        cls, config: WorkerConfig, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
    ) -> Axes:
        """The axes ``[inputs.X]`` and ``[outputs.Y]`` declare; a table naming no model input or
        output is refused (``worker.model.schema`` names the input ones)."""
        from worker.errors import ConfigError

        names = {s.name for s in outputs}
        for name in config.outputs:
            if name not in names:
                raise ConfigError(
                    f"Config [outputs.{name}] names no model output; the model's outputs are "
                    f"{', '.join(sorted(names))}."
                )
        known = {s.name for s in inputs}
        return cls(
            {n: c.batch_axis for n, c in config.inputs.items() if c.batch_axis != 0 and n in known},
            {n: c.batch_axis for n, c in config.outputs.items() if c.batch_axis != 0},
        )

    @property
    def trivial(self) -> bool:
        """Every input and output keeps its rows on axis 0."""
        return not self.inputs and not self.outputs

    def input_axis(self, name: str) -> int | None:
        return self.inputs.get(name, 0)

    def output_axis(self, name: str) -> int | None:
        return self.outputs.get(name, 0)

    def to_model(
        self, feeds: Mapping[str, np.ndarray], fixed: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """A batch's rows-first feeds (and its unbatched inputs) as the model takes them."""
        out = {}
        for name, arr in feeds.items():
            axis = self.inputs.get(name, 0)
            out[name] = np.ascontiguousarray(np.moveaxis(arr, 0, axis)) if axis else arr
        out.update(fixed)
        return out

    def outputs_to_rows(
        self, names: Sequence[str], outputs: Sequence[np.ndarray]
    ) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
        """A run's outputs with rows first, and apart the unbatched ones (every request gets
        them whole)."""
        batched, whole = [], {}
        for name, out in zip(names, outputs, strict=True):
            axis = self.outputs.get(name, 0)
            if axis is None:
                whole[name] = out
            else:
                batched.append(np.moveaxis(out, axis, 0) if axis else out)
        return batched, whole

    def output_for_reply(self, name: str, rows: np.ndarray) -> np.ndarray:
        """One request's rows of an output, laid out as the model gave them."""
        axis = self.outputs.get(name, 0)
        return np.moveaxis(rows, 0, axis) if axis else rows
