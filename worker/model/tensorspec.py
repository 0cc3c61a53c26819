"""A model input or output as the model file declares it: what the runtime session
(``worker.model.session``), the I/O binding (``worker.model.binding``) and the request schema
share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Dim", "TensorSpec"]

Dim = int | str | None  # fixed size, symbolic name, or unnamed free dimension


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One model input or output as the model file declares it."""

    name: str
    dtype: np.dtype[Any]
    dims: tuple[Dim, ...]

    @property
    def shape(self) -> list[int]:
        """The shape with -1 for every free dimension, as error messages and records show it."""
        return [d if isinstance(d, int) else -1 for d in self.dims]
