"""Where a worker's time goes (``producer.ops.stages``): rates and the bound-by verdict from two
samples of its running totals, as ``redbatch status --watch`` shows them per worker, and the
pipeline ``redbatch status`` lists for each worker (against a real Redis, no worker)."""

from __future__ import annotations

import argparse
import io
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis

from producer.cli import status as status_command
from producer.cli.main import main
from producer.ops import stages, watch
from producer.ops.report import format_status
from producer.ops.status import WorkerInfo, gather_status
from producer.protocol import keys
from tools.bench.metrics import scrape
from worker.ops.metrics import Metrics, MetricsServer

MODEL = "multi_io"
P = keys.DEFAULT_PREFIX
SHA = "e7107c287e838d352299bf08ce77bdb24adc66ad932ec0a632a41f1b3f44d24e"
PIPELINE = {
    "handler": "numbers_handler:Numbers",
    "source": "/srv/numbers_handler.py",
    "sha256": SHA,
    "options": {"scale": 2.0},
    "threads": 2,
    "timeout_s": 1.0,
    "batch_hooks": [],
    "inputs": [{"name": "text", "dtype": "string", "shape": [-1]}],
    "outputs": [{"name": "sum", "dtype": "float32", "shape": [-1]}],
}


def _totals(
    pre: tuple[int, float, float],
    model: tuple[int, float],
    *,
    cpu_s: float,
    post: tuple[int, float, float] = (0, 0.0, 0.0),
    threads: int = 2,
    **extra: Any,
) -> dict[str, Any]:
    """A record's ``stages``: (requests, busy_s, cpu_s) per hook stage, (rows, busy_s) of the
    model, the process's CPU seconds."""

    def stage(n: int, busy: float, cpu: float) -> dict[str, Any]:
        return {"requests": n, "busy_s": busy, "cpu_s": cpu}

    return {
        "threads": threads,
        "cpu_s": cpu_s,
        "preprocess": stage(*pre),
        "postprocess": stage(*post),
        "model": stage(model[0], model[1], 0.0),
        **extra,
    }


# ---------------------------------------------------------------------------------------------
# rates and verdict


def test_rates_are_busy_shares_and_per_request_costs_between_two_samples() -> None:
    # Given 10 s in which 2 threads preprocessed 400 requests in 19 busy s (16 CPU s) and
    # postprocessed them in 0.4 s, and the model ran 400 rows in 1.5 s, the process using 18 s
    before = _totals((100, 5.0, 4.0), (100, 0.5), cpu_s=10.0, post=(100, 0.1, 0.1))
    after = _totals((500, 24.0, 20.0), (500, 2.0), cpu_s=28.0, post=(500, 0.5, 0.4))

    r = stages.rates(before, after, 10.0)

    assert r.threads == 2
    assert r.pre == pytest.approx(19.0 / 20.0)
    assert r.post == pytest.approx(0.4 / 20.0)
    assert r.hooks == pytest.approx(0.97)
    assert r.model == pytest.approx(0.15)
    assert (r.pre_cpu, r.post_cpu, r.hooks_cpu) == pytest.approx((1.6, 0.03, 1.63))
    assert r.cpu == pytest.approx(1.8)
    assert (r.requests_per_s, r.rows_per_s) == pytest.approx((40.0, 40.0))
    assert r.pre_ms == pytest.approx(47.5)  # 19 s over 400 requests
    assert r.pre_cpu_ms == pytest.approx(40.0)
    assert r.post_ms == pytest.approx(1.0)
    assert r.post_cpu_ms == pytest.approx(0.75)
    assert r.cores is None


def test_no_request_in_between_has_no_per_request_figure() -> None:
    same = _totals((100, 5.0, 4.0), (100, 0.5), cpu_s=10.0)
    r = stages.rates(same, same, 5.0)
    assert r.pre_ms is None
    assert r.post_cpu_ms is None
    assert r.hooks == 0.0
    assert stages.verdict(r).startswith("not saturated: pipeline threads 0% busy")


