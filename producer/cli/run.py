"""``redbatch run``: an input's rows through a model's workers, the replies written.

The command half of a job: its options, the checks made before anything is sent (paths, and the
inputs against a live worker's record: ``producer.jobs.checks``), Ctrl-C and SIGTERM handling,
and the exit status. The work itself is ``producer.jobs.job``'s ``run_job``; the input is opened by
``producer.jobs.sources``, the outputs written by ``producer.jobs.sinks``, the errors file by
``producer.jobs.files``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import signal
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from producer.cli import argtypes
from producer.cli.argtypes import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    print_error,
)
from producer.cli.reach import live_models
from producer.jobs.blocks import Source, SourceOptions
from producer.jobs.checks import check_against_workers, model_dtypes, single_input_name
from producer.jobs.files import ErrorsFile
from producer.jobs.job import RunSummary, format_summary, run_job
from producer.jobs.preflight import live_records, require_worker
from producer.jobs.sinks import Sink, open_sink
from producer.jobs.sources import FORMATS, input_kind, open_source
from producer.jobs.tables import pyarrow
from producer.protocol.lanes import CLASSES, is_valid_tenant
from producer.redisio.memory import DEFAULT_HIGH_WATERMARK

if TYPE_CHECKING:
    from producer.client.blocking import Client
    from producer.client.results import Chunk

__all__ = ["HELP", "add_arguments", "run_command"]

HELP = """\
Send every row of an input as requests to the model's workers, write the replies in input
order, and print a summary (rows ok and failed, throughput, latency percentiles, batch sizes,
the workers and model versions that served).

Inputs (the kind is told from the name; --format overrides):
  X.npy, X.npz       arrays, memory-mapped: an .npy is the model's single input (named by
                     --input-name or a live worker's record), an .npz holds one array per input
  DIR/, 'GLOB'       one bytes row per file, sorted by path (a directory: every file under it,
                     hidden ones left out; quote a glob so the shell leaves it alone; '**'
                     recurses); the input named as for an .npy; key: path
  X.txt              one string row per line, its newline (\\n or \\r\\n) removed and nothing
                     else; empty lines are skipped (--keep-empty-lines sends them); key: line
  X.jsonl, X.ndjson  one JSON object per line; the first one's keys are the inputs (--columns
                     picks them; other keys of later lines are ignored):
                     strings are string rows, numbers and lists of numbers numeric ones
                     (dtype: --dtype, else the live workers' dtype for that input, else int64
                     for integers, float32 for other numbers; a value the cast would change,
                     1.5 as int64 or 300 as uint8, is not sent); key: line, or --key
  X.parquet, X.arrow, X.feather
                     columns via pyarrow (pip install 'redbatch[parquet]'): strings, binary,
                     numbers, and (fixed-size) lists of numbers as 2-D rows; dtypes as for
                     JSON lines; key: row (0-based), or --key
