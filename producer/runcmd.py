"""``redbatch run``: an input file's rows through a model's workers, the replies written.

The command half of a job: its options, the checks made before anything is sent (paths, and the
inputs against a live worker's record: names, dtypes, row shapes, outputs, rows per request),
Ctrl-C and SIGTERM handling, and the exit status. The work itself is ``producer.job``'s:
``load_inputs``, ``run_job``, ``write_errors``/``write_outputs`` and ``format_summary``.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from producer import argtypes
from producer.argtypes import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    print_error,
)
from producer.job import (
    RunSummary,
    format_summary,
    leading_rows,
    load_inputs,
    run_job,
    write_errors,
    write_outputs,
)
from producer.memory import DEFAULT_HIGH_WATERMARK

__all__ = ["HELP", "add_arguments", "run_command"]

HELP = """\
Send every row of an .npy or .npz file as requests to the model's workers, stack the replies in
input order into one .npz, and print a summary (rows ok and failed, throughput, latency
percentiles, batch sizes, the workers and model versions that served).

An .npy is the model's single input, named by --input-name or by a live worker's record; an
.npz holds one array per input, named as the model names them. Rows of failed requests are NaN
(float outputs) or 0 in the output and are listed in the errors file: one JSON line per failed
request, or per range of rows that share one fate (never sent, not answered), with "start" and
"stop" row numbers. When a reply does not come within --timeout-s of its request, the run sends
nothing more: the requests already in flight are still awaited, each late one is cancelled and
listed with the client-side code WAIT_TIMEOUT, and so are the rows never sent. A crashed
worker's requests are taken over after the workers' claim_idle_ms (30 s by default), so keep
--timeout-s above it. Ctrl-C or SIGTERM stops the run too, writing the rows answered so far and
listing the rest as NOT_ANSWERED (before any reply came, it writes nothing, so an earlier run's
output and errors file stay as they were).
Exit status: 0 when every row succeeded, 1 when any failed, 2 when the command could not run,
130 when interrupted.

