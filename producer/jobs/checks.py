"""``redbatch run``'s checks before anything is sent: the input's names, dtypes and row shapes,
the outputs asked for and the rows per request, against a live worker's record; each a
UsageError that says what to change, because a run that would fail every row costs worker time
and an errors file as long as the input (a 200,000-row file cost 30 s and 34 MB)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from producer.protocol import codec
from producer.protocol.errors import UsageError

__all__ = ["check_against_workers", "model_dtypes", "single_input_name"]


def _names(specs: Any) -> list[Any]:
    return [s.get("name") for s in specs or [] if isinstance(s, dict)]


def single_input_name(args: argparse.Namespace, records: list[dict[str, Any]]) -> str:
    """The input name for a single-input file (.npy, a .txt, files): --input-name, or the one
    input a live worker reports."""
    if args.input_name:
        return str(args.input_name)
    for record in records:
        names = _names(record.get("inputs"))
        if len(names) == 1 and isinstance(names[0], str):
            return names[0]
        if len(names) > 1:
            raise UsageError(
                f"model {args.model!r} takes {len(names)} inputs ({', '.join(map(str, names))}); "
                "pass an .npz, .jsonl, .parquet or .arrow holding one column per input."
            )
    raise UsageError(
        f"no live worker reports the input name of model {args.model!r}; "
        "pass --input-name NAME, or start a worker first."
    )


def model_dtypes(records: list[dict[str, Any]]) -> dict[str, str]:
    """Each input's dtype, as the first live worker reports it."""
    for record in records:
        specs = [s for s in record.get("inputs") or [] if isinstance(s, dict)]
        return {
            str(s["name"]): str(s["dtype"])
            for s in specs
            if isinstance(s.get("name"), str) and isinstance(s.get("dtype"), str)
        }
    return {}


def check_against_workers(
    args: argparse.Namespace,
    arrays: Mapping[str, np.ndarray],
    records: list[dict[str, Any]],
    kind: str = "npy",
    key_name: str | None = None,
) -> None:
    """Fail before sending anything when a live worker already says every request would fail.
    ``arrays`` are the inputs (an .npy's arrays, or the first rows of a streamed input);
    ``key_name`` the key column the outputs will carry, which must not be an output's name."""
    if not records:
        print(
            f"redbatch: note: no live worker for model {args.model!r}; "
            "requests wait in the stream until one starts.",
            file=sys.stderr,
        )
        return
    record = records[0]
    expected = set(_names(record.get("inputs")))
    if expected and set(arrays) != expected:
        raise UsageError(
            f"input arrays {sorted(arrays)} do not match model {args.model!r} inputs "
            f"{sorted(map(str, expected))}."
        )
    _check_dtypes(args.model, arrays, record, kind)
    _check_shapes(args.model, arrays, record)
    outputs = set(_names(record.get("outputs")))
    unknown = sorted(set(args.outputs or ()) - outputs) if outputs else []
    if unknown:
        raise UsageError(
            f"--outputs {', '.join(unknown)}: model {args.model!r} has no such output; it has "
            f"{', '.join(sorted(map(str, outputs)))}."
        )
    if key_name is not None and key_name in (args.outputs or outputs):
        raise UsageError(
            f"model {args.model!r} has an output named {key_name!r}, the key column the "
            "outputs carry; leave it out with --outputs, or carry another key (--key)."
        )
    limit = (record.get("batching") or {}).get("max_batch_size")
    if isinstance(limit, int) and args.rows_per_request and args.rows_per_request > limit:
        raise UsageError(
            f"--rows-per-request {args.rows_per_request} is over the workers' "
            f"max_batch_size={limit}; use {limit} or less."
        )


def _check_dtypes(
    model: str, arrays: Mapping[str, np.ndarray], record: dict[str, Any], kind: str
) -> None:
    """A dtype the model does not take fails every request, one by one: say so before sending
    (the workers never convert types; the input is the caller's to cast)."""
    for spec in record.get("inputs") or []:
        if not isinstance(spec, dict) or spec.get("name") not in arrays:
            continue
        name, want = spec["name"], spec.get("dtype")
        array = arrays[name]
        got = codec.wire_dtype(array) or str(array.dtype)
        if not isinstance(want, str) or want not in codec.WIRE_DTYPES or got == want:
            continue
        raise UsageError(
            f"input {name!r} is {got}, but model {model!r} takes {want}: every request would "
            f"be refused. {_cast_hint(kind, name, want)}"
        )


def _cast_hint(kind: str, name: str, want: str) -> str:
    numeric = want in codec.DTYPES
    if kind in ("npy", "npz", "arrays") and numeric:
        return f"Cast the array first, e.g. np.save(path, x.astype(np.{want}))."
    if kind in ("jsonl", "parquet", "arrow") and numeric:
        return f"Pass --dtype {name}={want}, or cast the column first."
    if kind == "text":
        return "A .txt sends string rows; send this input from another kind of file."
    if kind == "files":
        return "Files are sent as bytes rows; send this input from another kind of file."
    return f"Send {want} values for it."


def _check_shapes(model: str, arrays: Mapping[str, np.ndarray], record: dict[str, Any]) -> None:
    """Likewise a row shape the model does not take: every request would be refused, one by
    one."""
    for spec in record.get("inputs") or []:
        shape = spec.get("shape") if isinstance(spec, dict) else None
        if not isinstance(shape, list) or spec.get("name") not in arrays or not shape:
            continue
        got = arrays[spec["name"]].shape
        fits = len(got) == len(shape) and all(
            not isinstance(want, int) or want < 0 or want == have
            for want, have in zip(shape[1:], got[1:], strict=True)
        )
        if fits:
            continue
        rows_of = ", ".join(str(d if isinstance(d, int) and d >= 0 else "N") for d in shape[1:])
        raise UsageError(
            f"input {spec['name']!r} has shape {list(got)}, but model {model!r} takes "
            f"rows of shape [{rows_of}] (the model's shape is {shape}): every request "
            "would be refused."
        )
