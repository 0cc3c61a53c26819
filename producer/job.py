"""One batch job: an input file's rows sent through a model, the replies stacked, the job measured.

This is the library half of ``redbatch run``, kept apart from the command (``producer.runcmd``)
so that a job can be run and reported from Python (the tests do) without argv: ``run_job``
feeds the rows through ``Client.map`` and stacks the replies in input order, and
``format_summary`` is the report. The files (``load_inputs`` reads the .npy/.npz, memory-mapped
where it can be; ``write_outputs``/``write_errors`` write the results atomically) are
``producer.jobfiles``', re-exported here.
"""

from __future__ import annotations

import time
from array import array as float_array
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from producer.argtypes import UsageError
from producer.codec import ErrorInfo
from producer.core import Chunk
from producer.errors import RedbatchError, RedisFull
from producer.jobfiles import FailedRequest, load_inputs, write_errors, write_outputs
from producer.window import WAIT_TIMEOUT

#: The client-side code of rows a run never sent because Redis was full (``RedisFull``).
REDIS_FULL = "REDIS_FULL"

__all__ = [
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


@dataclass(slots=True)
class RunSummary:
    """What a job did: rows, requests, timing, batches, who served it, and the stacked outputs.

    ``requests`` and ``rows_answered`` count what a worker answered (ok or not): late requests,
    rows never sent and rows cut off by Ctrl-C are failures but not answers, so the throughput
    is what the workers did. ``latencies_ms`` holds one latency per answered request, measured
    client-side from sending the request to receiving its reply (8 bytes each: a job of millions
    of requests keeps them all). ``batch_rows`` counts successful requests by the rows of the
    batch they ran in (from the reply). ``failed_rows`` counts failed rows by error code.
    ``failures`` lists failed row ranges; adjacent answered requests that failed with the same
    code and message are one entry (without a rid), so a bad column costs one entry, not one a
    request (late ones keep one entry each, with the rid a late reply may still come under).
    """

    rows: int
    rows_per_request: int | None = None
    requests: int = 0
    rows_answered: int = 0
    rows_failed: int = 0
    wall_s: float = 0.0
    latencies_ms: float_array[float] = field(default_factory=lambda: float_array("d"))
    batch_rows: Counter[int] = field(default_factory=Counter)
    served: Counter[tuple[str, str, str, str]] = field(default_factory=Counter)
    failed_rows: Counter[str] = field(default_factory=Counter)
    failures: list[FailedRequest] = field(default_factory=list)
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    interrupted: bool = False  # stopped by Ctrl-C: what came back is kept, the rest listed
    stopped_by: str | None = None  # the error that stopped the run early (Redis full or gone)

    def fail(self, failure: FailedRequest) -> None:
        """Count a failed request and list it, merged into the last entry when it continues
        that entry's rows with the same code and message."""
        self.rows_failed += failure.stop - failure.start
        self.failed_rows[failure.code] += failure.stop - failure.start
        last = self.failures[-1] if self.failures else None
        if (
            last is not None
            and failure.code != WAIT_TIMEOUT  # a late request's rid may still get a reply
            and last.stop == failure.start
            and (last.code, last.message) == (failure.code, failure.message)
        ):
            self.failures[-1] = FailedRequest(
                last.start, failure.stop, None, last.code, last.message
            )
        else:
            self.failures.append(failure)

    @property
    def rows_ok(self) -> int:
        return self.rows - self.rows_failed

    @property
    def rows_per_s(self) -> float:
        """Rows answered per second of the job (not counting rows that were never answered)."""
        return self.rows_answered / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ok(self) -> bool:
        return self.rows_failed == 0

    def latency_percentiles_ms(self) -> dict[str, float]:
        """p50, p90, p99 and max of the per-request latencies (empty when there are none)."""
        if not self.latencies_ms:
            return {}
        values = np.percentile(self.latencies_ms, [50, 90, 99, 100])
        return dict(zip(("p50", "p90", "p99", "max"), (float(v) for v in values), strict=True))


class Mapper(Protocol):
    """What run_job needs of a client: ``Client.map``."""

    def map(
        self,
        arrays: Mapping[str, np.ndarray],
        *,
        rows_per_request: int | None,
        concurrency: int,
        outputs: Sequence[str] | None,
        timeout_s: float,
        stop_on_timeout: bool,
    ) -> Iterable[Chunk]: ...


def run_job(
    client: Mapper,
    arrays: Mapping[str, np.ndarray],
    *,
    rows_per_request: int | None = 1,
    concurrency: int = 256,
    outputs: Sequence[str] | None = None,
    timeout_s: float = 60.0,
    on_rows: Callable[[int], object] | None = None,
) -> RunSummary:
    """Send every row of ``arrays`` through ``client.map`` and stack the replies in input order.

    Rows of failed requests are NaN in float outputs and zero otherwise, and are listed in
    ``failures``. When a reply does not come within ``timeout_s``, the job sends nothing more:
    the requests already in flight are still awaited (each within its own timeout), and the rows
    never sent are one failure with code ``WAIT_TIMEOUT`` (a client-side code). A job whose
    workers are gone thus ends after one timeout, not one per window of requests. Ctrl-C
    (KeyboardInterrupt) stops it too, with the rows not yet answered listed as ``NOT_ANSWERED``
    and ``interrupted`` set, so that the caller can still write what came back. ``on_rows(n)``
    is called as rows come back (a progress bar's ``update``).
    """
    n_rows = leading_rows(arrays)
    summary = RunSummary(rows=n_rows, rows_per_request=rows_per_request)
    stacker = _Stacker(n_rows)
    done = 0
    started = time.monotonic()
    chunks = client.map(
        arrays,
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
            error = chunk.error
            if chunk.ok:
                error = stacker.put(chunk.start, chunk.stop, chunk.outputs or {})
            elif error is None:
                error = ErrorInfo("INTERNAL", "the reply carried no error detail.")
            if error is not None:
                summary.fail(
                    FailedRequest(chunk.start, chunk.stop, chunk.rid, error.code, error.message)
                )
            done = chunk.stop
            if on_rows is not None:
                on_rows(chunk.stop - chunk.start)
        if done < n_rows:  # map() stopped sending at a late reply
            summary.fail(_not_sent(done, n_rows, late, timeout_s))
    except RedisFull as exc:  # map() stopped sending, and awaited what it had sent
        summary.fail(FailedRequest(done, n_rows, None, REDIS_FULL, one_line(exc)))
        summary.stopped_by = one_line(exc)
    except RedbatchError as exc:  # Redis went away mid-run: keep what came back, mark the rest
        summary.fail(FailedRequest(done, n_rows, None, "NOT_ANSWERED", one_line(exc)))
        summary.stopped_by = one_line(exc)
    except KeyboardInterrupt:
        summary.interrupted = True
        message = "the run was interrupted (Ctrl-C) before these rows were answered."
        summary.fail(FailedRequest(done, n_rows, None, "NOT_ANSWERED", message))
    finally:
        _close(chunks, summary)
    summary.wall_s = time.monotonic() - started
    summary.outputs = stacker.arrays
    return summary


def _not_sent(start: int, stop: int, late: Chunk | None, timeout_s: float) -> FailedRequest:
    if late is None:  # a Mapper that ended early on its own
        message = "not answered: the client ended before these rows were sent."
        return FailedRequest(start, stop, None, "NOT_ANSWERED", message)
    message = (
        f"not sent: the run stopped sending at rows {late.start}:{late.stop}, whose reply did "
        f"not come within {timeout_s:g} s (is a worker serving this model?)."
    )
    return FailedRequest(start, stop, None, WAIT_TIMEOUT, message)


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
    summary.latencies_ms.append(chunk.latency_ms)
    result = chunk.result
    if result.ok and result.batch_rows is not None:
        summary.batch_rows[int(result.batch_rows)] += 1
    model = result.model
    summary.served[(result.worker, model.name, model.version, model.sha256)] += 1


class _Stacker:
    """Output arrays allocated on the first successful reply, filled in place by row range."""

    def __init__(self, n_rows: int) -> None:
        self.n_rows = n_rows
        self.arrays: dict[str, np.ndarray] = {}

    def put(self, start: int, stop: int, outputs: Mapping[str, np.ndarray]) -> ErrorInfo | None:
        """Place one answer's rows; an answer that does not fit is returned as an error.

        The first answer fixes the output names and shapes: a later one with other names (a
        worker of another model version, say) or shapes is a failure of those rows, never a
        silent gap in the output.
        """
        if self.arrays and set(outputs) != set(self.arrays):
            return ErrorInfo(
                "OUTPUT_MISMATCH",
                f"rows {start}:{stop} came back with outputs {sorted(outputs)}, but earlier rows "
                f"had {sorted(self.arrays)}; were workers of different model versions serving?",
            )
        for name, part in outputs.items():
            target = self.arrays.get(name)
            shape = (self.n_rows, *part.shape[1:])
            if target is not None and (target.shape != shape or len(part) != stop - start):
                return ErrorInfo(
                    "OUTPUT_MISMATCH",
                    f"output {name!r} for rows {start}:{stop} has shape {part.shape}, which "
                    f"does not stack with {target.shape}.",
                )
        for name, part in outputs.items():
            if name not in self.arrays:
                fill = np.nan if np.issubdtype(part.dtype, np.inexact) else 0
                self.arrays[name] = np.full((self.n_rows, *part.shape[1:]), fill, dtype=part.dtype)
            self.arrays[name][start:stop] = part
        return None


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


# ---------------------------------------------------------------------------------------------
# The summary


def format_summary(
    summary: RunSummary, *, output_path: str | None = None, errors_path: str | None = None
) -> str:
    """The report ``redbatch run`` prints (and the demo prints) after a job."""
    s = summary
    size = ""
    if s.rows_per_request == 1:
        size = " of 1 row"
    elif s.rows_per_request is not None:
        size = f" of up to {s.rows_per_request} rows"
    unanswered = s.rows - s.rows_answered
    lines = [
        f"rows        {s.rows_ok} ok, {s.rows_failed} failed, {s.rows} total, "
        f"in {s.requests} request{'s' if s.requests != 1 else ''}{size}"
        + (f"; {unanswered} not answered" if unanswered else "")
        + (" (interrupted)" if s.interrupted else ""),
        f"wall        {s.wall_s:.2f} s, throughput {s.rows_per_s:,.0f} rows/s "
        f"({s.requests / s.wall_s if s.wall_s else 0:,.0f} requests/s)",
    ]
    pct = s.latency_percentiles_ms()
    if pct:
        lines.append(
            "latency     "
            + "  ".join(f"{k} {v:.1f} ms" for k, v in pct.items())
            + "  (per request, client-side: sent to reply received)"
        )
    else:
        lines.append("latency     none measured (no request was answered)")
    if s.batch_rows:
        mean = sum(rows * n for rows, n in s.batch_rows.items()) / s.batch_rows.total()
        lines.append(
            f"batch rows  mean {mean:.1f} "
            "(rows in the batch each successful request ran in, from its reply)"
        )
        lines.append(f"  {'batch rows':>10}  {'requests':>8}")
        lines += [
            f"  {label:>10}  {count:>8}  {bar}".rstrip()
            for label, count, bar in _histogram(s.batch_rows)
        ]
    for (worker, model, version, sha), count in sorted(s.served.items()):
        lines.append(
            f"served by   {worker}: model {model} version {version} "
            f"(sha256 {sha[:12]}), {count} requests"
        )
    if s.failed_rows:
        codes = ", ".join(
            f"{code} {n} row{'s' if n != 1 else ''}" for code, n in s.failed_rows.most_common()
        )
        where = f"; listed in {errors_path}" if errors_path else ""
        lines.append(f"failed      {codes}{where}")
        first = s.failures[0]
        lines.append(f"  first: rows {first.start}:{first.stop} {first.code}: {first.message}")
    if output_path is not None:
        shapes = ", ".join(f"{n} {a.dtype} {list(a.shape)}" for n, a in s.outputs.items())
        lines.append(f"output      {output_path}: {shapes or 'no outputs (no request succeeded)'}")
    return "\n".join(lines)


def _histogram(distinct: Counter[int], width: int = 40) -> list[tuple[str, int, str]]:
    """Counts per value when there are few distinct values, else per power-of-two bucket
    (1, 2-3, 4-7, ...), each with a bar of '#' scaled to the largest count."""
    if len(distinct) <= 12:
        buckets = [(str(v), distinct[v]) for v in sorted(distinct)]
    else:
        by_exp: Counter[int] = Counter()
        for value, count in distinct.items():
            by_exp[max(value, 1).bit_length() - 1] += count
        buckets = []
        for exp in range(min(by_exp), max(by_exp) + 1):
            low, high = 1 << exp, (1 << (exp + 1)) - 1
            buckets.append((f"{low}-{high}", by_exp.get(exp, 0)))
    top = max(n for _, n in buckets)
    return [(label, n, "#" * max(1 if n else 0, round(width * n / top))) for label, n in buckets]


def one_line(exc: BaseException) -> str:
    """The exception's message with its whitespace collapsed, or its type's name when empty."""
    return " ".join(str(exc).split()) or type(exc).__name__
