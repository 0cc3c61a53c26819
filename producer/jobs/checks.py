"""``redbatch run``'s checks before anything is sent: the input's names, dtypes and row shapes,
the outputs asked for and the rows per request, against a live worker's record; each a
UsageError that says what to change, because a run that would fail every row costs worker time
and an errors file as long as the input (a 200,000-row file cost 30 s and 34 MB).

What a producer sends and gets back is the record's ``pipeline`` section when the worker has a
pipeline (its handler's raw inputs, such as an image's bytes or a sentence, and its declared
outputs, or None when it declares none), else the model's own ``inputs`` and ``outputs``
(``request_specs``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from producer.protocol import codec
from producer.protocol.errors import UsageError

__all__ = [
    "RequestSpecs",
    "check_against_workers",
    "model_dtypes",
    "request_specs",
    "single_input_name",
]

_TEXT = ("string", "bytes")


@dataclass(frozen=True, slots=True)
class RequestSpecs:
    """What requests to a worker carry: its inputs, its outputs (None: not declared, so any
    name may come back), and whether a pipeline stands before the model."""

    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]] | None
    pipeline: bool


def request_specs(record: Mapping[str, Any]) -> RequestSpecs:
    """The inputs and outputs requests to this worker carry: its pipeline's when it has one,
    else its model's."""
    pipeline = record.get("pipeline")
    if isinstance(pipeline, dict):
        outputs = pipeline.get("outputs")
        return RequestSpecs(
            _specs(pipeline.get("inputs")),
            _specs(outputs) if isinstance(outputs, list) else None,
            True,
        )
    return RequestSpecs(_specs(record.get("inputs")), _specs(record.get("outputs")), False)


def _specs(value: Any) -> list[dict[str, Any]]:
    return [s for s in value or [] if isinstance(s, dict) and isinstance(s.get("name"), str)]


def _names(specs: list[dict[str, Any]] | None) -> list[str]:
    return [str(s["name"]) for s in specs or []]


def single_input_name(args: argparse.Namespace, records: list[dict[str, Any]]) -> str:
    """The input name for a single-input file (.npy, a .txt, files): --input-name, or the one
    input a live worker reports (its pipeline's, when it has one)."""
    if args.input_name:
        return str(args.input_name)
    for record in records:
        names = _names(request_specs(record).inputs)
        if len(names) == 1:
            return names[0]
        if len(names) > 1:
            raise UsageError(
                f"model {args.model!r} takes {len(names)} inputs ({', '.join(names)}); "
                "pass an .npz, .jsonl, .parquet or .arrow holding one column per input."
            )
    raise UsageError(
        f"no live worker reports the input name of model {args.model!r}; "
        "pass --input-name NAME, or start a worker first."
    )


