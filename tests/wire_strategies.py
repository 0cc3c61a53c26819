"""Hypothesis strategies and sample values for the wire format, shared by the codec's tests and
the worker's reply encoder's."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from producer import codec

DTYPE_NAMES = list(codec.DTYPES)
RID = r"[A-Za-z0-9_.:-]{1,128}"


def a_reply(**changes: Any) -> codec.Reply:
    fields: dict[str, Any] = {
        "rid": "r1",
        "ok": True,
        "model": codec.ModelRef("demo", "1", "ab" * 32),
        "worker": "host-1",
        "timings_ms": {"queued": 1.0, "inference": 2.0},
        "outputs": {"y": np.arange(3, dtype=np.float32).reshape(1, 3)},
        "batch_rows": 1,
    }
    fields.update(changes)
    return codec.Reply(**fields)


names = st.text(min_size=1, max_size=8)
meta_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(width=32)  # fits float 32 too, so a sender may write either width
    | st.text(max_size=16)
    | st.binary(max_size=16),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=10,
)


@st.composite
def arrays(draw: st.DrawFn, min_dims: int = 1) -> tuple[str, np.ndarray]:
    """(dtype name, array) in any layout: C, Fortran, transposed, strided, and/or big-endian."""
    name = draw(st.sampled_from(DTYPE_NAMES))
    shape = draw(hnp.array_shapes(min_dims=min_dims, max_dims=4, min_side=0, max_side=3))
    arr = draw(hnp.arrays(np.dtype(name), shape))
    layout = draw(st.sampled_from(["c", "fortran", "transposed", "strided"]))
    if layout == "fortran":
        arr = np.asfortranarray(arr)
    elif layout == "transposed":
        arr = arr.T
    elif layout == "strided":
        arr = np.stack([arr, arr], axis=-1)[..., 0]
    if draw(st.booleans()):
        arr = arr.astype(arr.dtype.newbyteorder(">"))
    return name, arr
