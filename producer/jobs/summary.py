"""What a batch job did, and the report ``redbatch run`` prints: ``RunSummary`` counts rows,
requests, failures by code, batch sizes, who served and the latencies (bounded: past
``MAX_LATENCIES`` requests a uniform sample), and ``format_summary`` is the report.
"""

from __future__ import annotations

import random
from array import array as float_array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from producer.jobs.files import FailedRequest

__all__ = ["MAX_LATENCIES", "RunSummary", "format_summary", "one_line", "rows_text"]

#: Latencies kept exactly; past this many requests, a uniform sample of this many.
MAX_LATENCIES = 1 << 20


@dataclass(slots=True)
class RunSummary:
    """What a job did: rows, requests, timing, batches, who served it, and the outputs.

    ``rows`` counts the input's records: rows sent or not, and records a reader skipped
    (``rows_skipped``, code UNREADABLE). ``rows_unread`` is True when the run stopped before
    the end of an input whose length is unknown (text, JSON lines): ``rows`` is what was read.
    ``requests`` and ``rows_answered`` count what a worker answered (ok or not): late requests,
    rows never sent and rows cut off by Ctrl-C are failures but not answers, so the throughput
    is what the workers did. ``latencies_ms`` holds one latency per answered request, measured
    client-side from sending the request to receiving its reply (8 bytes each; past
    ``MAX_LATENCIES`` requests a uniform sample of them, and ``latency_max_ms`` the largest).
    ``batch_rows`` counts successful requests by the rows of the batch they ran in (from the
    reply). ``failed_rows`` counts failed rows by error code. ``failures`` lists them in input
    order: each answered request that failed (and each late one) is its own entry with its rid
    and its message, as the worker's message is that request's own (a row's, in a one-row
    request); only rows never answered (never sent, cut off) are a range without a rid. With
    ``spill`` set (the errors file's ``write``), each entry goes there once the next one comes,
    so ``failures`` holds the last one only; ``first_failure`` is the first either way.
    ``key_name`` names the rows' keys (``path``, ``line``, ``--key``'s column; None for arrays,
    whose rows have none) for the summary's first error.
    """

    rows: int
    rows_per_request: int | None = None
    requests: int = 0
    rows_answered: int = 0
    rows_failed: int = 0
    rows_skipped: int = 0
    rows_unread: bool = False
    wall_s: float = 0.0
    latencies_ms: float_array[float] = field(default_factory=lambda: float_array("d"))
    latency_max_ms: float = 0.0
    batch_rows: Counter[int] = field(default_factory=Counter)
    served: Counter[tuple[str, str, str, str]] = field(default_factory=Counter)
    failed_rows: Counter[str] = field(default_factory=Counter)
    failures: list[FailedRequest] = field(default_factory=list)
    key_name: str | None = None
    first_failure: FailedRequest | None = None
    spill: Callable[[FailedRequest], object] | None = None
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    output_columns: list[tuple[str, str, list[int]]] = field(default_factory=list)
    interrupted: bool = False  # stopped by Ctrl-C: what came back is kept, the rest listed
    stopped_by: str | None = None  # the error that stopped the run early (Redis full or gone)
    _sampler: random.Random = field(default_factory=lambda: random.Random(0), repr=False)
    _latencies_seen: int = 0

    def fail(self, failure: FailedRequest) -> None:
        """Count and list a failed request, or a range of rows never answered."""
        rows = 0 if failure.stop is None else failure.stop - failure.start
        self.rows_failed += rows
        self.failed_rows[failure.code] += rows
        self._list(failure)

    def skip(self, failure: FailedRequest) -> None:
        """Count and list an input record that was never a row (code UNREADABLE)."""
        self.rows_skipped += 1
        self.rows_failed += 1
        self.failed_rows[failure.code] += 1
        self._list(failure)

    def _list(self, failure: FailedRequest) -> None:
        self.failures.append(failure)
        self.first_failure = self.first_failure or failure
        if self.spill is not None:
            while len(self.failures) > 1:
                self.spill(self.failures.pop(0))

    def flush_failures(self) -> None:
        """Hand the entries still held to ``spill`` (at the end of the job)."""
        if self.spill is not None:
            for failure in self.failures:
                self.spill(failure)
            self.failures.clear()

    def add_latency(self, latency_ms: float) -> None:
        """Keep one request's latency (a uniform sample once there are very many)."""
        self._latencies_seen += 1
        self.latency_max_ms = max(self.latency_max_ms, latency_ms)
        if len(self.latencies_ms) < MAX_LATENCIES:
            self.latencies_ms.append(latency_ms)
            return
        slot = self._sampler.randrange(self._latencies_seen)
        if slot < MAX_LATENCIES:
            self.latencies_ms[slot] = latency_ms

    @property
    def rows_ok(self) -> int:
        return self.rows - self.rows_failed

    @property
    def rows_per_s(self) -> float:
        """Rows answered per second of the job (not counting rows that were never answered)."""
        return self.rows_answered / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ok(self) -> bool:
        return self.rows_failed == 0 and not self.rows_unread

    def latency_percentiles_ms(self) -> dict[str, float]:
        """p50, p90, p99 and max of the per-request latencies (empty when there are none)."""
        if not self.latencies_ms:
            return {}
        values = [float(v) for v in np.percentile(self.latencies_ms, [50, 90, 99, 100])]
        values[-1] = max(values[-1], self.latency_max_ms)
        return dict(zip(("p50", "p90", "p99", "max"), values, strict=True))


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
    unanswered = s.rows - s.rows_answered - s.rows_skipped
    total = f"{s.rows} read (the rest of the input was not)" if s.rows_unread else f"{s.rows} total"
    lines = [
        f"rows        {s.rows_ok} ok, {s.rows_failed} failed, {total}, "
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
            f"(sha256 {sha[:12]}), {count} request{'s' if count != 1 else ''}"
        )
    first = s.first_failure
    if first is not None:
        codes = ", ".join(
            f"{code} {n} row{'s' if n != 1 else ''}" for code, n in s.failed_rows.most_common()
        )
        if errors_path:
            where = f"; listed in {errors_path} (row numbers count from 0 there and here)"
        else:
            where = " (row numbers count from 0)"
        lines.append(f"failed      {codes}{where}")
        lines.append(f"  first error: {_where(first, s.key_name)}: {first.code}: {first.message}")
    if output_path is not None:
        columns = s.output_columns or [
            (n, str(a.dtype), list(a.shape)) for n, a in s.outputs.items()
        ]
        shapes = ", ".join(f"{n} {dtype} {shape}" for n, dtype, shape in columns)
        lines.append(f"output      {output_path}: {shapes or 'no outputs (no request succeeded)'}")
    return "\n".join(lines)


def rows_text(start: int, stop: int | None) -> str:
    """Rows ``start:stop`` in words, counted from 0 as the errors file's ``start`` is (``stop``
    None: to the end of the input)."""
    if stop is None:
        return f"rows {start} to the end"
    return f"row {start}" if stop == start + 1 else f"rows {start} to {stop - 1}"


def _where(failure: FailedRequest, key_name: str | None) -> str:
    """Which rows a failure is: their numbers, and their keys when the rows have keys."""
    first, last = failure.keys if failure.keys is not None else (None, None)
    label = "table row" if key_name == "row" else key_name or "key"
    if failure.stop == failure.start:  # a record skipped: never a row
        named = f"{label} {first}, " if first is not None else "a record "
        return f"{named}skipped before row {failure.start}"
    where = rows_text(failure.start, failure.stop)
    if first is None:
        return where
    if last is None or last == first:
        return f"{where} ({label} {first})"
    return f"{where} ({label} {first} to {last})"


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
