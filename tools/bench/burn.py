"""A pipeline handler whose preprocessing costs CPU outside the GIL, for the ``pipeline`` preset.

``BurnPipeline`` (``tools.bench.burn:BurnPipeline``, loaded by a started worker from the
checkout on its ``PYTHONPATH``) takes the tiny model's input as it is and, per request, hashes a
buffer of ``work_bytes`` with SHA-256: hashlib lets go of the GIL for any buffer over 2 KiB, as
Pillow's decoders and numpy's big array operations do, so ``pipeline.threads`` threads can
preprocess side by side. The model is cheap, so such a worker is bound by its preprocessing,
and twice the threads should give nearly twice the throughput on two free cores.

``work_bytes_for`` sizes the buffer on this machine once, so that the workers it is compared
across do exactly the same work per request.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping

import numpy as np

__all__ = ["BurnPipeline", "work_bytes_for"]

_PROBE_BYTES = 1 << 20


class BurnPipeline:
    """Raw ``x`` float32 [n, width] to the model's ``x``, after ``work_bytes`` of SHA-256."""

    def __init__(self, work_bytes: int = 4 << 20, width: int = 128) -> None:
        if work_bytes < 0 or width < 1:
            raise ValueError(f"work_bytes must be >= 0 and width >= 1; got {work_bytes}, {width}")
        self._buffer = bytes(work_bytes)
        self.inputs = {"x": {"dtype": "float32", "shape": [-1, width]}}

    def preprocess(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._buffer:
            hashlib.sha256(self._buffer).digest()  # outside the GIL
        return {"x": inputs["x"]}


def work_bytes_for(ms: float, probes: int = 20) -> int:
    """How many bytes one thread hashes in ``ms`` milliseconds on this machine (the quickest
    of ``probes`` 1 MiB hashes, so that a busy moment does not inflate it)."""
    buffer = bytes(_PROBE_BYTES)
    best_s = float("inf")
    for _ in range(probes):
        started = time.perf_counter()
        hashlib.sha256(buffer).digest()
        best_s = min(best_s, time.perf_counter() - started)
    return max(int(_PROBE_BYTES * ms / 1000.0 / max(best_s, 1e-9)), 4096)
