"""The lanes-tenants preset (issue 28): two weighted tenants of one class, and the minimum share.

Weights: for each ``--tenant-weights`` pair (default 1:1, then 3:1), two tenants' backlogs of
``--tenant-rows`` rows each (``--tenant-request-rows`` rows a request) go in their own lanes of
class normal, with the weights in ``P:{M}:weights``, and then a fresh worker (heavy,
max_batch_size 32) drains them. Every reply is read back: its entry id's time plus its
``timings_ms.queued`` is its batch's start, so replies group exactly into batches, and each
batch's rows split by tenant. Over every run of 100 consecutive batches while both tenants had
work (from the first batch after both appeared to the last before either ran out), the rows
ratio is set against the weights' ratio.

Minimum share: a high backlog that saturates the worker and a low one, both queued before the
worker starts; over ``--min-share-s`` the low class's share of the rows (requests per class from
/metrics, times their rows) is set against ``[scheduling] min_share_low`` (0.05 by default).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import msgpack
import redis

from producer.client.submission import build_submission
from producer.protocol import keys
from producer.protocol.lanes import lane_stream, weights_key
from tools.bench.lanes import class_requests, clear_lanes, enqueue_raw, lanes_setup, wait_empty
from tools.bench.metrics import scrape
from tools.bench.phases import Phases
from tools.bench.processes import PREFIX, WorkerProcess, request_inputs
from tools.bench.report import say
from tools.bench.wire import input_rows

__all__ = ["MIN_SHARE_LOW", "lanes_tenants", "windows_of"]

TENANTS = ("ta", "tb")
WINDOW_BATCHES = 100
MIN_SHARE_LOW = 0.05  # the worker's default [scheduling] min_share_low, which the bench keeps


def lanes_tenants(b: Phases) -> None:
    """The lanes-tenants preset (see the module)."""
    setup = lanes_setup(b)
    b.workers.stop()
    conn = redis.Redis.from_url(b.url, socket_timeout=120)
    try:
        clear_lanes(conn, setup.served)
        record = b.workers.get(setup).record  # for its inputs; a fresh one serves each part
        for key in ("onnxruntime", "providers"):
            b.report["machine"].setdefault(key, record["runtime"][key])
        b.workers.stop()
        inputs = request_inputs(record)
        weighted = [_weighted(b, conn, inputs, pair) for pair in b.o.tenant_weights]
        share = _min_share(b, conn, inputs)
    finally:
        b.workers.stop()
        conn.close()
    lanes = b.report.get("lanes") or {}
    b.report["lanes"] = {**lanes, "tenants": weighted, "min_share": share}


def _body(inputs: list[dict[str, Any]], rows: int, seed: int) -> bytes:
    return build_submission(input_rows(inputs, rows, seed), now_s=0.0, reply_ttl_s=900).body


def _weighted(
    b: Phases, conn: redis.Redis, inputs: list[dict[str, Any]], weights: tuple[int, int]
) -> dict[str, Any]:
    setup = lanes_setup(b)
    o = b.o
    per = o.tenant_request_rows
    count = -(-o.tenant_rows // per)
    label = ":".join(map(str, weights))
    say(f"lanes-tenants {label}: {count:,} requests of {per} rows for each of {TENANTS}")
    conn.hset(weights_key(PREFIX, setup.served), mapping=dict(zip(TENANTS, weights, strict=True)))
    b.wait_for_quiet()
    body = _body(inputs, per, seed=11)
    sent = {t: enqueue_raw(conn, setup.served, "normal", t, body, count, "w") for t in TENANTS}
    worker = WorkerProcess(
        setup, b.model_file(setup.model), b.url, b.workdir, b.o.providers
    ).start()
    try:
        streams = [lane_stream(PREFIX, setup.served, "normal", t) for t in TENANTS]
        seconds = wait_empty(conn, streams, limit_s=120 + 2 * count * per / 1000)
    finally:
        worker.stop()
    batches = _batches(conn, setup.served, sent, per)
    clear_lanes(conn, setup.served)
    result = windows_of(batches, weights)
    result.update({"weights": list(weights), "rows_each": count * per, "drain_s": seconds})
    say(
        f"lanes-tenants {label}: {result['windows']} windows of {WINDOW_BATCHES} batches, ratio "
        f"{result['ratio_min']:.2f} to {result['ratio_max']:.2f} (want {result['want']:.2f}), "
        f"worst {100 * result['worst_error']:.1f}% off"
    )
    return result


def _batches(
    conn: redis.Redis,
    served: str,
    sent: dict[str, tuple[list[str], list[int]]],
    rows: int,
) -> list[dict[str, int]]:
    """Every reply read back and grouped by its batch (worker and start); each batch's rows by
    tenant, in order of start."""
    by_batch: dict[tuple[str, float], dict[str, int]] = defaultdict(lambda: dict.fromkeys(sent, 0))
    missing = 0
    for tenant, (rids, ids_ms) in sent.items():
        for first in range(0, len(rids), 2000):
            part = rids[first : first + 2000]
            pipe = conn.pipeline(transaction=False)
            for rid in part:
                pipe.lpop(keys.reply_key(PREFIX, served, rid))
            for raw, id_ms in zip(pipe.execute(), ids_ms[first : first + 2000], strict=True):
                if raw is None:
                    missing += 1
                    continue
                doc = msgpack.unpackb(raw, raw=False)
                start = round(id_ms + float(doc["timings_ms"]["queued"]), 1)
                by_batch[str(doc["worker"]), start][tenant] += rows
    if missing:
        say(f"lanes-tenants: {missing} replies missing")
    return [by_batch[k] for k in sorted(by_batch, key=lambda k: k[1])]


def windows_of(batches: Sequence[dict[str, int]], weights: tuple[int, int]) -> dict[str, Any]:
    """Rows per tenant over every run of ``WINDOW_BATCHES`` consecutive batches while both
    tenants had work: the ratio of the first tenant's rows to the second's, against the weights'
    ratio; tumbling windows listed, sliding ones judged."""
    a, b = TENANTS
    seen_a = [i for i, got in enumerate(batches) if got[a]]
    seen_b = [i for i, got in enumerate(batches) if got[b]]
    want = weights[0] / weights[1]
    if not seen_a or not seen_b:
        return {"want": want, "windows": 0, "ratio_min": 0.0, "ratio_max": 0.0, "worst_error": 1.0}
    start, end = max(seen_a[0], seen_b[0]), min(seen_a[-1], seen_b[-1])  # both had work
    both = batches[start : end + 1]
    ratios = []
    for i in range(len(both) - WINDOW_BATCHES + 1):
        part = both[i : i + WINDOW_BATCHES]
        rows_a, rows_b = sum(g[a] for g in part), sum(g[b] for g in part)
        ratios.append(rows_a / rows_b if rows_b else float("inf"))
    tumbling = ratios[::WINDOW_BATCHES]
    worst = max((abs(r / want - 1.0) for r in ratios), default=1.0)
    rows = sum(sum(g.values()) for g in both)
    # batches of one tenant alone while both had work: the other's lane held nothing then
    alone = {t: sum(1 for g in both if g[t] and not g[a if t == b else b]) for t in TENANTS}
    return {
        "want": want,
        "batches": len(batches),
        "batches_contended": len(both),
        "mean_batch_rows": rows / len(both) if both else 0.0,
        "windows": len(ratios),
        "ratio_min": min(ratios, default=0.0),
        "ratio_max": max(ratios, default=0.0),
        "ratio_all": sum(g[a] for g in both) / max(sum(g[b] for g in both), 1),
        "tumbling": tumbling,
        "worst_error": worst,
        "one_tenant_batches": alone,
        "met": bool(ratios) and worst <= 0.10,
    }


def _min_share(b: Phases, conn: redis.Redis, inputs: list[dict[str, Any]]) -> dict[str, Any]:
    setup = lanes_setup(b)
    o = b.o
    per = o.tenant_request_rows
    high_n, low_n = -(-o.min_share_high_rows // per), -(-o.min_share_low_rows // per)
    say(f"lanes-tenants min share: {high_n:,} high and {low_n:,} low requests of {per} rows")
    b.wait_for_quiet()
    body = _body(inputs, per, seed=12)
    rids = enqueue_raw(conn, setup.served, "high", None, body, high_n, "h")[0]
    rids += enqueue_raw(conn, setup.served, "low", None, body, low_n, "l")[0]
    worker = WorkerProcess(
        setup, b.model_file(setup.model), b.url, b.workdir, b.o.providers
    ).start()
    try:
        time.sleep(2.0)  # settle: both lanes read and the share window full
        before = class_requests(scrape([worker.metrics_url]))
        time.sleep(o.min_share_s)
        after = class_requests(scrape([worker.metrics_url]))
        left = conn.xlen(lane_stream(PREFIX, setup.served, "high"))
    finally:
        worker.stop()
    clear_lanes(conn, setup.served, rids)
    rows = {c: (after[c] - before[c]) * per for c in after}
    total = sum(rows.values())
    share = rows["low"] / total if total else 0.0
    result = {
        "seconds": o.min_share_s,
        "rows": rows,
        "rows_per_s": total / o.min_share_s,
        "low_share": share,
        "min_share_low": MIN_SHARE_LOW,
        "error": share / MIN_SHARE_LOW - 1.0,
        "high_left": left * per,
        "met": left > 0 and abs(share / MIN_SHARE_LOW - 1.0) <= 0.20,
    }
    say(
        f"lanes-tenants min share: low got {100 * share:.2f}% of {total:,.0f} rows "
        f"(configured {100 * MIN_SHARE_LOW:g}%), high backlog left {left * per:,} rows"
    )
    return result
