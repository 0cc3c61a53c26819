"""Hypothesis strategies and sample values for the wire format, shared by the codec's tests and
the worker's reply encoder's."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from producer.protocol import codec

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


# ---------------------------------------------------------------------------------------------
# (v2) string and bytes tensors

TEXT_NAMES = ["string", "bytes"]
# Any text UTF-8 can carry: NUL, astral characters, combining marks; never a lone surrogate.
texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)
blobs = st.binary(max_size=12)
# How a caller may hold a string or bytes tensor before sending it.
TEXT_FORMS = ["wire-dtype", "object", "numpy", "list"]


@st.composite
def text_arrays(draw: st.DrawFn, min_dims: int = 0) -> tuple[str, Any, np.ndarray]:
    """(wire dtype name, value as a caller holds it, the array it means) of a string or bytes
    tensor: an object array with or without its wire dtype, in any layout; a numpy 'U' or 'S'
    array (whose elements cannot end in NUL: numpy drops those); or nested lists."""
    name = draw(st.sampled_from(TEXT_NAMES))
    form = draw(st.sampled_from(TEXT_FORMS))
    # A list of no elements is a float64 array to numpy, and its shape is all a list can say
    min_side = 1 if form == "list" else 0
    shape = draw(hnp.array_shapes(min_dims=min_dims, max_dims=4, min_side=min_side, max_side=3))
    count = int(np.prod(shape))
    elements: list[Any] = draw(
        st.lists(texts if name == "string" else blobs, min_size=count, max_size=count)
    )
    if form == "numpy":
        elements = [e.rstrip("\0" if isinstance(e, str) else b"\0") for e in elements]
        value: Any = np.array(elements, dtype="U" if name == "string" else "S").reshape(shape)
        if draw(st.booleans()) and value.dtype.itemsize:
            value = value.astype(value.dtype.newbyteorder(">"))
    else:
        value = np.empty(count, dtype=codec.STRING if name == "string" else codec.BYTES)
        value[:] = elements
        value = value.reshape(shape)
        if form == "object":
            value = value.astype(object)  # no wire name: named by its first element
        elif form == "list":
            value = value.tolist()
    meaning = np.empty(count, dtype=codec.STRING if name == "string" else codec.BYTES)
    meaning[:] = elements
    meaning = meaning.reshape(shape)
    if isinstance(value, np.ndarray) and value.ndim >= 2:
        layout = draw(st.sampled_from(["c", "fortran", "transposed", "strided"]))
        if layout == "fortran":
            value = np.asfortranarray(value)
        elif layout == "transposed":
            value, meaning = value.T, meaning.T
        elif layout == "strided":
            value = np.stack([value, value], axis=-1)[..., 0]  # drops the wire name, as astype
    unnamed = isinstance(value, np.ndarray) and value.dtype.kind == "O" and not value.dtype.metadata
    if unnamed and not value.size:
        name = "string"  # an object array without a wire name and no first element to name it
    return name, value, meaning
