"""Where the time and the cores went: the worker's /metrics diffed, and CPU and memory from /proc.

The worker's ``/metrics`` histograms are scraped at the measured window's start and end and
diffed (``worker_view``), which says where a request's time went on the worker's side, and for
a pipeline how busy its hook threads and its model were (``pipeline_view``). These
machines are shared and a busy neighbour moves every figure, so each measurement also records
who used the cores (``cpu_sample``, ``cpu_cores``): the whole machine, Redis (its INFO), the
worker and the producers; and where Redis's one thread went, by command (``redis_commands``,
``redis_per_request``). ``memory_kib`` reads a process's resident memory for the drain.
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import redis

from producer.ops import stages
from tools.bench.errors import BenchError

__all__ = [
    "cpu_cores",
    "cpu_sample",
    "machine_busy_s",
    "memory_kib",
    "outside_ms",
    "pipeline_view",
    "redis_commands",
    "redis_per_request",
    "scrape",
    "worker_view",
]

_STAGE_ORDER = ("queue_wait", "read", "decode_validate", "batch_assembly", "inference")
_STAGE_LAST = ("reply_encode", "reply_write")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------
# The worker's own timings (its /metrics histograms)


def scrape(urls: Sequence[str], by_model: bool = False) -> dict[str, float]:
    """Every sample of the workers' /metrics, by name and labels, summed over ``urls`` (and
    over the models a worker serves, unless ``by_model``: keys then hold ``model=NAME``)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except (OSError, urllib.error.URLError) as exc:
            raise BenchError(f"cannot read worker metrics at {url}: {exc}") from exc
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(s.labels.items()) if by_model or k != "model"
                )
                name = f"{s.name}{{{labels}}}" if labels else s.name
                samples[name] = samples.get(name, 0.0) + s.value
    return samples