The inputs and their dtypes are those requests carry: a worker with a [pipeline] takes its
handler's raw inputs (the image example's 'image' bytes, the text example's 'text' string),
not its model's tensors. Text is sent as the input takes it: --dtype NAME=string|bytes, else
the live workers' dtype for that input, else as read (lines and JSON strings: string; files
and binary columns: bytes); strings become bytes as UTF-8, and bytes that are not UTF-8 are
not sent as a string (the record is skipped as UNREADABLE).
Every input but arrays is read a block at a time as rows are sent, so an input far larger
than memory streams through in bounded memory. A record that cannot be a row (a file that
cannot be read, a line that is not UTF-8 or not an object with every input, a value of
another type or shape than the first row's, a null) is skipped, listed as UNREADABLE, and the
run goes on.

Outputs: Y.npz (one array per output, plus the key array for inputs other than arrays),
Y.parquet (the key column, then one column per output; pyarrow) or Y.jsonl (one JSON object
per row: the key, then each output's value: a number, a string, or lists for vectors). All are
written as the replies come, in bounded memory: a .parquet a row group at a time, a .jsonl a
line per row; an .npz through a temporary file per output beside it, zipped at the end (so it
needs its size again in free disk meanwhile). Text outputs in an .npz are fixed-width arrays
('<U' for string, 'S' for bytes: np.load reads them without allow_pickle; NumPy drops
trailing NUL bytes of bytes outputs: write a .parquet to keep them); in a .jsonl, bytes
outputs are base64 text. Rows of failed requests are NaN (float outputs), 0 or empty in an
.npz, null in a .parquet and a .jsonl (as are NaN and infinite values there), and are listed
in the errors file (always written; empty when every row succeeded): one JSON line per
failed request, with its "rid" and the worker's message, or per range of rows that share one
fate (never sent, not answered; "rid" null), with "start" and "stop" row numbers (counted
from 0, "stop" one past the last; null: to the end of an input that was never read to its
end) and, for keyed inputs, the "key" and "last_key" of its rows. The summary names the first
failure by the same row numbers and key.
When a reply does not come within --timeout-s of its request, the run sends nothing more: the
requests already in flight are still awaited, each late one is cancelled and listed with the
client-side code WAIT_TIMEOUT, and so are the rows never sent. A crashed worker's requests are
taken over after the workers' claim_idle_ms (30 s by default), so keep --timeout-s above it.
Ctrl-C or SIGTERM stops the run too, writing the rows answered so far and listing the rest as
NOT_ANSWERED (before any reply came, it writes nothing, so an earlier run's output and errors
file stay as they were).
A run is a batch job: its requests go to the low lane by default (--priority low), so that
callers of the same model who wait for a reply (class normal or high) are served first and
never queue behind the run's rows, while the run still gets a minimum share of the workers
when they are busy (the workers' [scheduling] settings). --tenant NAME sends them to that
tenant's lane of the class instead, served by weight beside the other tenants' (its request
ids begin with NAME.; a Redis user confined to the tenant can run it). docs/protocol.md,
"Lanes", says more.
Before anything is sent, the model must have a live worker: a model without one (a misspelled
name, say) is refused at once, naming the models that have workers, unless --wait-for-worker
queues the requests for a worker still to come. Redis must answer then within 3 s (or within
--retry-s when given); once the run has started, it rides out outages of up to --retry-s.
Exit status: 0 when every row succeeded, 1 when any failed, 2 when the command could not run,
130 when interrupted.

examples:
  redbatch run --model demo --input features.npy --output predictions.npz
  redbatch run --model demo --input inputs.npz --output y.npz --rows-per-request 16 --no-progress
  redbatch run --model demo --input features.npy --output y.npz --priority normal --tenant acme
  redbatch run --model orientation --input 'images/**/*.jpg' --output labels.parquet
  redbatch run --model minilm --input sentences.txt --output vectors.parquet
  redbatch run --model minilm --input docs.jsonl --key id --output vectors.jsonl
  redbatch run --model minilm --input table.parquet --columns text --key id --output vectors.npz
  redbatch run --model minilm --input notes/ --input-name text --dtype text=string \\
      --output vectors.parquet
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``run`` command's options (the connection options are ``cli``'s)."""
    parser.add_argument("--model", required=True, type=argtypes.model_name, help="model name")
    parser.add_argument(
        "--input",
        required=True,
        metavar="PATH",
        help="an .npy, .npz, .txt, .jsonl, .parquet or .arrow file, a directory, or a quoted glob",
    )
    parser.add_argument(
        "--output",
        required=True,
        metavar="Y.npz|Y.parquet|Y.jsonl",
        help="where to write outputs",
    )
    parser.add_argument(
        "--errors",
        metavar="ERRS.jsonl",
        help="failed requests, one JSON line each; always written, empty when every row "
        "succeeded (default: OUTPUT.errors.jsonl)",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="auto",
        help="the input's kind (default: auto, from its name; a directory or glob is 'files')",
    )
    parser.add_argument(
        "--input-name",
        metavar="NAME",
        help="input name for an .npy, a .txt or files (default: the model's one input, from a "
        "live worker)",
    )
    parser.add_argument(
        "--columns",
        type=_output_names,
        metavar="NAME[,NAME]",
        help=".jsonl, .parquet, .arrow: the columns to send (default: all but --key)",
    )
    parser.add_argument(
        "--key",
        metavar="COLUMN",
        help=".jsonl, .parquet, .arrow: a column carried to the outputs and the errors file to "
        "join rows back by (default: the line number, or the row index)",
    )
    parser.add_argument(
        "--dtype",
        type=argtypes.dtype_specs,
        action="extend",
        default=[],
        metavar="NAME=DTYPE[,...]",
        help="send input NAME as this dtype: string or bytes (any input but arrays), or a "
        "numeric dtype (.jsonl, .parquet, .arrow); repeatable",
    )
    parser.add_argument(
        "--keep-empty-lines",
        action="store_true",
        help=".txt: send empty lines as empty strings (default: skip them; keys still name "
        "each row's line)",
    )
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
    parser.add_argument(
        "--wait-for-worker",
        action="store_true",
        help="send even when the model has no live worker, the requests waiting in the stream "
        "until one starts (default: refuse, naming the models that have workers)",
    )
    parser.add_argument(
        "--priority",
        choices=CLASSES,
        default="low",
        help="the requests' class: high, normal or low (default: low, a batch job, served "
        "after interactive callers' requests but never starved)",
    )
    parser.add_argument(
        "--tenant",
        type=_tenant_name,
        metavar="NAME",
        help="send to this tenant's lane of the class (request ids NAME.*); default: none",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _tenant_name(text: str) -> str:
    if not is_valid_tenant(text):
        raise argparse.ArgumentTypeError(f"{text!r} does not match [A-Za-z0-9_-]{{1,64}}")
    return text


def _output_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one output name")
    return names


def run_command(args: argparse.Namespace) -> int:
    """``redbatch run``: returns the exit status."""
    argtypes.require_cli_extra("tqdm", "redbatch run")
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
    from producer.client.blocking import Client

    output_path = Path(args.output)
    errors_path = Path(args.errors) if args.errors else Path(f"{output_path}.errors.jsonl")
    kind = _check_run_paths(args, output_path, errors_path)
    records = live_records(args)
    summary = None
    written = _Written()
    try:
        with Client(
            args.model,
            args.redis_url,
            prefix=args.prefix,
            retry_s=args.retry_s,
            wait_for_backlog=args.wait_for_room,
            memory_high_watermark=args.memory_high_watermark,
        ) as c:
            source = _open_input(args, kind, records, (output_path, errors_path))
            key_name = source.key_name if source.keyed or output_path.suffix != ".npz" else None
            written.sink = open_sink(output_path, key_name)
            written.errors = ErrorsFile(errors_path)
            progress = _progress_bar(source.total, source.unit, disable=args.no_progress)
            try:
                summary = run_job(
                    _InLane(c, args.priority, args.tenant),
                    source,
                    rows_per_request=args.rows_per_request,
                    concurrency=args.concurrency,
                    outputs=args.outputs,
                    timeout_s=args.timeout_s,
                    on_progress=progress.update,
                    sink=written.sink,
                    errors=written.errors.write,
                )
            finally:
                progress.close()
    except KeyboardInterrupt:
        if summary is None:
            written.discard()
            raise
        summary.interrupted = True  # came after the job, while closing: the results stand
    except BaseException:
        written.discard()
        raise
    return _finish_run(summary, written, output_path, errors_path)


def _open_input(
    args: argparse.Namespace, kind: str, records: list[dict[str, Any]], exclude: tuple[Path, ...]
) -> Source:
    """The input opened, and its first rows checked against a live worker's record."""

    def input_name() -> str:
        if not args.input_name:
            require_worker(
                args, records, lambda: live_models(args)
            )  # a misspelled model, more likely than a missing name
        return single_input_name(args, records)

    options = SourceOptions(
        input_name=input_name,
        format=kind,
        columns=tuple(args.columns) if args.columns else None,
        key=args.key,
        dtypes=dict(args.dtype),
        model_dtypes=model_dtypes(records),
        keep_empty_lines=args.keep_empty_lines,
        exclude=exclude,
    )
    source = open_source(args.input, options)
    require_worker(args, records, lambda: live_models(args))
    if source.arrays is not None:
        first = source.arrays
    else:  # the first block, read ahead and put back
        block = next(source.blocks, None)
        if block is None:
            return source
        source.blocks = itertools.chain([block], source.blocks)
        first = block.inputs if block.rows else {}
    key_name = source.key_name if source.keyed or not args.output.endswith(".npz") else None
    if first:
        check_against_workers(args, first, records, source.kind, key_name)
    return source


class _InLane:
    """The client as ``run_job`` calls it (``Mapper``), its ``map`` sending to the run's lane."""

    def __init__(self, client: Client, priority: str, tenant: str | None) -> None:
        self._client, self._priority, self._tenant = client, priority, tenant

    def map(self, arrays: Mapping[str, Any], **options: Any) -> Iterable[Chunk]:
        return self._client.map(arrays, priority=self._priority, tenant=self._tenant, **options)


class _Written:
    """The run's output and errors file while they are written (temporary files)."""

    def __init__(self) -> None:
        self.sink: Sink | None = None
        self.errors: ErrorsFile | None = None

    def commit(self) -> None:
        """The errors file first: it says what the outputs lack."""
        assert self.sink is not None
        assert self.errors is not None
        self.errors.commit()
        self.sink.commit()

    def discard(self) -> None:
        for part in (self.sink, self.errors):
            if part is not None:
                part.discard()


def _finish_run(
    summary: RunSummary, written: _Written, output_path: Path, errors_path: Path
) -> int:
    """Write the errors file, then the outputs (Ctrl-C held meanwhile), print the summary, and
    say how the run ended. Interrupted before any reply came, nothing is written, so that the
    files of an earlier run are kept as a pair."""
    if summary.interrupted and not summary.requests:
        written.discard()
        print(format_summary(summary))
        print(f"output      {output_path} and {errors_path}: not written (nothing answered)")
        print_error("interrupted before any reply came; nothing was written")
        return EXIT_INTERRUPTED
    with _sigint_deferred() as deferred:
        written.commit()
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


def _check_run_paths(args: argparse.Namespace, output_path: Path, errors_path: Path) -> str:
    """Check the paths before Redis is asked anything; returns the input's kind."""
    kind = input_kind(args.input, args.format)
    input_path = Path(args.input)
    if kind != "files" and not input_path.is_file():
        raise UsageError(f"input file {args.input!r} does not exist.")
    for path in (output_path, errors_path):
        if not path.parent.is_dir():
            raise UsageError(f"directory {str(path.parent)!r} for {str(path)!r} does not exist.")
    if kind != "files" and output_path.resolve() == input_path.resolve():
        raise UsageError("--output must not be the --input file.")
    if errors_path.resolve() == output_path.resolve() or (
        kind != "files" and errors_path.resolve() == input_path.resolve()
    ):
        which = "--output" if errors_path.resolve() == output_path.resolve() else "--input"
        raise UsageError(f"--errors must not be the {which} file.")
    if output_path.suffix not in (".npz", ".parquet", ".jsonl"):
        raise UsageError(
            f"--output {str(output_path)!r}: outputs are written as an .npz (one array per "
            "model output), a .parquet (one column per output) or a .jsonl (one object per "
            "row); give a name that ends in .npz, .parquet or .jsonl."
        )
    if output_path.suffix == ".parquet":
        pyarrow()  # a missing extra is said before Redis is asked anything
    return kind


def _progress_bar(total: int | None, unit: str, *, disable: bool) -> Any:
    from tqdm import tqdm

    # disable=None lets tqdm turn itself off when stderr is not a terminal.
    return tqdm(
        total=total,
        unit=unit,
        unit_scale=unit == "B",
        file=sys.stderr,
        disable=True if disable else None,
    )
