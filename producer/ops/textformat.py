"""Text pieces ``redbatch status`` and its ``--watch`` view share: terminal-safe text, tables,
durations, byte sizes, what Redis memory means for producers, a live worker's first columns,
and how a worker's record names its tensors and its pipeline.

Both reports say the same thing about memory in the same words, so an operator who knows one
reads the other: how full Redis is against ``maxmemory``, and whether producers are refused
(``RedisFull`` at ``producer.redisio.memory.DEFAULT_HIGH_WATERMARK``) while workers keep draining.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from producer.ops.status import WorkerInfo
from producer.ops.words import WIDTH, clip
from producer.protocol.units import format_bytes
from producer.redisio.memory import DEFAULT_HIGH_WATERMARK, MemoryReading, MemoryWatch

__all__ = [
    "INFO_REFUSED",
    "PIPELINE_OUTPUTS_UNDECLARED",
    "ago",
    "ago_or_dash",
    "duration",
    "memory_notes",
    "memory_split",
    "memory_summary",
    "narrow_table",
    "pipeline_summary",
    "printable",
    "producers_refused",
    "record_lines",
    "show",
    "table",
    "tensor_spec",
    "worker_cells",
]

#: What the reports say when ``INFO memory`` cannot be read (an ACL user without ``+info``).
INFO_REFUSED = "unknown (INFO refused: grant +info)"


def printable(text: str) -> str:
    """``text`` safe to print to a terminal: printable characters as they are, any other (an
    escape sequence, a line break, a bidi control) escaped as ``repr`` writes it, e.g. ``\\x1b``.

    Request ids, reasons, consumer names and workers' records are written by whoever can write to
    Redis; printed raw, they could recolour or rewrite an operator's terminal and break tables.
    JSON output needs none of this: ``json.dumps`` escapes them already."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def table(
    rows: Sequence[Sequence[str]], *, indent: str = "", right: frozenset[int] = frozenset()
) -> list[str]:
    """Rows as aligned columns; cells are escaped before they are measured."""
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        out.append((indent + "  ".join(cells)).rstrip())
    return out


def narrow_table(
    rows: Sequence[Sequence[str]],
    *,
    indent: str = "",
    right: frozenset[int] = frozenset(),
    width: int = WIDTH,
) -> list[str]:
    """``table``, its first column (names, tags) cut in the middle as far as needed for the rows
    to fit ``width``, but never below 12 characters; the numbers are never cut."""
    rows = [[printable(cell) for cell in row] for row in rows]
    rest = sum(max(len(row[i]) for row in rows) + 2 for i in range(1, len(rows[0])))
    room = max(width - len(indent) - rest, 12)
    return table([[clip(row[0], room), *row[1:]] for row in rows], indent=indent, right=right)


def show(value: Any, missing: str = "-") -> str:
    return missing if value is None else str(value)


def duration(seconds: float) -> str:
    if seconds < 1.0:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def ago(seconds: float) -> str:
    return f"{duration(seconds)} ago"


def ago_or_dash(seconds: float | None) -> str:
    return "-" if seconds is None else ago(seconds)


# ---------------------------------------------------------------------------------------------
# Redis memory


def producers_refused(reading: MemoryReading) -> bool:
    """True when a producer with the default watermark refuses new work at this reading; asks
    ``MemoryWatch`` itself, so the report cannot disagree with the client."""
    watch = MemoryWatch("status", DEFAULT_HIGH_WATERMARK)
    watch.seen(reading, 0.0)
    return watch.full() is not None


def memory_summary(reading: MemoryReading, *, change_bytes_per_s: float | None = None) -> str:
    """``used ... of maxmemory ... (81%), headroom ...; policy ...``; with the change per second
    after the used figure when known (``--watch``)."""
    used, more = memory_split(reading, change_bytes_per_s=change_bytes_per_s)
    return f"{used} ({more})" if reading.headroom_bytes is None else f"{used}, {more}"


def memory_split(
    reading: MemoryReading, *, change_bytes_per_s: float | None = None
) -> tuple[str, str]:
    """``memory_summary`` in two parts, for a report that gives each its own line: how full
    (``used ... of maxmemory ... (81%)``) and the rest (``headroom ...; policy ...``, or that
    producers are never refused when there is no ``maxmemory``)."""
    used = format_bytes(reading.used_bytes)
    if change_bytes_per_s is not None:
        sign = "+" if change_bytes_per_s >= 0 else ""
        used += f" ({sign}{format_bytes(change_bytes_per_s)}/s)"
    headroom = reading.headroom_bytes
    if headroom is None:
        return f"used {used}, no maxmemory", "producers are never refused for memory"
    # Floored, so that a report never shows the watermark's figure before producers stop.
    percent = reading.used_bytes * 100 // reading.max_bytes
    return (
        f"used {used} of maxmemory {format_bytes(reading.max_bytes)} ({percent}%)",
        f"headroom {format_bytes(headroom)}; policy {reading.policy}",
    )