def worker_view(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the worker saw between two scrapes: requests, runs, batch rows, and per stage the
    observations and the mean time per observation and per request."""
    diff = _fold_labels({k: v - before.get(k, 0.0) for k, v in after.items()})
    requests = sum(v for k, v in diff.items() if k.startswith("redbatch_requests_total{"))
    runs = diff.get("redbatch_batch_rows_count", 0.0)
    buckets: dict[str, float] = {}
    below = 0.0
    bounds = sorted(
        (float(k.split("le=")[1].rstrip("}")), v)
        for k, v in diff.items()
        if k.startswith("redbatch_batch_rows_bucket{")
    )
    for bound, cumulative in bounds:
        if cumulative - below:
            buckets["+Inf" if bound == float("inf") else f"<={bound:g}"] = cumulative - below
        below = cumulative
    names = [k[len("redbatch_") : -len("_seconds_count")] for k in diff if _is_stage_count(k)]
    known = (*_STAGE_ORDER, *_STAGE_LAST)
    first = [n for n in _STAGE_ORDER if n in names]
    last = [n for n in _STAGE_LAST if n in names]
    stages = {}
    for name in (*first, *sorted(n for n in names if n not in known), *last):
        count = diff[f"redbatch_{name}_seconds_count"]
        total_s = diff.get(f"redbatch_{name}_seconds_sum", 0.0)
        stages[name] = {
            "count": int(count),
            "mean_ms": 1000.0 * total_s / count if count else 0.0,
            "per_request_ms": 1000.0 * total_s / requests if requests else 0.0,
        }
    return {
        "requests": int(requests),
        "runs": int(runs),
        "mean_batch_rows": diff.get("redbatch_batch_rows_sum", 0.0) / runs if runs else 0.0,
        "batch_rows_histogram": {k: int(v) for k, v in buckets.items()},
        "stages": stages,
    }


def pipeline_view(
    before: dict[str, float],
    after: dict[str, float],
    record: dict[str, Any],
    seconds: float,
    cores: int | None = None,
) -> dict[str, Any]:
    """A pipeline worker's stages between two scrapes: its hooks' wall and CPU ms per request,
    how busy its hook threads and its model were, and the verdict (``producer.ops.stages``)."""
    r = stages.rates(stages.from_metrics(before, cores), stages.from_metrics(after, cores), seconds)
    pipeline = record["pipeline"]
    return {
        "handler": pipeline["handler"],
        "sha256": pipeline["sha256"],
        "threads": pipeline["threads"],
        "options": pipeline.get("options", {}),
        "per_request_ms": {
            "preprocess": r.pre_ms,
            "preprocess_cpu": r.pre_cpu_ms,
            "postprocess": r.post_ms,
            "postprocess_cpu": r.post_cpu_ms,
        },
        "busy": {"hooks": r.hooks, "preprocess": r.pre, "postprocess": r.post, "model": r.model},
        "cpu_cores": {"hooks": r.hooks_cpu, "worker": r.cpu},
        "requests_per_s": r.requests_per_s,
        "verdict": stages.verdict(r),
    }


def _fold_labels(diff: dict[str, float]) -> dict[str, float]:
    """A stage timed by label (the queue wait, by class) summed under its bare name too, as
    one stage; a stage the worker times without labels is left as it is."""
    folded = dict(diff)
    for key, value in diff.items():
        name, brace, _ = key.partition("{")
        stage = name.startswith("redbatch_") and name.endswith(("_seconds_count", "_seconds_sum"))
        if brace and stage and name not in diff:
            folded[name] = folded.get(name, 0.0) + value
    return folded


def _is_stage_count(key: str) -> bool:
    return key.startswith("redbatch_") and key.endswith("_seconds_count") and "{" not in key


def outside_ms(phase: dict[str, Any]) -> float | None:
    """The end-to-end mean less the worker's queue wait, inference and reply write means: the
    time its metrics do not cover (sending, the reply's trip back, anything unmeasured)."""
    stages = (phase.get("worker_side") or {}).get("stages", {})
    parts = [stages.get(n, {}).get("mean_ms") for n in ("queue_wait", "inference", "reply_write")]
    if None in parts or not phase["latency_ms"]:
        return None
    return float(phase["latency_ms"]["mean"] - sum(p for p in parts if p is not None))


# ---------------------------------------------------------------------------------------------
# Who used the cores, and how much memory a process holds


def cpu_sample(
    conn: redis.Redis, pids: dict[str, Sequence[int]], redis_s: float | None = None
) -> dict[str, float]:
    """CPU seconds used so far by the whole machine (busy time, all cores), by Redis (its INFO,
    or ``redis_s`` when the caller read it: a cluster's servers summed), and by each named group
    of local processes; ``t`` is the monotonic time."""
    sample = {"t": time.monotonic(), "machine": machine_busy_s()}
    if redis_s is None:
        info = conn.info("cpu")
        redis_s = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    sample["redis"] = redis_s
    for name, group in pids.items():
        sample[name] = sum(_process_cpu_s(pid) for pid in group)
    return sample


def cpu_cores(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Cores busy between two samples, by user; ``other`` is the machine less all of them (a
    neighbour, or a Redis that is not on this machine when negative)."""
    elapsed_s = after["t"] - before["t"]
    cores = {k: (after[k] - before[k]) / elapsed_s for k in after if k != "t"}
    cores["other"] = cores["machine"] - sum(v for k, v in cores.items() if k != "machine")
    return cores


def redis_commands(conn: redis.Redis) -> dict[str, tuple[int, int]]:
    """Calls and microseconds so far by command, from ``INFO commandstats`` (the whole server:
    on a shared Redis, other clients' commands count too). Commands a script runs count under
    their own names as well as in the script's ``evalsha``."""
    stats = conn.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
        for name, v in stats.items()
        if isinstance(v, dict)
    }


def redis_per_request(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], requests: int
) -> dict[str, dict[str, float]]:
    """Per answered request, each command's calls and microseconds of Redis's thread between
    two ``redis_commands`` samples, most time first."""
    if requests <= 0:
        return {}
    rows = {}
    for name, (calls, usec) in after.items():
        calls0, usec0 = before.get(name, (0, 0))
        if calls > calls0:
            rows[name] = {
                "calls_per_request": (calls - calls0) / requests,
                "us_per_request": (usec - usec0) / requests,
            }
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["us_per_request"]))


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, idle and iowait excluded)."""
    with open("/proc/stat", encoding="ascii") as fh:
        fields = [int(v) for v in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait; guest time is already in user
    return (sum(fields[:8]) - idle) * _TICK_S


def _process_cpu_s(pid: int) -> float:
    """User and system CPU seconds of one process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            after_name = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(after_name[11]) + int(after_name[12])) * _TICK_S


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak) of a process, in KiB, from /proc/PID/status."""
    values = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0])
    return values