def test_saturated_threads_and_an_idle_model_are_bound_by_preprocessing() -> None:
    before = _totals((0, 0.0, 0.0), (0, 0.0), cpu_s=0.0)
    after = _totals((400, 19.0, 16.0), (400, 1.5), cpu_s=18.0)

    line = stages.verdict(stages.rates(before, after, 10.0))

    assert line == (
        "bound by preprocessing: pipeline threads 95% busy (2 threads, 1.60 CPU in hooks), "
        "model 15% busy, process 1.80 CPU; add pipeline.threads if cores are free, or move "
        "preprocessing out of Python"
    )
    # The same on a machine whose cores the worker fills: more threads would not help
    full = stages.rates(before, {**after, "cores": 2}, 10.0)
    assert stages.verdict(full).endswith(
        "process 1.80 CPU of 2 cores; no core is free: move preprocessing out of Python, "
        "or onto more cores"
    )


@pytest.mark.parametrize(
    ("pre_busy", "model_busy", "cpu_s", "starts"),
    [
        (2.0, 9.0, 12.0, "bound by the model: pipeline threads 10% busy"),
        (18.0, 9.0, 20.0, "bound by preprocessing and the model alike: "),
        (18.0, 5.0, 19.0, "bound by preprocessing: "),  # the model has room, above 30% busy
        (6.0, 3.0, 19.0, "bound by the CPU, shared by the hooks and the model: "),
        (6.0, 3.0, 8.0, "not saturated: pipeline threads 30% busy"),
    ],
)
def test_verdict_names_what_bounds_the_worker(
    pre_busy: float, model_busy: float, cpu_s: float, starts: str
) -> None:
    before = _totals((0, 0.0, 0.0), (0, 0.0), cpu_s=0.0)
    after = _totals((100, pre_busy, pre_busy), (100, model_busy), cpu_s=cpu_s, cores=2)
    assert stages.verdict(stages.rates(before, after, 10.0)).startswith(starts)


def test_a_worker_without_pipeline_is_judged_by_its_model() -> None:
    before = _totals((0, 0.0, 0.0), (0, 0.0), cpu_s=0.0, threads=0)
    busy = _totals((0, 0.0, 0.0), (3200, 9.0), cpu_s=11.0, threads=0)
    idle = _totals((0, 0.0, 0.0), (320, 1.0), cpu_s=1.0, threads=0)
    assert stages.verdict(stages.rates(before, busy, 10.0)) == (
        "bound by the model: model 90% busy, process 1.10 CPU"
    )
    assert stages.verdict(stages.rates(before, idle, 10.0)).startswith("not saturated: model 10%")


def test_a_total_that_goes_down_is_a_restart() -> None:
    before = _totals((100, 5.0, 4.0), (100, 0.5), cpu_s=10.0)
    assert not stages.restarted(before, _totals((150, 6.0, 5.0), (150, 0.7), cpu_s=12.0))
    assert stages.restarted(before, _totals((3, 0.1, 0.1), (3, 0.01), cpu_s=2.0))
    assert stages.restarted({**before, "uptime_s": 50.0}, {**before, "uptime_s": 1.0})


def test_the_bench_reads_the_same_totals_from_metrics_as_the_record_carries() -> None:
    # Given a worker's metrics after hook calls and model runs
    metrics = Metrics()
    metrics.describe(_record(threads=2))
    metrics.hook_ran("preprocess", 3, 0.030, 0.024)
    metrics.hook_ran("preprocess", 1, 0.010, 0.009)
    metrics.hook_ran("postprocess", 4, 0.002, 0.002)
    metrics.batch_done(["OK"] * 4, [0.001] * 4, [0.0001] * 4, [(4, 0.005)], 0.001)
    server = MetricsServer(metrics, lambda: True, 0, host="127.0.0.1")
    server.start()
    try:
        scraped = stages.from_metrics(scrape([f"http://127.0.0.1:{server.port}/metrics"]), 2)
    finally:
        server.close()

    # Then /metrics gives what the record's ``stages`` gives, stage by stage
    recorded = metrics.stages.snapshot()
    for stage in ("preprocess", "postprocess", "model"):
        assert scraped[stage] == pytest.approx(recorded[stage]), stage
    assert scraped["threads"] == recorded["threads"] == 2
    assert scraped["cpu_s"] > 0
    assert scraped["cores"] == 2


