"""The examples' answers without Redis or a worker: a handler's hooks around a bare session.

This is what the tests and ``tools/example_run.py`` compare the served replies with. It calls
the per-request hooks (``preprocess``, ``postprocess``), one request at a time, so a worker
that batches requests and prefers the batch hooks is checked against the plainest path.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

__all__ = ["DirectRun", "same_outputs"]


class DirectRun:
    """``handler``'s pre- and post-processing around its model in one onnxruntime session."""

    def __init__(self, handler: Any, model_path: Path) -> None:
        self.handler = handler
        self.session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.session.get_outputs()]
        params = inspect.signature(handler.postprocess).parameters
        self._wants_model_inputs = "model_inputs" in params

    def model_outputs(self, model_inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = self.session.run(self.output_names, dict(model_inputs))
        return dict(zip(self.output_names, arrays, strict=True))

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request's raw inputs to its reply's outputs."""
        model_inputs = self.handler.preprocess(inputs)
        outputs = self.model_outputs(model_inputs)
        if self._wants_model_inputs:
            return self.handler.postprocess(outputs, inputs, model_inputs=model_inputs)
        return self.handler.postprocess(outputs, inputs)

    def many(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        return [self(inputs) for inputs in requests]


def same_outputs(
    got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], atol: float = 1e-5
) -> list[str]:
    """The differences between two replies' outputs, as sentences; empty when they agree.

    Strings and integers must be equal; floats within ``atol``, since a batch of several
    requests may round differently from a run of one.
    """
    problems = []
    if set(got) != set(want):
        problems.append(f"outputs {sorted(got)} != {sorted(want)}")
    for name in sorted(set(got) & set(want)):
        a, b = np.asarray(got[name]), np.asarray(want[name])
        if a.shape != b.shape:
            problems.append(f"{name}: shape {a.shape} != {b.shape}")
        elif a.dtype.kind == "f" or b.dtype.kind == "f":
            if not np.allclose(a, b, rtol=0, atol=atol):
                worst = float(np.max(np.abs(a.astype(np.float64) - b)))
                problems.append(f"{name}: differs by up to {worst:.3g} (atol {atol:g})")
        elif not np.array_equal(a, b):
            problems.append(f"{name}: {a.tolist()!r} != {b.tolist()!r}")
    return problems
