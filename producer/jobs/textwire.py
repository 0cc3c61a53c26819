"""Text inputs sent as the workers take them: ``string`` or ``bytes``, whatever the file holds.

A reader's text values have a kind of their own (a .txt's lines and a JSON string are
``string``, a file's content and a binary column ``bytes``); the kind sent is ``--dtype
NAME=string|bytes`` when given, else the kind the live workers report for that input (a
pipeline's ``image`` takes bytes, ``text`` a string), else the values' own. So a folder of
.txt files feeds a ``string`` input, and JSON strings a ``bytes`` one, with no flag. Strings
become bytes as UTF-8; bytes become strings by UTF-8 decoding, and a value that is not UTF-8
is not sent: the reader skips it and lists it (``UNREADABLE``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from producer.protocol.codec import DTYPES
from producer.protocol.errors import UsageError

__all__ = ["TEXT_WIRES", "recode", "text_wire"]

#: The wire dtypes of text.
TEXT_WIRES = ("string", "bytes")


def text_wire(name: str, own: str, dtypes: Any, model_dtypes: Any) -> str:
    """The kind input ``name``, whose values are ``own`` (string or bytes), is sent as:
    ``dtypes[name]`` (--dtype), else ``model_dtypes[name]`` when it is text, else ``own``."""
    given = dtypes.get(name)
    if given is not None:
        if given not in TEXT_WIRES:
            raise UsageError(
                f"--dtype {name}={given}: input {name!r} holds text ({own}), not numbers; give "
                f"--dtype {name}=string or {name}=bytes, or send numbers from a .npy, .npz, "
                ".jsonl or Parquet/Arrow column."
            )
        return str(given)
    model = model_dtypes.get(name)
    return str(model) if model in TEXT_WIRES else own


def numeric_only(name: str, dtypes: Any) -> None:
    """Refuse ``--dtype NAME=string|bytes`` for an input that holds numbers."""
    given = dtypes.get(name)
    if given is not None and given not in DTYPES:
        raise UsageError(
            f"--dtype {name}={given}: input {name!r} holds numbers, not text; give a numeric "
            "dtype, or leave --dtype out."
        )


def recode(values: Sequence[Any], wire: str) -> tuple[list[Any], dict[int, str]]:
    """``values`` (each str or bytes) as ``wire``, and the positions that could not be, with
    why (bytes that are not UTF-8 when ``wire`` is string); those hold an empty value."""
    out: list[Any] = []
    bad: dict[int, str] = {}
    if wire == "bytes":
        return [v.encode() if isinstance(v, str) else bytes(v) for v in values], bad
    for i, value in enumerate(values):
        if isinstance(value, str):
            out.append(value)
            continue
        try:
            out.append(bytes(value).decode("utf-8"))
        except UnicodeDecodeError as exc:
            bad[i] = (
                f"is not UTF-8 text ({exc.reason} at byte {exc.start}), and the input is string"
            )
            out.append("")
    return out, bad
