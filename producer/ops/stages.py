"""Where a worker's time goes: how busy its pipeline threads and its model were, and which
one bounds it.

A worker's record carries running totals (``stages``: requests, busy and CPU seconds per stage
since start, ``worker/ops/metrics.py``); two samples of it make the rates here. The same totals are
on ``/metrics`` (``redbatch_pipeline_busy_seconds_total`` and friends), from which the bench
builds the same samples (``from_metrics``). The design's signal to move preprocessing out of
Python is "its threads saturate the CPU while the GPU is under 30% busy": ``verdict`` says it
in one line, for ``status --watch`` and the bench report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["HOOK_STAGES", "StageRates", "from_metrics", "rates", "restarted", "verdict"]

HOOK_STAGES = ("preprocess", "postprocess")
_SATURATED = 0.8  # a stage this busy (of its capacity) is what the worker waits on
_MODEL_IDLE = 0.3  # the design's threshold: the accelerator under 30% busy
_CPU_FULL = 0.9  # the worker's process uses this share of the machine's cores: no core is free


@dataclass(frozen=True, slots=True)
class StageRates:
    """How busy each stage was over ``seconds``; ``pre`` and ``post`` are fractions of the
    pipeline's threads (together at most 1), ``model`` of one run at a time."""

    seconds: float
    threads: int
    pre: float  # preprocess: busy seconds / (seconds x threads)
    post: float
    model: float  # the model's runs: busy seconds / seconds
    pre_cpu: float  # CPU seconds per second in preprocess calls
    post_cpu: float
    cpu: float  # CPU seconds per second of the whole worker process
    requests_per_s: float  # requests preprocessed per second
    rows_per_s: float  # rows through the model per second
    pre_ms: float | None  # wall ms of preprocess per request (None: no request in between)
    post_ms: float | None
    pre_cpu_ms: float | None  # CPU ms of preprocess per request
    post_cpu_ms: float | None
    cores: int | None = None  # the worker's machine, when the sample says

    @property
    def hooks(self) -> float:
        """The pipeline threads' busy fraction, preprocess and postprocess together."""
        return self.pre + self.post

    @property
    def hooks_cpu(self) -> float:
        """CPU seconds per second in hook calls, preprocess and postprocess together."""
        return self.pre_cpu + self.post_cpu


def _number(sample: Mapping[str, Any], stage: str | None, key: str) -> float:
    part = sample.get(stage, {}) if stage else sample
    value = part.get(key, 0.0) if isinstance(part, Mapping) else 0.0
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def restarted(before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    """True when a running total went down: the worker restarted in between (under the same
    name), so ``after`` is a new start, not a later sample."""
    pairs = [(None, "cpu_s"), (None, "uptime_s")] + [
        (stage, key) for stage in (*HOOK_STAGES, "model") for key in ("requests", "busy_s", "cpu_s")
    ]
    return any(_number(after, s, k) < _number(before, s, k) for s, k in pairs)


def rates(before: Mapping[str, Any], after: Mapping[str, Any], seconds: float) -> StageRates:
    """The rates between two ``stages`` samples taken ``seconds`` apart."""

    def delta(stage: str | None, key: str) -> float:
        return _number(after, stage, key) - _number(before, stage, key)

    def per_request(stage: str, key: str) -> float | None:
        count = delta(stage, "requests")
        return 1000.0 * delta(stage, key) / count if count > 0 else None

    span = max(seconds, 1e-9)
    threads = int(_number(after, None, "threads"))
    per_thread = span * max(threads, 1)
    cores = after.get("cores")
    return StageRates(
        seconds=seconds,
        threads=threads,
        pre=delta("preprocess", "busy_s") / per_thread,
        post=delta("postprocess", "busy_s") / per_thread,
        model=delta("model", "busy_s") / span,
        pre_cpu=delta("preprocess", "cpu_s") / span,
        post_cpu=delta("postprocess", "cpu_s") / span,
        cpu=delta(None, "cpu_s") / span,
        requests_per_s=delta("preprocess", "requests") / span,
        rows_per_s=delta("model", "requests") / span,
        pre_ms=per_request("preprocess", "busy_s"),
        post_ms=per_request("postprocess", "busy_s"),
        pre_cpu_ms=per_request("preprocess", "cpu_s"),
        post_cpu_ms=per_request("postprocess", "cpu_s"),
        cores=cores if isinstance(cores, int) and cores > 0 else None,
    )


def from_metrics(samples: Mapping[str, float], cores: int | None = None) -> dict[str, Any]:
    """A ``stages`` sample, as a worker's record carries it, from one scrape of its /metrics
    (the bench's form: ``name{label=value}`` to value, summed over workers)."""

    def get(name: str) -> float:
        return float(samples.get(name, 0.0))

    sample: dict[str, Any] = {
        "threads": int(get("redbatch_pipeline_threads")),
        "cpu_s": get("process_cpu_seconds_total"),
        "model": {
            "requests": get("redbatch_batch_rows_sum"),
            "busy_s": get("redbatch_inference_seconds_sum"),
            "cpu_s": 0.0,
        },
    }
    for stage in HOOK_STAGES:
        sample[stage] = {
            "requests": get(f"redbatch_{stage}_seconds_count"),
            "busy_s": get(f"redbatch_pipeline_busy_seconds_total{{stage={stage}}}"),
            "cpu_s": get(f"redbatch_pipeline_cpu_seconds_total{{stage={stage}}}"),
        }
    if cores:
        sample["cores"] = cores
    return sample


def verdict(r: StageRates) -> str:
    """One line: is this worker bound by its preprocessing, by its model, or by neither?"""
    model = f"model {r.model:.0%} busy"
    cpu = f"process {r.cpu:.2f} CPU" + (f" of {r.cores} cores" if r.cores else "")
    cpu_full = r.cores is not None and r.cpu >= _CPU_FULL * r.cores
    if not r.threads:
        if r.model >= _SATURATED:
            return f"bound by the model: {model}, {cpu}"
        if cpu_full:
            return f"bound by the CPU: {model}, {cpu}"
        return f"not saturated: {model}, {cpu} (waiting for requests)"
    threads = f"{r.threads} thread{'' if r.threads == 1 else 's'}"
    figures = (
        f"pipeline threads {r.hooks:.0%} busy ({threads}, {r.hooks_cpu:.2f} CPU in hooks), "
        f"{model}, {cpu}"
    )
    pre_bound = r.hooks >= _SATURATED
    if pre_bound and r.model < _MODEL_IDLE:
        fix = (
            "no core is free: move preprocessing out of Python, or onto more cores"
            if cpu_full
            else "add pipeline.threads if cores are free, or move preprocessing out of Python"
        )
        return f"bound by preprocessing: {figures}; {fix}"
    if pre_bound and r.model >= _SATURATED:
        return f"bound by preprocessing and the model alike: {figures}"
    if r.model >= _SATURATED:
        return f"bound by the model: {figures}"
    if pre_bound:
        return f"bound by preprocessing: {figures}; the model has room"
    if cpu_full:
        return f"bound by the CPU, shared by the hooks and the model: {figures}"
    return f"not saturated: {figures} (waiting for requests)"
