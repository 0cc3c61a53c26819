"""Request bodies and what each must be answered with: outputs from a direct onnxruntime run of the
reference model, or an error code for the malformed, invalid and crash-pill requests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from producer.protocol.codec import encode_request

from .common import CRASH_VALUE


@dataclass(frozen=True, slots=True)
class Expected:
    """What one request must be answered with: outputs ``y`` or an error code."""

    y: np.ndarray | None = None
    code: str | None = None


class Requests:
    """Request bodies by rid and what each must be answered with (a seeded mix of good and bad)."""

    def __init__(self, reference_model: Path, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.bodies: dict[str, bytes] = {}
        self.expected: dict[str, Expected] = {}
        self.malformed = 0
        self._session = ort.InferenceSession(
            str(reference_model), providers=["CPUExecutionProvider"]
        )

    def make(self, n: int, tag: str, *, bad_fraction: float = 0.0) -> list[str]:
        """``n`` new requests of 1 to 3 rows; ``bad_fraction`` of them are malformed or invalid."""
        rids = [f"{tag}-{len(self.bodies) + i}" for i in range(n)]
        good: list[tuple[str, np.ndarray]] = []
        for rid in rids:
            if self.rng.random() < bad_fraction:
                self.bodies[rid], code = self._bad()
                self.expected[rid] = Expected(code=code)
                self.malformed += 1
                continue
            x = self.rng.standard_normal((int(self.rng.integers(1, 4)), 8)).astype(np.float32)
            self.bodies[rid] = encode_request({"x": x})
            good.append((rid, x))
        if good:
            ys = self._session.run(["y"], {"x": np.concatenate([x for _, x in good])})[0]
            start = 0
            for rid, x in good:
                self.expected[rid] = Expected(y=ys[start : start + len(x)])
                start += len(x)
        return rids

    def _bad(self) -> tuple[bytes, str]:
        kind = int(self.rng.integers(0, 4))
        if kind == 0:
            return b"\xc1not msgpack", "MALFORMED"
        if kind == 1:
            return encode_request({"x": np.zeros((1, 8), np.float64)}), "INVALID_INPUT"
        if kind == 2:
            return encode_request({"x": np.zeros((1, 7), np.float32)}), "INVALID_INPUT"
        return encode_request({"x": np.full((1, 8), np.nan, np.float32)}), "INVALID_INPUT"

    def pill(self, tag: str) -> str:
        """A crash pill: its worker dies inside inference, every time it is run."""
        rid = f"{tag}-pill-{len(self.bodies)}"
        x = self.rng.standard_normal((1, 8)).astype(np.float32)
        x[0, 3] = CRASH_VALUE
        self.bodies[rid] = encode_request({"x": x})
        self.expected[rid] = Expected(code="POISONED")
        return rid