def memory_notes(reading: MemoryReading) -> list[str]:
    """What the reading means: producers refused, or a policy that may lose the queue."""
    notes = []
    if producers_refused(reading):
        notes.append(
            f"producers are refused (RedisFull) above {DEFAULT_HIGH_WATERMARK:.0%} of maxmemory; "
            "workers keep draining"
        )
    if reading.max_bytes > 0 and reading.policy != "noeviction":
        notes.append(
            f"maxmemory-policy {reading.policy}: when full, Redis may evict queued requests or "
            "replies without a word; set noeviction (docs/security.md)"
        )
    return notes


# ---------------------------------------------------------------------------------------------
# A worker's record

#: What status says of a pipeline whose handler declares no outputs (``pipeline.outputs`` null),
#: by its record's ``postprocess`` (None: a worker from before that field).
PIPELINE_OUTPUTS_UNDECLARED = (
    "outputs not declared by the handler: they are what its postprocess returns "
    "(the model's outputs only when it has no postprocess)"
)
_UNDECLARED_BY_POSTPROCESS = {
    True: "outputs not declared by the handler: they are what its postprocess returns",
    False: "outputs not declared by the handler, which has no postprocess: the model's outputs "
    "below",
}


def worker_cells(worker: WorkerInfo) -> list[str]:
    """A live worker's name, state, model version, sha256 prefix and execution providers."""
    providers = worker.get("runtime", "providers") or []
    return [
        worker.name,
        show(worker.get("state")),
        show(worker.get("model", "version")),
        show(worker.get("model", "sha256"))[:12],
        ",".join(str(p).removesuffix("ExecutionProvider") for p in providers) or "-",
    ]


def tensor_spec(spec: Any, *, ranged: bool) -> str:
    """One input or output of a worker record, as status shows it and the worker logs it:
    name, dtype, shape (? for a free dimension) and, with ``ranged``, the configured range."""
    if not isinstance(spec, dict):
        return show(spec)
    shape = spec.get("shape")
    dims = "[" + ", ".join("?" if d == -1 else str(d) for d in shape) + "]" if shape else "-"
    text = f"{show(spec.get('name'))} {show(spec.get('dtype'))} {dims}"
    if ranged:
        low, high = spec.get("min"), spec.get("max")
        if low is not None or high is not None:
            text += f" range [{show(low, '-inf')}, {show(high, 'inf')}]"
        if spec.get("reject_non_finite"):
            text += " finite only"
    return text


def pipeline_summary(pipeline: Any) -> str:
    """A record's ``pipeline`` in one line: handler, its source's sha256 prefix, threads, time
    limit, batch hooks and options (``handler:Class (sha256 1a2b3c4d5e6f), 2 threads, ...``)."""
    if not isinstance(pipeline, dict):
        return show(pipeline)
    parts = [f"{show(pipeline.get('handler'))} (sha256 {show(pipeline.get('sha256'))[:12]})"]
    threads = pipeline.get("threads")
    parts.append(f"{show(threads)} thread{'' if threads == 1 else 's'}")
    if pipeline.get("timeout_s") is not None:
        parts.append(f"timeout {show(pipeline.get('timeout_s'))} s")
    hooks = pipeline.get("batch_hooks")
    if hooks:
        parts.append("batch hooks " + ", ".join(map(str, hooks)))
    options = pipeline.get("options")
    if isinstance(options, dict) and options:
        parts.append("options " + ", ".join(f"{k}={v!r}" for k, v in options.items()))
    return ", ".join(parts)


def record_lines(record: dict[str, Any]) -> list[tuple[str, str]]:
    """A worker's tensors as status lists them, as (label, text) pairs, so that a long text
    folds under its label: with a pipeline, the pipeline and what requests send and replies
    carry, then the model's own inputs and outputs. A pipeline whose handler declares no
    outputs says so: its replies carry what its postprocess returns (the model's outputs only
    when it has none), so the model's outputs below are not what a reply holds."""
    lines: list[tuple[str, str]] = []
    model = ""
    pipeline = record.get("pipeline")
    if isinstance(pipeline, dict):
        lines.append(("pipeline ", pipeline_summary(pipeline)))
        lines += [
            ("request input  ", tensor_spec(t, ranged=False)) for t in _list(pipeline, "inputs")
        ]
        if pipeline.get("outputs") is None:
            said = _UNDECLARED_BY_POSTPROCESS.get(pipeline.get("postprocess"))  # type: ignore[arg-type]
            lines.append(("replies: ", said or PIPELINE_OUTPUTS_UNDECLARED))
        lines += [
            ("reply output   ", tensor_spec(t, ranged=False)) for t in _list(pipeline, "outputs")
        ]
        model = "model "
    lines += [(f"{model}input  ", tensor_spec(t, ranged=True)) for t in _list(record, "inputs")]
    lines += [(f"{model}output ", tensor_spec(t, ranged=False)) for t in _list(record, "outputs")]
    return lines


def _list(record: dict[str, Any], key: str) -> list[Any]:
    value = record.get(key)
    return value if isinstance(value, list) else []