def model_dtypes(records: list[dict[str, Any]]) -> dict[str, str]:
    """Each input's wire dtype (numeric, ``string`` or ``bytes``), as the first live worker
    reports it for requests (its pipeline's inputs, when it has one)."""
    for record in records:
        return {
            str(s["name"]): str(s["dtype"])
            for s in request_specs(record).inputs
            if isinstance(s.get("dtype"), str)
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
    specs = request_specs(record)
    expected = set(_names(specs.inputs))
    if expected and set(arrays) != expected:
        whose = "pipeline inputs" if specs.pipeline else "inputs"
        raise UsageError(
            f"input arrays {sorted(arrays)} do not match model {args.model!r} {whose} "
            f"{sorted(expected)}.{_names_hint(kind, sorted(expected))}"
        )
    _check_dtypes(args.model, arrays, specs, kind)
    _check_shapes(args.model, arrays, specs)
    _check_outputs(args, specs, key_name)
    limit = (record.get("batching") or {}).get("max_batch_size")
    if isinstance(limit, int) and args.rows_per_request and args.rows_per_request > limit:
        raise UsageError(
            f"--rows-per-request {args.rows_per_request} is over the workers' "
            f"max_batch_size={limit}; use {limit} or less."
        )


def _names_hint(kind: str, expected: list[str]) -> str:
    if len(expected) == 1 and kind in ("npy", "files", "text"):
        return f" Pass --input-name {expected[0]}."
    if kind in ("jsonl", "parquet", "arrow"):
        return " Pick the columns with --columns (and --key for the one to carry along)."
    return ""


def _check_outputs(args: argparse.Namespace, specs: RequestSpecs, key_name: str | None) -> None:
    """--outputs must name outputs the workers have (when they say which: a pipeline may not
    declare its own), and none may have the key column's name."""
    outputs = set(_names(specs.outputs))
    unknown = sorted(set(args.outputs or ()) - outputs) if outputs else []
    has = ", ".join(sorted(outputs))
    if unknown and specs.pipeline:
        raise UsageError(
            f"--outputs {', '.join(unknown)}: the pipeline of model {args.model!r} answers no "
            f"such output (its replies carry the pipeline's outputs, not the model's); the "
            f"pipeline answers {has}."
        )
    if unknown:
        raise UsageError(
            f"--outputs {', '.join(unknown)}: model {args.model!r} has no such output; it has "
            f"{has}."
        )
    if key_name is not None and key_name in (args.outputs or outputs):
        whose = _whose(args.model, specs.pipeline)
        verb = "answers" if specs.pipeline else "has"
        raise UsageError(
            f"{whose} {verb} an output named {key_name!r}, the key column the outputs carry; "
            "leave it out with --outputs, or carry another key (--key)."
        )


def _whose(model: str, pipeline: bool) -> str:
    """Who takes the inputs and answers: the pipeline before the model, or the model."""
    return f"the pipeline of model {model!r}" if pipeline else f"model {model!r}"


def _check_dtypes(
    model: str, arrays: Mapping[str, np.ndarray], specs: RequestSpecs, kind: str
) -> None:
    """A dtype the workers do not take fails every request, one by one: say so before sending
    (the workers never convert types; the input is the caller's to cast)."""
    for spec in specs.inputs:
        if spec["name"] not in arrays:
            continue
        name, want = spec["name"], spec.get("dtype")
        array = arrays[name]
        got = codec.wire_dtype(array) or str(array.dtype)
        if not isinstance(want, str) or want not in codec.WIRE_DTYPES or got == want:
            continue
        whose = _whose(model, specs.pipeline)
        raise UsageError(
            f"input {name!r} is {got}, but {whose} takes {want}: every request would be "
            f"refused. {_cast_hint(kind, name, want, specs.pipeline)}"
        )


def _cast_hint(kind: str, name: str, want: str, pipeline: bool) -> str:
    numeric = want in codec.DTYPES
    if kind in ("npy", "npz", "arrays") and numeric:
        return f"Cast the array first, e.g. np.save(path, x.astype(np.{want}))."
    if kind in ("jsonl", "parquet", "arrow") and numeric:
        return f"Pass --dtype {name}={want}, or cast the column first."
    if not numeric:
        return (
            f"Send {want} rows: a folder or glob of files, a .txt (a row per line), or a "
            f"column of text or binary in a .jsonl, .parquet or .arrow (--dtype {name}={want})."
        )
    if pipeline:
        return f"Send {want} values for it."
    sent = {"text": "A .txt sends string rows", "files": "Files are sent as bytes rows"}
    return (
        f"{sent.get(kind, 'This input sends text')}, and the workers have no [pipeline] to "
        "turn them into tensors: serve the model with one (README, 'Examples'), or send an "
        ".npy or .npz of tensors."
    )


def _check_shapes(model: str, arrays: Mapping[str, np.ndarray], specs: RequestSpecs) -> None:
    """Likewise a row shape the workers do not take: every request would be refused, one by
    one."""
    for spec in specs.inputs:
        shape = spec.get("shape")
        if not isinstance(shape, list) or spec["name"] not in arrays or not shape:
            continue
        got = arrays[spec["name"]].shape
        fits = len(got) == len(shape) and all(
            not isinstance(want, int) or want < 0 or want == have
            for want, have in zip(shape[1:], got[1:], strict=True)
        )
        if fits:
            continue
        rows_of = ", ".join(str(d if isinstance(d, int) and d >= 0 else "N") for d in shape[1:])
        whose = _whose(model, specs.pipeline)
        raise UsageError(
            f"input {spec['name']!r} has shape {list(got)}, but {whose} takes rows of shape "
            f"[{rows_of}] (its shape is {shape}): every request would be refused."
        )
