"""Driver (a): ``admit`` in-process on fuzzed entries, fast, with optional allocation tracking."""

from __future__ import annotations

import os
import time
import tracemalloc
from collections import Counter
from typing import Any

from worker.intake.admit import admit
from worker.intake.layouts import Layouts
from worker.items import Admitted, DeadLetter, Item, Refused

from .mutator import Mutator, fuzz_entry
from .oracle import ADMIT_CODES, outcome, raw_entry
from .rss import Rss
from .target import FuzzTarget, schema_for


def fuzz_admit(
    n: int,
    seed: int,
    *,
    target: FuzzTarget | None = None,
    track_allocations: bool = False,
) -> dict[str, Any]:
    """Run ``admit`` on ``n`` fuzzed entries; any exception escaping it is recorded, not raised.

    With ``track_allocations`` each admit runs under tracemalloc (several times slower) and the
    summary holds the largest peak one input allocated, against its body size.
    """
    target = target or FuzzTarget()
    schema = schema_for(target)
    mutator = Mutator(target, seed)
    layouts = Layouts()
    outcomes: Counter[str] = Counter()
    failures: list[dict[str, Any]] = []
    worst: dict[str, Any] = {"bytes": 0, "body_bytes": 0, "index": -1, "mutation": ""}
    rss = Rss(os.getpid())
    if track_allocations:
        tracemalloc.start()
    started = time.perf_counter()
    try:
        for index in range(n):
            rid, body, mutation = fuzz_entry(mutator, index)
            if track_allocations:
                tracemalloc.reset_peak()
                base = tracemalloc.get_traced_memory()[0]
            try:
                item = admit(raw_entry(rid, body), schema, target.max_request_bytes)
                # The same body through known layouts (worker/intake/layouts.py) must fare the same.
                fast = admit(raw_entry(rid, body), schema, target.max_request_bytes, 1, layouts)
            except Exception as exc:  # the finding itself: admit must never raise
                outcomes["EXCEPTION"] += 1
                failures.append(_failure(index, mutation, "EXCEPTION", repr(exc)))
                continue
            code = outcome(item)
            if _admitted(fast) != _admitted(item):
                failures.append(_failure(index, mutation, "LAYOUT_MISMATCH", _message(fast)))
            outcomes[code] += 1
            if code not in ADMIT_CODES:
                failures.append(_failure(index, mutation, code, _message(item)))
            if track_allocations:
                grew = tracemalloc.get_traced_memory()[1] - base
                if grew > worst["bytes"]:
                    worst = {
                        "bytes": grew,
                        "body_bytes": len(body or b""),
                        "index": index,
                        "mutation": mutation,
                    }
            if index % 1000 == 0:
                rss.sample()
            if (index + 1) * 10 // n > index * 10 // n:
                rss.timeline_kb.append(rss.end_kb)
    finally:
        if track_allocations:
            tracemalloc.stop()
    rss.sample()
    elapsed = time.perf_counter() - started
    return {
        "seed": seed,
        "model": target.model,
        "inputs": n,
        "outcomes": dict(sorted(outcomes.items())),
        "failures": len(failures),
        "failure_examples": failures[:10],
        "max_alloc_per_input": worst if track_allocations else None,
        "rss_mb": rss.summary(),
        "elapsed_s": round(elapsed, 2),
        "ok": not failures,
    }


def _admitted(item: Item) -> tuple[Any, ...]:
    """Everything admit decided for an item: its answer, options, rows and input bytes."""
    request = item.request if isinstance(item, Admitted) else None
    arrays = (
        None
        if request is None
        else [(n, a.dtype.str, a.shape, a.tobytes()) for n, a in request.inputs.items()]
    )
    shape = None if request is None else (request.rows, request.signature, request.outputs)
    match item:
        case Admitted():
            options = (item.deadline_ms, item.meta_raw, item.reply_ttl_s)
        case Refused():
            options = (None, item.meta_raw, item.reply_ttl_s)
        case DeadLetter():
            options = (None, None, None)
    reason = item.reason if isinstance(item, DeadLetter) else None
    return outcome(item), _message(item), reason, options, shape, arrays


def _message(item: Item) -> str:
    return item.error.message[:300] if isinstance(item, Refused) else ""


def _failure(index: int, mutation: str, code: str, detail: str) -> dict[str, Any]:
    return {"index": index, "mutation": mutation, "code": code, "detail": detail[:300]}