examples:
  redbatch run --model demo --input x.npy --output y.npz
  redbatch run --model demo --input x.npy --input-name x --output y.npz --errors bad.jsonl
  redbatch run --model demo --input inputs.npz --output y.npz --rows-per-request 16 --no-progress
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``run`` command's options (the connection options are ``cli``'s)."""
    parser.add_argument("--model", required=True, type=argtypes.model_name, help="model name")
    parser.add_argument("--input", required=True, metavar="X.npy|X.npz", help="input array file")
    parser.add_argument("--output", required=True, metavar="Y.npz", help="where to write outputs")
    parser.add_argument(
        "--errors",
        metavar="ERRS.jsonl",
        help="failed requests, one JSON line each (default: OUTPUT.errors.jsonl)",
    )
    parser.add_argument("--input-name", metavar="NAME", help="input name for an .npy file")
    parser.add_argument(
        "--outputs",
        type=_output_names,
        metavar="NAME[,NAME]",
        help="model outputs to fetch (default: all)",
    )
    parser.add_argument(
        "--rows-per-request",
        type=argtypes.positive_int,
        default=1,
        metavar="N",
        help="rows per request; 1 (default) makes failures per row",
    )
    parser.add_argument(
        "--concurrency",
        type=argtypes.positive_int,
        default=256,
        metavar="N",
        help="requests in flight at once (default: 256)",
    )
    parser.add_argument(
        "--timeout-s",
        type=argtypes.positive_float,
        default=60.0,
        metavar="S",
        help="how long to wait for each reply (default: 60)",
    )
    parser.add_argument(
        "--memory-high-watermark",
        type=argtypes.watermark,
        default=DEFAULT_HIGH_WATERMARK,
        metavar="F",
        help="stop sending once Redis used_memory reaches this fraction of maxmemory, leaving "
        f"the workers room to drain (default: {DEFAULT_HIGH_WATERMARK:g}; off: never)",
    )
    parser.add_argument(
        "--wait-for-room",
        action="store_true",
        help="when Redis is that full, wait for the workers to free room instead of stopping "
        "the run (exit 1, the rows not sent listed REDIS_FULL)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _output_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one output name")
    return names


def run_command(args: argparse.Namespace) -> int:
    """``redbatch run``: returns the exit status."""
    with _sigterm_as_ctrl_c():
        return _run(args)


@contextlib.contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM, the way orchestrators stop a job, ends a run as Ctrl-C does: the rows answered
    are written and the rest listed NOT_ANSWERED, instead of the process dying with nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    from producer.client import Client

    input_path, output_path = Path(args.input), Path(args.output)
    errors_path = Path(args.errors) if args.errors else Path(f"{output_path}.errors.jsonl")
    _check_run_paths(input_path, output_path, errors_path)
    summary = None
    try:
        with Client(
            args.model,
            args.redis_url,
            prefix=args.prefix,
            retry_s=args.retry_s,
            wait_for_backlog=args.wait_for_room,
            memory_high_watermark=args.memory_high_watermark,
        ) as c:
            records = [r for r in c.workers() if isinstance(r, dict)]
            arrays = load_inputs(input_path, lambda: _single_input_name(args, records))
            _check_against_workers(args, arrays, records)
            progress = _progress_bar(leading_rows(arrays), disable=args.no_progress)
            try:
                summary = run_job(
                    c,
                    arrays,
                    rows_per_request=args.rows_per_request,
                    concurrency=args.concurrency,
                    outputs=args.outputs,
                    timeout_s=args.timeout_s,
                    on_rows=progress.update,
                )
            finally:
                progress.close()
    except KeyboardInterrupt:
        if summary is None:
            raise
        summary.interrupted = True  # came after the job, while closing: the results stand
    return _finish_run(summary, output_path, errors_path)


def _finish_run(summary: RunSummary, output_path: Path, errors_path: Path) -> int:
    """Write the errors file, then the outputs (Ctrl-C held meanwhile), print the summary, and
    say how the run ended. Interrupted before any reply came, nothing is written, so that the
    files of an earlier run are kept as a pair."""
    if summary.interrupted and not summary.requests:
        print(format_summary(summary))
        print(f"output      {output_path} and {errors_path}: not written (nothing answered)")
        print_error("interrupted before any reply came; nothing was written")
        return EXIT_INTERRUPTED
    with _sigint_deferred() as deferred:
        write_errors(errors_path, summary.failures)  # first: it says what the outputs lack
        write_outputs(output_path, summary.outputs)
    print(format_summary(summary, output_path=str(output_path), errors_path=str(errors_path)))
    if summary.stopped_by is not None:
        print_error(f"the run stopped early: {summary.stopped_by}")
    if summary.interrupted:
        print_error(
            "interrupted; the rows answered so far are written, the rest listed NOT_ANSWERED "
            f"in {errors_path}"
        )
        return EXIT_INTERRUPTED
    if deferred:
        print_error("interrupted while the results were written; they were written in full")
        return EXIT_INTERRUPTED
    return EXIT_OK if summary.ok else EXIT_FAILED


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[list[int]]:
    """Hold Ctrl-C (and SIGTERM) while the results are written, so that it cannot leave the
    output and errors files of two different runs side by side; a second one goes through (a
    write that hangs can still be stopped). Yields the signals held."""
    came: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield came
        return

    def hold(signum: int, _frame: object) -> None:
        if came:
            raise KeyboardInterrupt
        came.append(signum)

    previous = {signum: signal.signal(signum, hold) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield came
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _check_run_paths(input_path: Path, output_path: Path, errors_path: Path) -> None:
    if not input_path.is_file():
        raise UsageError(f"input file {str(input_path)!r} does not exist.")
    for path in (output_path, errors_path):
        if not path.parent.is_dir():
            raise UsageError(f"directory {str(path.parent)!r} for {str(path)!r} does not exist.")
    if output_path.resolve() == input_path.resolve():
        raise UsageError("--output must not be the --input file.")
    if errors_path.resolve() in (input_path.resolve(), output_path.resolve()):
        which = "--input" if errors_path.resolve() == input_path.resolve() else "--output"
        raise UsageError(f"--errors must not be the {which} file.")
    if output_path.suffix != ".npz":
        raise UsageError(
            f"--output {str(output_path)!r}: outputs are written as an .npz (one array per "
            "model output); give a name that ends in .npz."
        )


def _single_input_name(args: argparse.Namespace, records: list[dict[str, Any]]) -> str:
    """The input name for a .npy: --input-name, or the one input a live worker reports."""
    if args.input_name:
        return str(args.input_name)
    for record in records:
        names = [i.get("name") for i in record.get("inputs") or [] if isinstance(i, dict)]
        if len(names) == 1 and isinstance(names[0], str):
            return names[0]
        if len(names) > 1:
            raise UsageError(
                f"model {args.model!r} takes {len(names)} inputs ({', '.join(map(str, names))}); "
                "pass an .npz holding one array per input."
            )
    raise UsageError(
        f"no live worker reports the input name of model {args.model!r}; "
        "pass --input-name NAME, or start a worker first."
    )


def _check_against_workers(
    args: argparse.Namespace, arrays: Mapping[str, np.ndarray], records: list[dict[str, Any]]
) -> None:
    """Fail before sending anything when a live worker already says every request would fail."""
    if not records:
        print(
            f"redbatch: note: no live worker for model {args.model!r}; "
            "requests wait in the stream until one starts.",
            file=sys.stderr,
        )
        return
    record = records[0]
    expected = {i.get("name") for i in record.get("inputs") or [] if isinstance(i, dict)}
    if expected and set(arrays) != expected:
        raise UsageError(
            f"input arrays {sorted(arrays)} do not match model {args.model!r} inputs "
            f"{sorted(map(str, expected))}."
        )
    _check_dtypes(args.model, arrays, record)
    _check_shapes(args.model, arrays, record)
    outputs = {o.get("name") for o in record.get("outputs") or [] if isinstance(o, dict)}
    unknown = sorted(set(args.outputs or ()) - outputs) if outputs else []
    if unknown:
        raise UsageError(
            f"--outputs {', '.join(unknown)}: model {args.model!r} has no such output; it has "
            f"{', '.join(sorted(map(str, outputs)))}."
        )
    limit = (record.get("batching") or {}).get("max_batch_size")
    if isinstance(limit, int) and args.rows_per_request and args.rows_per_request > limit:
        raise UsageError(
            f"--rows-per-request {args.rows_per_request} is over the workers' "
            f"max_batch_size={limit}; use {limit} or less."
        )


def _check_dtypes(model: str, arrays: Mapping[str, np.ndarray], record: dict[str, Any]) -> None:
    """A dtype the model does not take fails every request, one by one: say so before sending
    (the workers never convert types; the file is the caller's to cast)."""
    for spec in record.get("inputs") or []:
        if not isinstance(spec, dict) or spec.get("name") not in arrays:
            continue
        want, got = spec.get("dtype"), arrays[spec["name"]].dtype.newbyteorder("=")
        with contextlib.suppress(TypeError):  # a dtype numpy does not know: let the worker judge
            if isinstance(want, str) and want and got != np.dtype(want):
                raise UsageError(
                    f"input {spec['name']!r} is {got}, but model {model!r} takes {want}: every "
                    f"request would be refused. Cast the array first, e.g. "
                    f"np.save(path, x.astype(np.{want}))."
                )


def _check_shapes(model: str, arrays: Mapping[str, np.ndarray], record: dict[str, Any]) -> None:
    """Likewise a row shape the model does not take: every request would be refused, one by
    one (a 200,000-row file cost 30 s of worker time and a 34 MB errors file)."""
    for spec in record.get("inputs") or []:
        shape = spec.get("shape") if isinstance(spec, dict) else None
        if not isinstance(shape, list) or spec.get("name") not in arrays or not shape:
            continue
        got = arrays[spec["name"]].shape
        fits = len(got) == len(shape) and all(
            not isinstance(want, int) or want < 0 or want == have
            for want, have in zip(shape[1:], got[1:], strict=True)
        )
        if not fits:
            rows_of = ", ".join(str(d if isinstance(d, int) and d >= 0 else "N") for d in shape[1:])
            raise UsageError(
                f"input {spec['name']!r} has shape {list(got)}, but model {model!r} takes "
                f"rows of shape [{rows_of}] (the model's shape is {shape}): every request "
                "would be refused."
            )


def _progress_bar(total: int, *, disable: bool) -> Any:
    from tqdm import tqdm

    # disable=None lets tqdm turn itself off when stderr is not a terminal.
    return tqdm(total=total, unit="row", file=sys.stderr, disable=True if disable else None)