# ---------------------------------------------------------------------------------------------
# status and --watch


def _record(
    *, threads: int = 2, stages_: dict[str, Any] | None = None, beat: datetime | None = None
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "name": "cpu-0",
        "state": "ready",
        "model": {"name": MODEL, "version": "7", "sha256": "ab" * 32},
        "runtime": {"providers": ["CPUExecutionProvider"], "onnxruntime": "1.20.0"},
        "batching": {"max_batch_size": 32, "max_wait_ms": 5},
        "warmup": {"total_ms": 12.0},
        "inputs": [
            {"name": "a", "dtype": "float32", "shape": [-1, 3]},
            {"name": "b", "dtype": "int64", "shape": [-1, 2]},
        ],
        "outputs": [{"name": "twice", "dtype": "float32", "shape": [-1, 3]}],
        "heartbeat_at": (beat or datetime.now(UTC)).isoformat().replace("+00:00", "Z"),
        "served": {"requests": 0, "batches": 0},
        "pipeline": {**PIPELINE, "threads": threads},
    }
    if stages_ is not None:
        record["stages"] = stages_
    return record


def _register(conn: redis.Redis, record: dict[str, Any]) -> None:
    conn.set(keys.worker_key(P, MODEL, record["name"]), json.dumps(record), ex=15)
    conn.sadd(keys.workers_key(P, MODEL), record["name"])


