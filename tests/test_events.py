"""The events interface: the null object, the fan-out, the metrics and the fault points behind it.

Fault points are built from an environment mapping handed in (by the CLI), never from
``os.environ`` at import, so a worker in a test process has none unless it is given them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import write_config

from worker.cli import main
from worker.events import NO_EVENTS, Events, Fanout, Ran
from worker.ops import faults as faults_module
from worker.ops.faults import FaultPoints
from worker.ops.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]


class Recorder(Events):
    """Notes every event it hears, with its arguments."""

    def __init__(self, name: str, heard: list[tuple[str, str, Any]]) -> None:
        self.name, self.heard = name, heard

    def batch_done(self, codes, queued_s, decode_s, runs, write_s, classes=()) -> None:  # type: ignore[no-untyped-def]
        self.heard.append((self.name, "batch_done", (list(codes), list(decode_s), list(runs))))

    def redis_down(self, during: str) -> None:
        self.heard.append((self.name, "redis_down", during))

    def claimed(self, kind: str) -> None:
        self.heard.append((self.name, "claimed", kind))

    def leases_renewed(self, count: int) -> None:
        self.heard.append((self.name, "leases_renewed", count))

    def consumers_forgotten(self, count: int) -> None:
        self.heard.append((self.name, "consumers_forgotten", count))

    def cancelled_after_run(self) -> None:
        self.heard.append((self.name, "cancelled_after_run", None))

    def point(self, name: str) -> None:
        self.heard.append((self.name, "point", name))

    def run_starts(self, feeds: Mapping[str, np.ndarray]) -> None:
        self.heard.append((self.name, "run_starts", sorted(feeds)))

    def executed(self, requests: Sequence[Ran]) -> None:
        self.heard.append((self.name, "executed", [r.rid for r in requests]))


class _Request:
    def __init__(self, rid: str) -> None:
        self.rid = rid


def _every_event(events: Events) -> None:
    # generators: a fan-out must hand each sink the whole of them
    events.batch_done(
        (c for c in ["OK", "CANCELLED"]), [0.1, 0.2], (d for d in [0.01]), iter([(2, 0.5)]), 0.3
    )
    events.redis_down("reading requests")
    events.claimed("own")
    events.leases_renewed(3)
    events.consumers_forgotten(1)
    events.cancelled_after_run()
    events.point("after_read")
    events.run_starts({"x": np.zeros((1, 2))})
    events.executed([_Request("r1"), _Request("r2")])


def test_the_null_object_hears_every_event_and_does_nothing() -> None:
    _every_event(NO_EVENTS)
    _every_event(Events())


def test_a_fanout_hands_each_event_to_every_sink_in_order() -> None:
    heard: list[tuple[str, str, Any]] = []
    _every_event(Fanout(Recorder("a", heard), Recorder("b", heard)))
    kinds = [kind for _, kind, _ in heard]
    assert kinds == [k for k in dict.fromkeys(kinds) for _ in range(2)]  # a then b, each event
    assert [name for name, _, _ in heard] == ["a", "b"] * 9
    done = [args for _, kind, args in heard if kind == "batch_done"]
    assert done == [(["OK", "CANCELLED"], [0.01], [(2, 0.5)])] * 2  # b saw what a saw


def test_metrics_count_their_events_behind_a_fanout_and_ignore_fault_points() -> None:
    metrics, heard = Metrics(), []
    _every_event(Fanout(metrics, Recorder("faults", heard)))
    sample = metrics.registry.get_sample_value
    assert sample("redbatch_requests_total", {"code": "OK"}) == 1
    assert sample("redbatch_requests_total", {"code": "CANCELLED"}) == 1
    assert sample("redbatch_redis_outages_total", {"during": "reading requests"}) == 1
    assert sample("redbatch_claims_total", {"kind": "own"}) == 1
    assert sample("redbatch_lease_renewals_total") == 3
    assert sample("redbatch_consumers_removed_total") == 1
    assert sample("redbatch_cancelled_after_run_total") == 1
    assert sample("redbatch_batch_rows_count") == 1
    assert len(heard) == 9


# ---------------------------------------------------------------------------------------------
# Fault points


def test_no_fault_variables_build_no_fault_points() -> None:
    assert FaultPoints.from_env({}) is None
    assert FaultPoints.from_env({"REDBATCH_FAULTS": "", "REDBATCH_EXEC_LOG": ""}) is None
    assert FaultPoints.from_env({"REDBATCH_FAULTS_SEED": "7"}) is None


def test_fault_points_are_built_from_the_mapping_given() -> None:
    env = {"REDBATCH_FAULTS": "after_read=kill:0.25, before_finish=kill,crash_value=666"}
    points = FaultPoints.from_env(env)
    assert points is not None
    assert points.points == {"after_read": 0.25, "before_finish": 1.0}
    assert points.crash_value == 666.0
    assert points.exec_log is None
    logged = FaultPoints.from_env({"REDBATCH_EXEC_LOG": "/tmp/x.log"})
    assert logged is not None
    assert (logged.points, logged.crash_value, logged.exec_log) == ({}, None, "/tmp/x.log")


@pytest.mark.parametrize(
    ("spec", "named"),
    [("nowhere=kill", "unknown point 'nowhere'"), ("after_read=crash", "unknown action 'crash'")],
)
def test_a_bad_fault_spec_is_refused_by_name(spec: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        FaultPoints.from_env({"REDBATCH_FAULTS": spec})


class _Died(Exception):
    """Stands in for SIGKILL."""


@pytest.fixture
def dies(monkeypatch: pytest.MonkeyPatch) -> None:
    def die() -> None:
        raise _Died

    monkeypatch.setattr(faults_module, "_die", die)


@pytest.mark.usefixtures("dies")
def test_an_armed_point_kills_and_others_do_not() -> None:
    points = FaultPoints({"after_read": 1.0, "after_finish": 0.0})
    points.point("after_inference")  # not armed
    points.point("after_finish")  # armed, never by the dice
    with pytest.raises(_Died):
        points.point("after_read")


@pytest.mark.usefixtures("dies")
def test_the_crash_pill_kills_inside_inference_only_when_an_input_holds_it() -> None:
    points = FaultPoints({}, crash_value=666.0)
    points.run_starts({"x": np.zeros((4, 2), np.float32), "n": np.full((4, 1), 666, np.int64)})
    with pytest.raises(_Died):
        points.run_starts({"x": np.array([[1.0, 666.0]], np.float32)})
    FaultPoints({}).run_starts({"x": np.array([[666.0]], np.float32)})  # no pill set


def test_the_execution_log_gets_one_line_per_request_run(tmp_path: Path) -> None:
    log = tmp_path / "exec.log"
    points = FaultPoints({}, exec_log=str(log), pid=42)
    points.executed([_Request("a"), _Request("b")])
    points.executed([_Request("c")])
    assert log.read_text() == "a 42\nb 42\nc 42\n"
    FaultPoints({}).executed([_Request("d")])  # no log: nothing written anywhere


def test_importing_the_worker_reads_no_fault_variables() -> None:
    # A spec that would be refused: importing every worker module must not look at it
    env = {**os.environ, "REDBATCH_FAULTS": "nowhere=kill", "PYTHONPATH": str(ROOT)}
    code = "import worker.ops.faults, worker.service, worker.cli; print('imported')"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "imported"


def test_the_cli_refuses_a_bad_fault_spec_before_loading_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, "tiny", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("REDBATCH_FAULTS", "nowhere=kill")
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "REDBATCH_FAULTS: unknown point 'nowhere'" in err
    assert "Traceback" not in err
