"""One batch job: an input's rows sent through a model, the replies written, the job measured.

This is the library half of ``redbatch run``, kept apart from the command (``producer.cli.run``)
so that a job can be run and reported from Python (the tests do) without argv: ``run_job``
feeds the rows through ``Client.map`` and hands the replies, in input order, to a sink;
``producer.jobs.summary`` counts and reports. The input is arrays, or a ``blocks.Source`` read
block by block as map() sends (``producer.jobs.ledger`` keeps the keys of the rows in flight); the
outputs go to a ``sinks.Sink`` (arrays in memory by default, an .npz or a .parquet), the
failures to the errors file (``files.ErrorsFile``) as they come. Nothing the job holds grows
with the input but a few counters: a run over an input far larger than memory runs in a
bounded window.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from producer.client import maprows
from producer.client.results import WAIT_TIMEOUT, Chunk
from producer.jobs.blocks import Block, Source
from producer.jobs.files import FailedRequest, load_inputs, write_errors, write_outputs
from producer.jobs.ledger import Ledger
from producer.jobs.sinks import MemorySink, Sink
from producer.jobs.summary import RunSummary, format_summary, one_line, rows_text
from producer.protocol.codec import ErrorInfo
from producer.protocol.errors import RedbatchError, RedisFull, UsageError

#: The client-side code of rows a run never sent because Redis was full (``RedisFull``).
REDIS_FULL = "REDIS_FULL"
#: The client-side code of input records a reader could not turn into rows (never sent).
UNREADABLE = "UNREADABLE"
_FILL_ROWS = 65536  # rows never sent are written to the outputs this many at a time

__all__ = [
    "REDIS_FULL",
    "UNREADABLE",
    "FailedRequest",
    "Mapper",
    "RunSummary",
    "UsageError",
    "format_summary",
    "leading_rows",
    "load_inputs",
    "one_line",
    "run_job",
    "write_errors",
    "write_outputs",
]


# ---------------------------------------------------------------------------------------------
# The job


class Mapper(Protocol):
    """What run_job needs of a client: ``Client.map``."""

    def map(
        self,
        arrays: Mapping[str, Any],
        *,
        rows_per_request: int | None,
        concurrency: int,
        outputs: Sequence[str] | None,
        timeout_s: float,
        stop_on_timeout: bool,
    ) -> Iterable[Chunk]: ...


def run_job(
    client: Mapper,
    inputs: Mapping[str, np.ndarray] | Source,
    *,
    rows_per_request: int | None = 1,
    concurrency: int = 256,
    outputs: Sequence[str] | None = None,
    timeout_s: float = 60.0,
    on_progress: Callable[[int], object] | None = None,
    sink: Sink | None = None,
    errors: Callable[[FailedRequest], object] | None = None,
) -> RunSummary:
    """Send every row of ``inputs`` through ``client.map`` and hand the replies, in input order,
    to ``sink`` (default: a ``MemorySink``, whose arrays become ``summary.outputs``).

    Rows of failed requests are NaN in float outputs and zero otherwise (null in Parquet), and
    are listed in ``failures``, or written to ``errors`` (the errors file's ``write``) as they
    come. When a reply does not come within ``timeout_s``, the job sends nothing more: the
    requests already in flight are still awaited (each within its own timeout), and the rows
    never sent are one failure with code ``WAIT_TIMEOUT`` (a client-side code). A job whose
    workers are gone thus ends after one timeout, not one per window of requests. Ctrl-C
    (KeyboardInterrupt) stops it too, with the rows not yet answered listed as
    ``NOT_ANSWERED`` and ``interrupted`` set, so that the caller can still write what came
    back. ``on_progress(n)`` is called as rows come back, ``n`` in the source's unit: rows
    (and records skipped), or bytes of the input for text and JSON lines.
    """
    source = inputs if isinstance(inputs, Source) else _array_source(inputs)
    job = _Job(source, sink or MemorySink(), on_progress, errors)
    return job.run(client, rows_per_request, concurrency, outputs, timeout_s)


def _array_source(arrays: Mapping[str, np.ndarray]) -> Source:
    rows = leading_rows(arrays)
    return Source(
        "arrays", list(arrays), "row", iter([Block(dict(arrays))]), rows, rows, "row", arrays
    )


class _Job:
    """One run_job call: map()'s chunks to the sink, the summary and the errors."""

    def __init__(
        self,
        source: Source,
        sink: Sink,
        on_progress: Callable[[int], object] | None,
        errors: Callable[[FailedRequest], object] | None,
    ) -> None:
        self.source = source
        self.sink = sink
        self.ledger = Ledger(source)
        key_name = source.key_name if source.keyed else None
        self.summary = RunSummary(rows=source.rows or 0, spill=errors, key_name=key_name)
        self.on_progress = on_progress
        self.done = 0  # rows yielded by map()
        self.position = 0  # progress reported, in the source's unit

    def run(
        self,
        client: Mapper,
        rows_per_request: int | None,
        concurrency: int,
        outputs: Sequence[str] | None,
        timeout_s: float,
    ) -> RunSummary:
        summary, source = self.summary, self.source
        summary.rows_per_request = rows_per_request
        arrays = source.arrays
        started = time.monotonic()
        chunks = client.map(
            arrays if arrays is not None else maprows.chunks(source.names, self.ledger.inputs()),
            rows_per_request=rows_per_request,
            concurrency=concurrency,
            outputs=list(outputs) if outputs is not None else None,
            timeout_s=timeout_s,
            stop_on_timeout=True,
        )
        late: Chunk | None = None  # the first request whose reply did not come in time
        try:
            for chunk in chunks:
                if chunk.error is not None and chunk.error.code == WAIT_TIMEOUT:
                    late = late or chunk
                else:
                    _record_reply(summary, chunk)
                self._take(chunk)
            self._skips(None)
            if not self._all_done():  # map() stopped sending at a late reply
                self._fail_rest(*_not_sent(late, timeout_s))
        except RedisFull as exc:  # map() stopped sending, and awaited what it had sent
            self._fail_rest(REDIS_FULL, one_line(exc))
            summary.stopped_by = one_line(exc)
        except RedbatchError as exc:  # Redis went away mid-run: keep what came back, mark the rest
            self._fail_rest("NOT_ANSWERED", one_line(exc))
            summary.stopped_by = one_line(exc)
        except KeyboardInterrupt:
            summary.interrupted = True
            message = "the run was interrupted (Ctrl-C) before these rows were answered."
            self._fail_rest("NOT_ANSWERED", message)
        finally:
            _close(chunks, summary)
        summary.wall_s = time.monotonic() - started
        self._count_rows()
        summary.flush_failures()
        summary.output_columns = self.sink.describe()
        if isinstance(self.sink, MemorySink):
            summary.outputs = self.sink.arrays
        return summary

    def _take(self, chunk: Chunk) -> None:
        """One answered (or late) request: its rows to the sink, its failure listed."""
        self._skips(chunk.start)
        keys = self.ledger.keys(chunk.start, chunk.stop)
        error = chunk.error
        if chunk.ok:
            error = self.sink.put(chunk.start, chunk.stop, keys, chunk.outputs or {})
        else:
            self.sink.put(chunk.start, chunk.stop, keys, None)
            if error is None:
                error = ErrorInfo("INTERNAL", "the reply carried no error detail.")
        if error is not None:
            ends = (keys[0], keys[-1]) if self.source.keyed and keys is not None else None
            self.summary.fail(
                FailedRequest(chunk.start, chunk.stop, chunk.rid, error.code, error.message, ends)
            )
        self.done = chunk.stop
        self._progress(chunk.stop - chunk.start, self.ledger.position(chunk.stop))

    def _skips(self, row: int | None) -> None:
        """List the records skipped before ``row`` (None: every one read)."""
        skipped = self.ledger.skipped_until(row)
        for at, record in skipped:
            keys = (record.key, record.key)
            self.summary.skip(FailedRequest(at, at, None, UNREADABLE, record.message, keys))
        if skipped:
            self._progress(len(skipped), -1)

    def _progress(self, rows: int, position: int) -> None:
        if self.on_progress is None:
            return
        if self.source.unit == "row":
            self.on_progress(rows)
        elif position > self.position:
            self.on_progress(position - self.position)
            self.position = position

    def _all_done(self) -> bool:
        ledger = self.ledger
        return ledger.ended and self.done >= ledger.rows_read

    def _fail_rest(self, code: str, message: str) -> None:
        """List the rows after the last one yielded: sent and not answered, or never sent."""
        self._skips(self.done)
        ledger = self.ledger
        if ledger.error is not None and self.done >= ledger.rows_read:
            return  # the reader's failure ended the input here: listed by _count_rows
        stop = ledger.rows_known()
        if stop is not None and stop <= self.done:
            return
        if self.source.arrays is not None and stop is not None:  # positional: rows as today
            for start in range(self.done, stop, _FILL_ROWS):  # a piece at a time: memory
                self.sink.put(start, min(start + _FILL_ROWS, stop), None, None)
        keys = (ledger.key(self.done), None) if self.source.keyed else None
        self.summary.fail(FailedRequest(self.done, stop, None, code, message, keys))
        self._skips(None)  # records read among those rows, which were never rows either

    def _count_rows(self) -> None:
        """The input's size, as far as it is known, once the job is over."""
        summary, ledger = self.summary, self.ledger
        if ledger.error is not None and self.done >= ledger.rows_read:
            message = f"the input could not be read past this row: {one_line(ledger.error)}"
            summary.fail(FailedRequest(self.done, None, None, UNREADABLE, message, None))
            summary.stopped_by = message
        known = ledger.rows_known()
        skipped = summary.rows_skipped
        if self.source.arrays is not None:
            summary.rows = self.source.rows or 0
        elif known is not None:
            summary.rows = known + skipped
        else:
            summary.rows = ledger.rows_read + skipped
            summary.rows_unread = True
        if ledger.ended and self.source.unit != "row" and self.on_progress is not None:
            total = self.source.total or 0
            if total > self.position:
                self.on_progress(total - self.position)


def _not_sent(late: Chunk | None, timeout_s: float) -> tuple[str, str]:
    if late is None:  # a Mapper that ended early on its own
        return "NOT_ANSWERED", "not answered: the client ended before these rows were sent."
    rows = rows_text(late.start, late.stop)
    message = (
        f"not sent: the run stopped sending when the request for {rows} (rid {late.rid}) got no "
        f"reply within {timeout_s:g} s (is a worker serving this model?)."
    )
    return WAIT_TIMEOUT, message


def _close(chunks: Iterable[Chunk], summary: RunSummary) -> None:
    """Close map()'s generator, which cancels what is still in flight; a Ctrl-C meanwhile
    only marks the run interrupted, so that what came back is still written."""
    close = getattr(chunks, "close", None)
    if close is None:
        return
    try:
        close()
    except KeyboardInterrupt:
        summary.interrupted = True


def _record_reply(summary: RunSummary, chunk: Chunk) -> None:
    """Count one answered chunk, and take its latency, batch size and serving worker."""
    summary.requests += 1
    summary.rows_answered += chunk.stop - chunk.start
    summary.add_latency(chunk.latency_ms)
    result = chunk.result
    if result.ok and result.batch_rows is not None:
        summary.batch_rows[int(result.batch_rows)] += 1
    model = result.model
    summary.served[(result.worker, model.name, model.version, model.sha256)] += 1


def leading_rows(arrays: Mapping[str, np.ndarray]) -> int:
    """The row count every input shares; UsageError when there is none or they differ."""
    if not arrays:
        raise UsageError("no input arrays to send.")
    rows = {name: (a.shape[0] if a.ndim else -1) for name, a in arrays.items()}
    counts = set(rows.values())
    if len(counts) != 1 or min(counts) < 1:
        detail = ", ".join(f"{n} has {r if r >= 0 else 'no'} rows" for n, r in rows.items())
        raise UsageError(f"every input needs the same number of rows (at least 1): {detail}.")
    return counts.pop()
