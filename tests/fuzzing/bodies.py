"""Seeded valid request bodies: the inputs, the optional keys, the body a producer would send."""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np

from producer.protocol.codec import encode_request

from .target import FuzzTarget

DAY_MS = 86_400_000
# Replies kept for less than this may expire before a large run reads them back: not checked.
MIN_TTL_S = 1800


class ValidBodies:
    """Seeded generator of valid bodies for ``target``; ``Mutator`` builds its inputs from these."""

    def __init__(self, target: FuzzTarget, seed: int) -> None:
        self.target = target
        self.spec = target.spec
        self.rng = random.Random(seed)
        self._np = np.random.default_rng(seed)

    def valid_inputs(self, rows: int | None = None) -> dict[str, np.ndarray]:
        """Finite values in [-1, 1] (small integers for integer inputs), 1 to 4 rows."""
        n = rows if rows is not None else self.rng.randint(1, min(4, self.target.max_batch_size))
        inputs = {}
        for name, (dtype, dims) in self.spec.inputs.items():
            values = self._np.uniform(-1.0, 1.0, size=(n, *dims)) * (1 if dtype[0] == "f" else 9)
            inputs[name] = values.astype(dtype)
        return inputs

    def valid_doc(self) -> dict[str, Any]:
        """A valid body as a Python map, with each optional key present half the time or so."""
        rng = self.rng
        body: dict[str, Any] = {
            "inputs": {
                n: {"dtype": str(a.dtype), "shape": list(a.shape), "data": a.tobytes()}
                for n, a in self.valid_inputs().items()
            }
        }
        if rng.random() < 0.3:
            names = list(self.spec.outputs)
            body["outputs"] = rng.sample(names, rng.randint(1, len(names)))
        if rng.random() < 0.3:
            body["deadline_ms"] = int(time.time() * 1000) + DAY_MS
        if rng.random() < 0.3:
            body["meta"] = self._meta_value(rng.randint(0, 3))
        if rng.random() < 0.2:
            body["reply_ttl_s"] = rng.randint(MIN_TTL_S, 3600)
        return body

    def valid_body(self) -> bytes:
        """A body the worker must answer OK (encode_request writes it, as a producer would)."""
        doc = self.valid_doc()
        inputs = {
            n: np.frombuffer(t["data"], t["dtype"]).reshape(t["shape"])
            for n, t in doc.pop("inputs").items()
        }
        return encode_request(inputs, **doc)

    def _meta_value(self, depth: int) -> Any:
        rng = self.rng
        choice = rng.randrange(7 if depth else 5)
        if choice == 0:
            return rng.randint(-(2**63), 2**64 - 1)
        if choice == 1:
            return "".join(rng.choice("abcé☃\x00") for _ in range(rng.randint(0, 12)))
        if choice == 2:
            return rng.randbytes(rng.randint(0, 12))
        if choice == 3:
            return rng.choice([None, True, False, 1.5, float("nan"), -0.0])
        if choice == 4:
            return rng.random()
        if choice == 5:
            return [self._meta_value(depth - 1) for _ in range(rng.randint(0, 4))]
        keys: list[Any] = ["k", "", 1, -7, b"b", 2.5, None, True]
        return {rng.choice(keys): self._meta_value(depth - 1) for _ in range(rng.randint(0, 4))}
