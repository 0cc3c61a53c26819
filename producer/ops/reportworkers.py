"""The workers' part of the ``redbatch status --model`` report, in lines of at most 80 columns.

Laid out as ``--watch`` lays out its own (``producer.ops.watchworkers``): each live worker gets a
table row of numbers (batch limits, requests and batches served) and lines under it saying what
it is (state, model version and hash, providers; onnxruntime, host and pid, when it started and
last beat), so that neither a pod's long name nor a host name pushes the row past the terminal's
edge. Then each worker's pipeline and tensors follow under its full name, a long text folded
under its label (``producer.ops.words.under``).
"""

from __future__ import annotations

from producer.ops.status import ModelStatus, WorkerInfo, iso_age_s
from producer.ops.textformat import (
    ago_or_dash,
    narrow_table,
    printable,
    record_lines,
    show,
    worker_cells,
)
from producer.ops.words import fit, under

__all__ = ["worker_section"]


def worker_section(status: ModelStatus) -> list[str]:
    """``Workers: N live``, the registry's expired names, a row and identity per worker, then
    each worker's pipeline and tensors."""
    lines = [f"Workers: {len(status.workers)} live"]
    if status.expired_workers:
        lines += fit(
            [
                f"  removed {len(status.expired_workers)} expired from the registry: "
                + ", ".join(map(printable, status.expired_workers))
            ]
        )
    if not status.workers:
        return [*lines, "  no live worker has registered for this model"]
    rows = [["NAME", "BATCH", "SERVED", "BATCHES"]]
    about = []
    for w in status.workers:
        served, batches = w.get("served", "requests"), w.get("served", "batches")
        rows.append(
            [
                w.name,
                f"{show(w.get('batching', 'max_batch_size'))} rows/"
                f"{show(w.get('batching', 'max_wait_ms'))} ms",
                f"{served:,}" if isinstance(served, int) else show(served),
                f"{batches:,}" if isinstance(batches, int) else show(batches),
            ]
        )
        about.append(_identity(w, status.observed_at))
    table = narrow_table(rows, indent="  ", right=frozenset({2, 3}))
    lines.append(table[0])
    for row, more in zip(table[1:], about, strict=True):
        lines += [row, *more]
    for w in status.workers:
        lines += _details(w)
    return lines


def _identity(worker: WorkerInfo, now_s: float) -> list[str]:
    """``    ready, version 2 (sha256 0123456789ab), CUDA,CPU`` and
    ``    onnxruntime 1.20.1, box:4242, started 3.0 h ago, heartbeat 1.2 s ago``, folded."""
    _, state, version, sha, providers = (printable(c) for c in worker_cells(worker))
    where = printable(f"{show(worker.get('host'))}:{show(worker.get('pid'))}")
    ort = printable(show(worker.get("runtime", "onnxruntime")))
    started = ago_or_dash(iso_age_s(worker.get("started_at"), now_s))
    beat = ago_or_dash(iso_age_s(worker.get("heartbeat_at"), now_s))
    return [
        *under("    ", f"{state}, version {version} (sha256 {sha}), {providers}", hang=2),
        *under("    ", f"onnxruntime {ort}, {where}, started {started}, heartbeat {beat}", hang=2),
        *_session(worker),
    ]


def _session(worker: WorkerInfo) -> list[str]:
    """``    session held: loaded 3 times, released 2, last load 325 ms, 70.1 MiB`` for a worker
    of several models under a budget (contract section 8); nothing for an older worker."""
    if not isinstance(worker.get("session"), dict):
        return []
    held = "held" if worker.get("session", "loaded") else "released (loads on its next request)"
    loads, evictions = worker.get("session", "loads"), worker.get("session", "evictions")
    load_ms, held_bytes = worker.get("session", "load_ms"), worker.get("session", "held_bytes")
    text = f"session {held}: loaded {show(loads)} times, released {show(evictions)}"
    if isinstance(load_ms, int | float):
        text += f", last load {load_ms:,.0f} ms"
    if isinstance(held_bytes, int) and held_bytes > 0:
        text += f", {held_bytes / 2**20:,.1f} MiB"
    lines = under("    ", printable(text), hang=2)
    if worker.get("session", "error"):
        lines += under("    load failed: ", printable(str(worker.get("session", "error"))))
    return lines


def _details(worker: WorkerInfo) -> list[str]:
    """``  NAME:`` then its record's error, its pipeline and its tensors, each under its label."""
    lines = under("  ", printable(worker.name) + ":")
    if worker.get("error"):
        lines += under("    ", printable(str(worker.get("error"))), hang=2)
    if worker.get("reload", "error"):  # a SIGHUP whose new version did not load
        lines += under("    reload failed: ", printable(str(worker.get("reload", "error"))))
    for label, text in record_lines(worker.record):
        lines += under("    " + label, printable(text))
    return lines