def test_status_shows_each_workers_pipeline(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    _register(rconn, _record())

    text = format_status(gather_status(rconn, MODEL))
    assert main(["--redis-url", redis_url, "status", "--model", MODEL, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)

    # Then the pipeline's handler, sha256 prefix, threads and options lead the worker's
    # details, and the tensors requests send come apart from the model's own
    details = text[text.index("  cpu-0:") :].splitlines()
    assert details[1:7] == [
        "    pipeline numbers_handler:Numbers (sha256 e7107c287e83), 2 threads,",
        "             timeout 1.0 s, options scale=2.0",
        "    request input  text string [?]",
        "    reply output   sum float32 [?]",
        "    model input  a float32 [?, 3]",
        "    model input  b int64 [?, 2]",
    ]
    assert "replies:" not in text
    [worker] = doc["workers"]
    assert worker["record"]["pipeline"]["handler"] == "numbers_handler:Numbers"
    assert worker["record"]["pipeline"]["sha256"] == SHA
    assert worker["record"]["pipeline"]["threads"] == 2


def test_status_says_replies_of_undeclared_pipeline_outputs_are_not_the_models(
    rconn: redis.Redis,
) -> None:
    # Given a pipeline whose handler declares no outputs (its record's pipeline.outputs null)
    record = _record()
    record["pipeline"]["outputs"] = None
    _register(rconn, record)

    text = format_status(gather_status(rconn, MODEL))

    # Then what requests send is listed, and the replies are said not to be the model's outputs
    details = text[text.index("  cpu-0:") :].splitlines()
    assert details[3:6] == [
        "    request input  text string [?]",
        "    replies: outputs not declared by the handler: they are what its postprocess",
        "             returns (the model's outputs only when it has no postprocess)",
    ]
    assert "reply output" not in text
    assert "    model output twice float32 [?, 3]" in details


@pytest.mark.parametrize(
    ("postprocess", "said"),
    [
        (True, "replies: outputs not declared by the handler: they are what its postprocess "
               "returns"),
        (False, "replies: outputs not declared by the handler, which has no postprocess: the "
                "model's outputs below"),
    ],
)  # fmt: skip
def test_status_says_exactly_what_undeclared_replies_hold_when_the_record_tells(
    rconn: redis.Redis, postprocess: bool, said: str
) -> None:
    record = _record()
    record["pipeline"]["outputs"] = None
    record["pipeline"]["postprocess"] = postprocess  # a worker's record says since issue 27
    _register(rconn, record)

    text = " ".join(format_status(gather_status(rconn, MODEL)).split())

    assert said in text
    assert "only when it has no postprocess" not in text


def test_status_of_a_worker_without_pipeline_names_no_pipeline(rconn: redis.Redis) -> None:
    record = _record()
    del record["pipeline"]
    _register(rconn, record)
    text = format_status(gather_status(rconn, MODEL))
    assert "pipeline" not in text
    assert "    input  a float32 [?, 3]" in text


def _worker(stages_: dict[str, Any], after_s: float, name: str = "cpu-0") -> WorkerInfo:
    beat = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=after_s)
    return WorkerInfo(name, ttl_s=15, record={**_record(stages_=stages_, beat=beat), "name": name})


def test_stage_rates_are_taken_between_heartbeats() -> None:
    watched = watch.StageWatch()
    first = _totals((100, 5.0, 4.0), (100, 0.5), cpu_s=10.0)
    later = _totals((500, 24.0, 20.0), (500, 2.0), cpu_s=28.0)

    watched.update([_worker(first, 0)])
    watched.update([_worker(first, 0)])  # the same heartbeat: nothing new to say
    assert watched.rates == {}
    watched.update([_worker(later, 5)])
    assert watched.rates["cpu-0"].pre == pytest.approx(19.0 / 10.0)  # over 5 s, not 10
    assert watched.rates["cpu-0"].requests_per_s == pytest.approx(80.0)

    # The sample's own uptime, when it has one, times the interval rather than the heartbeat
    watched = watch.StageWatch()
    watched.update([_worker({**first, "uptime_s": 100.0}, 0)])
    watched.update([_worker({**later, "uptime_s": 110.0}, 5)])
    assert watched.rates["cpu-0"].requests_per_s == pytest.approx(40.0)

    # A restart under the same name starts again; a worker gone is forgotten
    watched.update([_worker(_totals((3, 0.1, 0.1), (3, 0.01), cpu_s=1.0), 10)])
    assert watched.rates == {}
    watched.update([])
    assert watched._base == {}


def test_watch_shows_stage_costs_and_the_verdict_per_worker(
    redis_url: str, rconn: redis.Redis
) -> None:
    # Given a pipeline worker whose record's totals move between two heartbeats 10 s apart,
    # its threads saturated and its model idle
    start = datetime.now(UTC) - timedelta(seconds=10)
    before = _totals((100, 5.0, 4.0), (100, 0.5), cpu_s=10.0, post=(100, 0.1, 0.1))
    after = _totals((500, 24.0, 20.0), (500, 2.0), cpu_s=28.0, post=(500, 0.5, 0.4))
    watched = watch.StageWatch()
    _register(rconn, _record(stages_=before, beat=start))
    first = watch.take_snapshot(rconn, MODEL)
    watched.update(first.status.workers)
    _register(rconn, _record(stages_=after, beat=start + timedelta(seconds=10)))
    second = watch.take_snapshot(rconn, MODEL)
    watched.update(second.status.workers)

    frame = watch.render(first, second, stage_rates=watched)

    lines = frame.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("stages "))
    header, row, verdict = lines[at + 1], lines[at + 2], lines[at + 3]
    assert header.split() == ["NAME", "PRE/REQ", "PRE", "CPU", "POST/REQ", "POST", "CPU", "REQ/S"]
    assert row.split() == ["cpu-0", "47.5", "ms", "40.0", "ms", "1.0", "ms", "0.8", "ms", "40"]
    assert verdict.startswith("    bound by preprocessing: pipeline threads 97% busy")
    assert all(len(line) <= 80 for line in lines)


def test_watch_says_when_stage_rates_come(redis_url: str, rconn: redis.Redis) -> None:
    _register(rconn, _record(stages_=_totals((1, 0.01, 0.01), (1, 0.001), cpu_s=1.0)))
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url")
    parser.add_argument("--prefix", default=P)
    parser.add_argument("--model", default=MODEL)
    status_command.add_watch_arguments(parser)
    args = parser.parse_args(["--redis-url", redis_url, "--watch", "--iterations", "1"])
    out = io.StringIO()
    assert status_command.run_watch(args, out=out) == 0
    assert "from the workers' next heartbeats on (every 5 s)" in out.getvalue()
    # A worker whose record has no totals (an older worker) adds no stage section
    rconn.flushall()
    _register(rconn, _record())
    out = io.StringIO()
    assert status_command.run_watch(args, out=out) == 0
    assert "stages " not in out.getvalue()
