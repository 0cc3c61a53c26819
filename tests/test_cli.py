"""The ``redbatch`` command line against a real Redis and a small fake worker thread."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal as signals
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from producer.cli.main import main
from producer.client.results import Chunk, Result
from producer.jobs.job import (
    FailedRequest,
    RunSummary,
    format_summary,
    run_job,
    write_errors,
    write_outputs,
)
from producer.protocol import codec, keys
from producer.protocol.codec import ErrorInfo, ModelRef
from producer.protocol.lanes import lane_stream
from tools.localredis import free_port

MODEL = "demo"
PREFIX = keys.DEFAULT_PREFIX
SHA = "ab" * 32


class FakeWorker(threading.Thread):
    """Answers y = x * 2 over the contract's stream and the low lane (where ``redbatch run``
    sends by default), or INVALID_INPUT for a negative value.

    It reads up to 64 entries at a time and reports them as one batch, so replies carry a
    real batch_rows.
    """

    def __init__(self, url: str, name: str = "fake-1") -> None:
        super().__init__(daemon=True)
        self.conn = redis.Redis.from_url(url)
        self.name_ = name
        self.streams = [keys.request_stream(PREFIX, MODEL), lane_stream(PREFIX, MODEL, "low")]
        self.stop_event = threading.Event()
        for stream in self.streams:
            self.conn.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
        # a live record, as a real worker keeps one: redbatch run refuses a model without
        self.conn.set(keys.worker_key(PREFIX, MODEL, name), json.dumps({"name": name}), ex=60)
        self.conn.sadd(keys.workers_key(PREFIX, MODEL), name)

    def run(self) -> None:
        while not self.stop_event.is_set():
            # The block timeout only bounds how late stop() is noticed; data wakes it at once.
            got = self.conn.xreadgroup(
                keys.CONSUMER_GROUP, self.name_, dict.fromkeys(self.streams, ">"), count=64,
                block=100,
            )  # fmt: skip
            for stream, entries in got or []:
                self.answer(stream, entries)

    def answer(self, stream: bytes, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        bodies = [codec.decode_request(fields[b"body"], 1 << 24) for _, fields in entries]
        batch_rows = sum(len(b.inputs["x"]) for b in bodies)
        pipe = self.conn.pipeline(transaction=False)
        for (entry_id, fields), body in zip(entries, bodies, strict=True):
            x = body.inputs["x"]
            common = {
                "rid": fields[b"rid"].decode(),
                "model": codec.ModelRef(MODEL, "1", SHA),
                "worker": self.name_,
                "timings_ms": {"queued": 1.0, "inference": 0.5},
            }
            if (x < 0).any():
                error = codec.ErrorInfo("INVALID_INPUT", "input 'x' has a negative value.")
                reply = codec.Reply(ok=False, error=error, **common)
            else:
                reply = codec.Reply(ok=True, outputs={"y": x * 2}, batch_rows=batch_rows, **common)
            key = keys.reply_key(PREFIX, MODEL, common["rid"])
            pipe.rpush(key, codec.encode_reply(reply))
            pipe.expire(key, 60)
            pipe.xack(stream, keys.CONSUMER_GROUP, entry_id)
            pipe.xdel(stream, entry_id)
        pipe.execute()

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=10)
        self.conn.close()


def worker_record(name: str, **overrides: object) -> dict[str, object]:
    record: dict[str, object] = {
        "name": name,
        "state": "ready",
        "model": {"name": MODEL, "version": "7", "sha256": SHA, "path": "/m/demo.onnx"},
        "inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 4], "min": -1.0, "max": 1.0}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": [-1, 4]}],
        "runtime": {"onnxruntime": "1.31.1", "providers": ["CPUExecutionProvider"]},
        "batching": {"max_batch_size": 32, "max_wait_ms": 5},
        "host": "box",
        "pid": 4242,
        "started_at": "2026-11-30T01:00:00Z",
        "heartbeat_at": "2026-11-30T01:00:05Z",
        "served": {"requests": 120, "batches": 10},
    }
    record.update(overrides)
    return record


def register(rconn: redis.Redis, name: str, ttl_s: int = 60) -> None:
    rconn.set(keys.worker_key(PREFIX, MODEL, name), json.dumps(worker_record(name)), ex=ttl_s)
    rconn.sadd(keys.workers_key(PREFIX, MODEL), name)


@pytest.fixture
def fake_worker(redis_url: str) -> Iterator[FakeWorker]:
    worker = FakeWorker(redis_url)
    worker.start()
    yield worker
    worker.stop()


def make_inputs(rows: int, bad_rows: list[int]) -> np.ndarray:
    x = np.random.default_rng(0).random((rows, 4), dtype=np.float32)
    x[bad_rows, 2] = -1.0
    return x


# ---------------------------------------------------------------------------------------------
# run


@pytest.mark.usefixtures("fake_worker")
def test_run_npy_writes_rows_in_order_and_lists_failed_rows(
    redis_url: str, rconn: redis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a .npy with three bad rows, and a live worker record naming the one input 'x'
    bad = [5, 1234, 2999]
    x = make_inputs(3000, bad)
    np.save(tmp_path / "x.npy", x)
    register(rconn, "fake-1")
    out = tmp_path / "y.npz"

    # When it runs one row per request
    code = main(["--redis-url", redis_url, "run", "--model", MODEL, "--input",
                 str(tmp_path / "x.npy"), "--output", str(out), "--no-progress"])  # fmt: skip

    # Then good rows are x * 2 in input order, bad rows are NaN and listed, and it exits 1
    assert code == 1
    y = np.load(out)["y"]
    good = np.setdiff1d(np.arange(3000), bad)
    np.testing.assert_array_equal(y[good], x[good] * 2)
    assert np.isnan(y[bad]).all()
    lines = (tmp_path / "y.npz.errors.jsonl").read_text().splitlines()
    failures = [json.loads(line) for line in lines]
    assert [(f["start"], f["stop"]) for f in failures] == [(r, r + 1) for r in bad]
    assert {f["code"] for f in failures} == {"INVALID_INPUT"}
    assert all(keys.is_valid_rid(f["rid"]) and "negative" in f["message"] for f in failures)
    summary = capsys.readouterr().out
    assert "2997 ok, 3 failed, 3000 total, in 3000 requests of 1 row" in summary
    assert "rows/s" in summary
    assert "failed      INVALID_INPUT 3 rows; listed in" in summary


@pytest.mark.usefixtures("fake_worker")
def test_run_summary_reports_latency_batches_and_serving_workers(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "x.npy", make_inputs(500, []))
    argv = ["--redis-url", redis_url, "run", "--model", MODEL, "--input-name", "x",
            "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npz")]  # fmt: skip

    assert main(argv) == 0

    summary = capsys.readouterr().out
    assert re.search(r"latency +p50 [\d.]+ ms +p90 [\d.]+ ms +p99 [\d.]+ ms", summary)
    assert "client-side" in summary
    assert re.search(r"batch rows +mean [\d.]+", summary)
    assert "served by   fake-1: model demo version 1 (sha256 abababababab), 500 requests" in summary


@pytest.mark.usefixtures("fake_worker")
def test_run_npz_all_ok_exits_0(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x = make_inputs(2000, [])
    np.savez(tmp_path / "in.npz", x=x)
    out, errors = tmp_path / "out.npz", tmp_path / "errs.jsonl"

    code = main(["run", "--redis-url", redis_url, "--model", MODEL, "--input",
                 str(tmp_path / "in.npz"), "--output", str(out), "--errors", str(errors),
                 "--rows-per-request", "7", "--no-progress"])  # fmt: skip

    assert code == 0
    np.testing.assert_array_equal(np.load(out)["y"], x * 2)
    assert errors.read_text() == ""
    summary = capsys.readouterr().out
    assert "2000 ok, 0 failed" in summary
    assert "in 286 requests of up to 7 rows" in summary
    assert not list(tmp_path.glob("*.tmp"))


def test_run_npy_without_worker_or_input_name_is_a_usage_error(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "x.npy", make_inputs(4, []))
    code = main(["--redis-url", redis_url, "run", "--model", MODEL, "--input",
                 str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npz")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "model 'demo' has no live worker" in err
    assert len(err.strip().splitlines()) == 1
    code = main(["--redis-url", redis_url, "run", "--model", MODEL, "--input",
                 str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npz"),
                 "--wait-for-worker"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "--input-name" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "y.npz").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--input", "missing.npy", "--output", "y.npz"], "does not exist"),
        (["--input", "x.npy", "--output", "nodir/y.npz"], "does not exist"),
        (["--input", "x.npy", "--output", "y.npz", "--rows-per-request", "0"], "positive"),
        (["--input", "x.npy"], "--output"),
        (["--input", "x.npy", "--output", "y.csv"], "give a name that ends in .npz"),
        (["--input", "junk.npy", "--output", "y.npz"], "it is not a .npy of numeric arrays"),
    ],
)
def test_run_bad_arguments_exit_2(
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "x.npy", make_inputs(4, []))
    (tmp_path / "junk.npy").write_bytes(b"this is not an array")
    code = main(["--redis-url", redis_url, "run", "--model", MODEL, "--input-name", "x", *args])
    assert code == 2
    assert message in capsys.readouterr().err


def test_run_refuses_inputs_a_live_worker_says_will_fail(
    redis_url: str, rconn: redis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    register(rconn, "host-7")
    np.savez(tmp_path / "in.npz", z=make_inputs(4, []))
    base = ["--redis-url", redis_url, "run", "--model", MODEL, "--output", str(tmp_path / "y.npz")]

    assert main([*base, "--input", str(tmp_path / "in.npz")]) == 2
    assert "do not match model 'demo' inputs ['x']" in capsys.readouterr().err

    np.save(tmp_path / "x.npy", make_inputs(4, []))
    assert main([*base, "--input", str(tmp_path / "x.npy"), "--rows-per-request", "33"]) == 2
    assert "max_batch_size=32" in capsys.readouterr().err

    assert main([*base, "--input", str(tmp_path / "x.npy"), "--outputs", "y,probs"]) == 2
    assert "--outputs probs: model 'demo' has no such output; it has y." in (
        capsys.readouterr().err
    )

    np.save(tmp_path / "x64.npy", make_inputs(4, []).astype(np.float64))
    assert main([*base, "--input", str(tmp_path / "x64.npy")]) == 2
    err = capsys.readouterr().err
    assert "input 'x' is float64, but model 'demo' takes float32" in err
    assert "x.astype(np.float32)" in err

    for shape in [(4, 3), (4,), (4, 2, 2)]:  # a wrong column count, a 1-D array, a 3-D one
        np.save(tmp_path / "bad.npy", np.zeros(shape, np.float32))
        assert main([*base, "--input", str(tmp_path / "bad.npy")]) == 2
        err = capsys.readouterr().err
        assert f"input 'x' has shape {list(shape)}, but model 'demo' takes rows of shape [4]" in err
    assert not rconn.exists(keys.request_stream(PREFIX, MODEL))  # nothing was sent


# ---------------------------------------------------------------------------------------------
# run_job and the summary, with a stand-in for Client.map


class ScriptedClient:
    """Answers map() from a list of (batch_rows, latency_ms, error code or None), one row each,
    then ends, as a map() stopped at a late reply ends (or raises ``interrupt`` first)."""

    def __init__(
        self,
        script: list[tuple[int, float, str | None]],
        interrupt: BaseException | signals.Signals | None = None,
    ) -> None:
        self.script = script
        self.interrupt = interrupt
        self.closed = False
        self.kwargs: dict[str, object] = {}

    def map(self, arrays: dict[str, np.ndarray], **kwargs: object) -> Iterator[Chunk]:
        self.kwargs = kwargs
        x = arrays["x"]
        try:
            for i, (batch_rows, latency_ms, code) in enumerate(self.script):
                yield self.chunk(x, i, batch_rows, latency_ms, code)
            if isinstance(self.interrupt, signals.Signals):
                os.kill(os.getpid(), self.interrupt)  # its handler raises here, if it has one
            elif self.interrupt is not None:
                raise self.interrupt
        finally:
            self.closed = True

    @staticmethod
    def chunk(x: np.ndarray, i: int, batch_rows: int, latency_ms: float, code: str | None) -> Chunk:
        error = ErrorInfo(code, f"row {i} is bad.") if code else None
        outputs = None if code else {"y": x[i : i + 1] * 2}
        late = code == "WAIT_TIMEOUT"  # as Client.map: no reply, so no worker or model
        result = Result(
            rid=f"r{i}", ok=code is None, outputs=outputs, error=error, meta=None,
            model=ModelRef("", "", "") if late else ModelRef(MODEL, "3", SHA),
            worker="" if late else f"w{i % 2}", batch_rows=None if late else batch_rows,
            timings_ms={} if late else {"queued": 1.0, "inference": 1.0},
        )  # fmt: skip
        return Chunk(i, i + 1, f"r{i}", outputs, error, result, latency_ms)


def test_run_job_stacks_in_order_and_measures_latency_and_batches() -> None:
    script = [(1, 10.0, None), (4, 20.0, None), (4, 30.0, "INVALID_INPUT"), (16, 40.0, None)]
    script.append((0, 1000.0, "WAIT_TIMEOUT"))  # row 4 is late; row 5 is never sent
    x = np.arange(6, dtype=np.float32).reshape(6, 1)

    summary = run_job(ScriptedClient(script), {"x": x})

    np.testing.assert_array_equal(summary.outputs["y"][[0, 1, 3]], x[[0, 1, 3]] * 2)
    assert np.isnan(summary.outputs["y"][[2, 4, 5]]).all()
    assert (summary.rows_ok, summary.rows_failed, summary.requests) == (3, 3, 4)
    assert [(f.start, f.stop, f.rid, f.code) for f in summary.failures] == [
        (2, 3, "r2", "INVALID_INPUT"),
        (4, 5, "r4", "WAIT_TIMEOUT"),  # the late request itself
        (5, 6, None, "WAIT_TIMEOUT"),  # and every row after it: the run stopped there
    ]
    assert summary.batch_rows == {1: 1, 4: 1, 16: 1}
    assert summary.latency_percentiles_ms()["p50"] == pytest.approx(25.0)  # answered ones only
    text = format_summary(summary, output_path="y.npz", errors_path="y.npz.errors.jsonl")
    assert "3 ok, 3 failed, 6 total, in 4 requests of 1 row; 2 not answered" in text
    assert re.search(r"latency +p50 25\.0 ms +p90 37\.0 ms +p99 39\.7 ms +max 40\.0 ms", text)
    assert "batch rows  mean 7.0" in text
    assert re.search(r"^ +4 +1 +#+$", text, re.MULTILINE)
    assert "served by   w0: model demo version 3 (sha256 abababababab), 2 requests" in text
    assert "served by   :" not in text  # no line for the request nobody answered
    failed = "failed      WAIT_TIMEOUT 2 rows, INVALID_INPUT 1 row; listed in y.npz.errors.jsonl"
    assert failed in text
    assert "output      y.npz: y float32 [6, 1]" in text


def test_run_job_stops_sending_at_the_first_late_reply_and_keeps_what_came_back() -> None:
    # Given a map() that, as asked, stopped sending at a late reply (row 1), after which the
    # request already in flight (row 2) was still answered
    client = ScriptedClient([(1, 10.0, None), (0, 1000.0, "WAIT_TIMEOUT"), (1, 10.0, None)])
    x = np.arange(100, dtype=np.float32).reshape(100, 1)

    summary = run_job(client, {"x": x})

    # Then row 2's answer is kept, the late request is listed with its rid, the rows never
    # sent are one failure, and map() was asked to stop and was closed
    assert client.kwargs["stop_on_timeout"] is True
    assert client.closed
    np.testing.assert_array_equal(summary.outputs["y"][[0, 2]], x[[0, 2]] * 2)
    assert [(f.start, f.stop, f.rid, f.code) for f in summary.failures] == [
        (1, 2, "r1", "WAIT_TIMEOUT"),
        (3, 100, None, "WAIT_TIMEOUT"),
    ]
    assert "is a worker serving this model?" in summary.failures[1].message
    assert summary.rows_ok == 2


def test_run_job_interrupted_keeps_what_came_back() -> None:
    client = ScriptedClient([(2, 10.0, None), (2, 10.0, None)], interrupt=KeyboardInterrupt())
    x = np.arange(5, dtype=np.float32).reshape(5, 1)

    summary = run_job(client, {"x": x})

    assert summary.interrupted
    assert client.closed
    np.testing.assert_array_equal(summary.outputs["y"][:2], x[:2] * 2)
    assert [(f.start, f.stop, f.code) for f in summary.failures] == [(2, 5, "NOT_ANSWERED")]
    assert "(interrupted)" in format_summary(summary)


def test_run_interrupted_writes_the_rows_answered_and_exits_130(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a run that Ctrl-C stops after 2 of 5 rows came back
    np.save(tmp_path / "x.npy", np.arange(5, dtype=np.float32).reshape(5, 1))
    script = [(2, 10.0, None), (2, 10.0, None)]
    client = ScriptedClient(script, interrupt=KeyboardInterrupt())
    monkeypatch.setattr(
        "producer.client.blocking.Client.map", lambda _self, arrays, **kw: client.map(arrays)
    )
    out = tmp_path / "y.npz"
    argv = ["--redis-url", redis_url, "run", "--model", MODEL, "--input", str(tmp_path / "x.npy")]
    argv.append("--wait-for-worker")  # no worker: map() is a stand-in, or none is meant

    code = main([*argv, "--input-name", "x", "--output", str(out), "--no-progress"])

    # Then the two answered rows are written, and the rest listed as not answered
    assert code == 130
    with np.load(out) as written:
        np.testing.assert_array_equal(written["y"][:2], [[0.0], [2.0]])
        assert np.isnan(written["y"][2:]).all()
    lines = [
        json.loads(line) for line in (tmp_path / "y.npz.errors.jsonl").read_text().splitlines()
    ]
    assert [(e["start"], e["stop"], e["code"]) for e in lines] == [(2, 5, "NOT_ANSWERED")]


def test_sigterm_ends_a_run_as_ctrl_c_does(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a run that SIGTERM (how orchestrators stop a job) stops after 2 of 5 rows came back
    np.save(tmp_path / "x.npy", np.arange(5, dtype=np.float32).reshape(5, 1))
    client = ScriptedClient([(2, 10.0, None), (2, 10.0, None)], interrupt=signals.SIGTERM)
    monkeypatch.setattr(
        "producer.client.blocking.Client.map", lambda _self, arrays, **kw: client.map(arrays)
    )
    unhandled: list[int] = []  # without the run's own handler, SIGTERM would land here

    def ours(signum: int, _frame: object) -> None:
        unhandled.append(signum)

    previous = signals.signal(signals.SIGTERM, ours)
    out = tmp_path / "y.npz"
    argv = ["--redis-url", redis_url, "run", "--model", MODEL, "--input", str(tmp_path / "x.npy")]
    argv.append("--wait-for-worker")  # no worker: map() is a stand-in, or none is meant
    try:
        code = main([*argv, "--input-name", "x", "--output", str(out), "--no-progress"])
        assert signals.getsignal(signals.SIGTERM) is ours  # the run put it back
    finally:
        signals.signal(signals.SIGTERM, previous)

    # Then, as with Ctrl-C, the answered rows are written and the rest listed
    assert (code, unhandled) == (130, [])
    with np.load(out) as written:
        np.testing.assert_array_equal(written["y"][:2], [[0.0], [2.0]])
    lines = (tmp_path / "y.npz.errors.jsonl").read_text().splitlines()
    assert [json.loads(line)["code"] for line in lines] == ["NOT_ANSWERED"]


def test_run_interrupted_before_any_answer_keeps_the_previous_files_as_a_pair(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    np.save(tmp_path / "x.npy", np.arange(3, dtype=np.float32).reshape(3, 1))
    out = tmp_path / "y.npz"
    np.savez(out, y=np.ones((3, 1), np.float32))  # an earlier run's results
    errors = tmp_path / "y.npz.errors.jsonl"
    errors.write_text("")  # and its errors file: that run failed no row
    client = ScriptedClient([], interrupt=KeyboardInterrupt())
    monkeypatch.setattr(
        "producer.client.blocking.Client.map", lambda _self, arrays, **kw: client.map(arrays)
    )
    argv = ["--redis-url", redis_url, "run", "--model", MODEL, "--input", str(tmp_path / "x.npy")]
    argv.append("--wait-for-worker")  # no worker: map() is a stand-in, or none is meant

    assert main([*argv, "--input-name", "x", "--output", str(out), "--no-progress"]) == 130

    with np.load(out) as kept:
        np.testing.assert_array_equal(kept["y"], np.ones((3, 1), np.float32))
    assert errors.read_text() == ""  # not rewritten to say the kept output's rows failed
    printed = capsys.readouterr()
    assert "not written (nothing answered)" in printed.out
    assert "nothing was written" in printed.err


def test_run_summary_counts_answered_rows_and_failed_rows_by_code() -> None:
    # Given a run whose second request was late, so that the 8 rows behind it were never sent
    client = ScriptedClient([(1, 10.0, None), (0, 1000.0, "WAIT_TIMEOUT")])
    summary = run_job(client, {"x": np.zeros((10, 1), np.float32)})
    summary.wall_s = 2.0

    text = format_summary(summary, errors_path="e.jsonl")

    # Then only the answered row counts towards throughput, and failures count rows, not lines
    assert "1 ok, 9 failed, 10 total, in 1 request of 1 row; 9 not answered" in text
    assert "throughput 0 rows/s (0 requests/s)" in text  # 1 row in 2 s
    assert "failed      WAIT_TIMEOUT 9 rows; listed in e.jsonl" in text


@pytest.mark.parametrize("which", ["input", "output"])
def test_run_refuses_an_errors_file_that_is_the_input_or_the_output(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture, which: str
) -> None:
    x = tmp_path / "x.npy"
    np.save(x, np.ones((2, 1), np.float32))
    before = x.read_bytes()
    out = tmp_path / "y.npz"
    argv = ["--redis-url", redis_url, "run", "--model", MODEL, "--input", str(x)]

    code = main([*argv, "--output", str(out), "--errors", str(x if which == "input" else out)])

    assert code == 2
    assert f"--errors must not be the --{which} file" in capsys.readouterr().err
    assert x.read_bytes() == before
    assert not out.exists()


@pytest.mark.parametrize(("name", "content"), [("e.npy", b""), ("e.npz", b""), ("c.npy", None)])
def test_run_names_an_empty_or_cut_short_input(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture, name: str, content: bytes | None
) -> None:
    path = tmp_path / name
    if content is None:  # a header cut off in the middle
        np.save(path, np.ones((2, 1), np.float32))
        path.write_bytes(path.read_bytes()[:20])
    else:
        path.write_bytes(content)
    argv = ["--redis-url", redis_url, "run", "--model", MODEL, "--input-name", "x"]

    code = main([*argv, "--input", str(path), "--output", str(tmp_path / "y.npz")])

    assert code == 2
    err = capsys.readouterr().err
    assert f"cannot read {str(path)!r}: " in err
    assert "Traceback" not in err


def test_run_job_interrupted_while_handling_a_reply_keeps_it() -> None:
    # Ctrl-C inside the loop body (here: in the progress callback) rather than in map()
    client = ScriptedClient([(1, 10.0, None), (1, 10.0, None), (1, 10.0, None)])
    x = np.arange(3, dtype=np.float32).reshape(3, 1)
    calls = []

    def progress(rows: int) -> None:
        calls.append(rows)
        if len(calls) == 2:
            raise KeyboardInterrupt

    summary = run_job(client, {"x": x}, on_progress=progress)

    assert summary.interrupted
    assert client.closed
    np.testing.assert_array_equal(summary.outputs["y"][:2], x[:2] * 2)
    assert [(f.start, f.stop, f.code) for f in summary.failures] == [(2, 3, "NOT_ANSWERED")]


def test_run_with_no_worker_stops_after_one_timeout(
    redis_url: str, rconn: redis.Redis, tmp_path: Path
) -> None:
    # Given 400 rows, 8 in flight, and no worker: before, every window of 8 waited out its
    # own timeout (50 of them); now the run stops sending at the first late reply.
    np.save(tmp_path / "x.npy", make_inputs(400, []))
    out = tmp_path / "y.npz"
    argv = ["--redis-url", redis_url, "run", "--model", MODEL, "--input", str(tmp_path / "x.npy")]
    argv.append("--wait-for-worker")  # no worker: map() is a stand-in, or none is meant
    argv += ["--input-name", "x", "--output", str(out), "--concurrency", "8", "--timeout-s", "0.5"]

    assert main([*argv, "--no-progress"]) == 1

    stream = lane_stream(PREFIX, MODEL, "low")  # a run is a batch job: class low by default
    entries = rconn.xrange(stream)
    assert len(entries) == 8  # only the first window was ever sent
    rids = [fields[b"rid"].decode() for _, fields in entries]
    assert all(rconn.exists(keys.cancel_key(PREFIX, MODEL, rid)) for rid in rids)  # and cancelled
    lines = [
        json.loads(line) for line in (tmp_path / "y.npz.errors.jsonl").read_text().splitlines()
    ]
    late = [(i, i + 1, "WAIT_TIMEOUT") for i in range(8)]  # each in-flight request, by rid
    assert [(e["start"], e["stop"], e["code"]) for e in lines] == [*late, (8, 400, "WAIT_TIMEOUT")]
    stopped_at = f"not sent: the run stopped sending when the request for row 0 (rid {rids[0]})"
    assert lines[-1]["message"].startswith(stopped_at)


def test_requests_failing_alike_keep_one_errors_entry_each_with_its_rid() -> None:
    # A bad column fails every request with one message: still one entry per request, with its
    # rid (a merged range lost the rids, and the worker's message is each request's own);
    # only the rows never answered are one range, without a rid
    class OneMessage(ScriptedClient):
        @staticmethod
        def chunk(x: np.ndarray, i: int, rows: int, ms: float, code: str | None) -> Chunk:
            c = ScriptedClient.chunk(x, i, rows, ms, code)
            error = (
                ErrorInfo(code, "input 'x': expected shape [-1, 2], got [1, 1].") if code else None
            )
            return Chunk(c.start, c.stop, c.rid, c.outputs, error, c.result, c.latency_ms)

    script = [(1, 1.0, None), (1, 1.0, "INVALID_INPUT"), (1, 1.0, "INVALID_INPUT")]
    script += [(1, 1.0, None), (1, 1.0, "INVALID_INPUT"), (0, 1000.0, "WAIT_TIMEOUT")]
    spilled: list[FailedRequest] = []
    summary = run_job(
        OneMessage(script), {"x": np.zeros((9, 1), np.float32)}, errors=spilled.append
    )
    assert [(f.start, f.stop, f.rid, f.code) for f in spilled] == [
        (1, 2, "r1", "INVALID_INPUT"),
        (2, 3, "r2", "INVALID_INPUT"),
        (4, 5, "r4", "INVALID_INPUT"),
        (5, 6, "r5", "WAIT_TIMEOUT"),
        (6, 9, None, "WAIT_TIMEOUT"),  # never sent: one range
    ]
    assert summary.failures == []  # spilled as they came
    assert summary.failed_rows == {"INVALID_INPUT": 3, "WAIT_TIMEOUT": 4}
    assert spilled[-1].message.startswith(
        "not sent: the run stopped sending when the request for row 5 (rid r5) got no reply"
    )


@pytest.mark.parametrize(
    ("failure", "key_name", "words"),
    [
        (FailedRequest(3, 4, "r3", "INVALID_INPUT", "bad."), None, "row 3: INVALID_INPUT: bad."),
        (
            FailedRequest(3, 4, "r3", "INVALID_INPUT", "bad.", (5, 5)),
            "line",
            "row 3 (line 5): INVALID_INPUT: bad.",
        ),
        (
            FailedRequest(3, 7, "r3", "INVALID_INPUT", "bad.", ("a", "d")),
            "id",
            "rows 3 to 6 (id a to d): INVALID_INPUT: bad.",
        ),
        (
            FailedRequest(3, None, None, "NOT_ANSWERED", "gone.", (9, None)),
            "row",
            "rows 3 to the end (table row 9): NOT_ANSWERED: gone.",
        ),
        (
            FailedRequest(1, 1, None, "UNREADABLE", "not UTF-8.", (2, 2)),
            "line",
            "line 2, skipped before row 1: UNREADABLE: not UTF-8.",
        ),
    ],
)
def test_the_summary_names_the_first_error_by_row_number_and_key(
    failure: FailedRequest, key_name: str | None, words: str
) -> None:
    summary = RunSummary(rows=10, key_name=key_name)
    summary.fail(failure)

    text = format_summary(summary, errors_path="e.jsonl")

    assert "; listed in e.jsonl (row numbers count from 0 there and here)" in text
    assert f"\n  first error: {words}" in text


def test_run_help_says_the_errors_file_is_always_written(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["run", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "always written; empty when every row succeeded" in out
    assert 'one JSON line per failed request, with its "rid"' in out
    assert '(counted from 0, "stop" one past the last' in out


def test_summary_of_a_job_where_nothing_succeeded_says_so() -> None:
    summary = RunSummary(rows=2, requests=0, wall_s=0.5)

    text = format_summary(summary, output_path="y.npz")

    assert "no outputs" in text
    assert "latency     none measured" in text


# ---------------------------------------------------------------------------------------------
# status


def test_status_shows_backlog_consumers_dead_letters_and_live_workers(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given 5 requests, 2 of them read by one consumer, a dead letter, one live worker record
    # and one registered name whose record has expired
    stream = keys.request_stream(PREFIX, MODEL)
    rconn.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
    for i in range(5):
        rconn.xadd(stream, {"rid": f"r{i}", "body": b"\x80"})
    rconn.xreadgroup(keys.CONSUMER_GROUP, "host-7", {stream: ">"}, count=2)
    dead = keys.dead_key(PREFIX, MODEL)
    rconn.xadd(dead, {"rid": "bad id!", "body": b"", "reason": "rid breaks the pattern."})
    register(rconn, "host-7")
    # ... the second not UTF-8, the third the text the second is shown as
    rconn.sadd(keys.workers_key(PREFIX, MODEL), "gone-1", b"bad\xff", b"bad\\xff")

    code = main(["--redis-url", redis_url, "status", "--model", MODEL])

    out = capsys.readouterr().out
    assert code == 0
    assert "backlog (XLEN): 5" in out
    assert "pending 2, lag 3" in out
    consumer_row = next(line for line in out.splitlines() if line.strip().startswith("host-7"))
    assert consumer_row.split()[1] == "2"
    assert "Dead letters redbatch:{demo}:dead: 1" in out
    assert "rid breaks the pattern." in out
    assert "Workers: 1 live" in out
    assert "removed 3 expired from the registry: bad\\xff, bad\\xff, gone-1" in out
    assert "abababababab" in out
    assert "32 rows/5 ms" in out
    assert "input  x float32 [?, 4] range [-1.0, 1.0]" in out
    assert "box:4242" in out
    assert rconn.smembers(keys.workers_key(PREFIX, MODEL)) == {b"host-7"}


def test_status_without_stream_says_so(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # A model with a live worker and no request yet is reported in full, exit status 0
    register(rconn, "host-7")
    assert main(["status", "--model", MODEL, "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "no requests stream yet" in out
    assert "Dead letters redbatch:{demo}:dead: 0" in out
    assert "Workers: 1 live" in out


def test_status_of_a_model_redis_does_not_hold_exits_1(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--model", MODEL, "--redis-url", redis_url]) == 1
    out = capsys.readouterr().out
    assert out.startswith("model 'demo' not found under prefix 'redbatch'")
    assert "models here: none" in out
    assert "no requests stream yet" not in out


def test_status_json_parses(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    stream = keys.request_stream(PREFIX, MODEL)
    rconn.xadd(stream, {"rid": "r1", "body": b"\x80"})
    register(rconn, "host-7")

    assert main(["--redis-url", redis_url, "status", "--model", MODEL, "--json"]) == 0

    doc = json.loads(capsys.readouterr().out)
    assert doc["requests"]["backlog"] == 1
    assert doc["requests"]["group"] is None
    assert doc["dead"]["count"] == 0
    assert [w["name"] for w in doc["workers"]] == ["host-7"]
    assert doc["workers"][0]["record"]["batching"]["max_batch_size"] == 32


def test_status_never_reports_more_waiting_than_the_stream_holds(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a group whose lag Redis still counts from entries no longer in the stream (as
    # after an AOF replay; here: trimmed)
    stream = keys.request_stream(PREFIX, MODEL)
    for i in range(5):
        rconn.xadd(stream, {"rid": f"r{i}", "body": b"\x80"})
    rconn.xgroup_create(stream, keys.CONSUMER_GROUP, id="0")
    rconn.execute_command("XGROUP", "SETID", stream, keys.CONSUMER_GROUP, "0", "ENTRIESREAD", 0)
    rconn.xtrim(stream, maxlen=2, approximate=False)
    assert rconn.xinfo_groups(stream)[0]["lag"] == 5

    assert main(["--redis-url", redis_url, "status", "--model", MODEL, "--json"]) == 0

    doc = json.loads(capsys.readouterr().out)
    assert doc["requests"]["backlog"] == 2
    assert doc["requests"]["group"]["lag"] == 2


# ---------------------------------------------------------------------------------------------
# help and connection failures


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["status", "--help"]])
def test_help_describes_each_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "examples:" in out
    assert "usage: redbatch" in out


def test_run_help_documents_every_option_and_input_kind(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from producer.cli import run as runcmd

    parser = argparse.ArgumentParser()
    runcmd.add_arguments(parser)
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]

    assert main(["run", "--help"]) == 0

    out = capsys.readouterr().out
    for action in options:
        assert action.help, f"{action.option_strings[0]} has no help"
        assert action.option_strings[0] in out
    for kind in (".npy", ".txt", ".jsonl", ".parquet", ".arrow", "glob", "Y.parquet"):
        assert kind in out
    assert "pip install 'redbatch[parquet]'" in out
    assert "bounded memory" in out


def test_python_dash_m_producer_is_the_same_command_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "producer", "status", "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0
    assert "usage: redbatch status" in done.stdout


@pytest.mark.parametrize("command", ["status", "run"])
def test_unreachable_redis_exits_2_with_one_line_without_password(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    np.save(tmp_path / "x.npy", make_inputs(4, []))
    extra = ["--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npz")]
    argv = ["--redis-url", url, "--retry-s", "0.2", command, "--model", MODEL]
    argv += extra if command == "run" else []

    code = main(argv)

    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert "127.0.0.1" in lines[0]
    assert "hunter2" not in captured.err + captured.out


def test_outputs_named_like_savez_arguments_are_written(tmp_path: Path) -> None:
    path = tmp_path / "y.npz"
    outputs = {"file": np.arange(3), "allow_pickle": np.ones((3, 2), np.float32)}
    write_outputs(path, outputs)
    with np.load(path) as got:
        assert sorted(got.files) == ["allow_pickle", "file"]
        np.testing.assert_array_equal(got["file"], outputs["file"])
        np.testing.assert_array_equal(got["allow_pickle"], outputs["allow_pickle"])


def test_written_files_get_the_umask_permissions_not_the_temporary_files(tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        write_outputs(tmp_path / "y.npz", {"y": np.arange(3)})
        write_errors(tmp_path / "e.jsonl", [])
    finally:
        os.umask(previous)
    assert (tmp_path / "y.npz").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "e.jsonl").stat().st_mode & 0o777 == 0o640


class TwoVersionsClient:
    """map() where the second answer comes from a model version with another output set."""

    def map(self, arrays: dict[str, np.ndarray], **_: object) -> Iterator[Chunk]:
        for i, outputs in enumerate([{"y": np.ones((1, 2))}, {"z": np.ones((1, 2))}]):
            result = Result(
                rid=f"r{i}", ok=True, outputs=outputs, error=None, meta=None,
                model=ModelRef(MODEL, str(i + 1), SHA), worker="w", batch_rows=1,
                timings_ms={"queued": 1.0, "inference": 1.0},
            )  # fmt: skip
            yield Chunk(i, i + 1, f"r{i}", outputs, None, result, 1.0)


def test_answer_with_other_outputs_is_a_failure_not_a_gap() -> None:
    summary = run_job(TwoVersionsClient(), {"x": np.zeros((2, 1))})
    assert [(f.start, f.code) for f in summary.failures] == [(1, "OUTPUT_MISMATCH")]
    assert "earlier rows had ['y']" in summary.failures[0].message
    assert np.isnan(summary.outputs["y"][1]).all()


def test_both_commands_say_their_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import metadata

    from worker.cli import main as worker_main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"redbatch {metadata.version('redbatch')}"
    with pytest.raises(SystemExit) as info:
        worker_main(["--version"])  # no --config needed to ask
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"redbatch-worker {metadata.version('redbatch')}"


def test_rewriting_an_output_keeps_its_permissions(tmp_path: Path) -> None:
    path = tmp_path / "y.npz"
    write_outputs(path, {"y": np.arange(3)})
    path.chmod(0o600)  # the user made it private
    write_outputs(path, {"y": np.arange(4)})
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_ctrl_c_while_results_are_written_is_held_and_a_second_goes_through() -> None:
    from producer.cli.run import _sigint_deferred

    with _sigint_deferred() as held:
        os.kill(os.getpid(), signals.SIGINT)
        assert held == [signals.SIGINT]  # held, not raised
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signals.SIGINT)
    assert signals.getsignal(signals.SIGINT) is signals.default_int_handler


def test_a_ctrl_c_after_the_job_still_writes_everything(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    # Given a job whose every row came back, and a Ctrl-C while its progress bar closes
    np.save(tmp_path / "x.npy", np.arange(2, dtype=np.float32).reshape(2, 1))
    client = ScriptedClient([(1, 10.0, None), (1, 10.0, None)])
    monkeypatch.setattr(
        "producer.client.blocking.Client.map", lambda _self, arrays, **kw: client.map(arrays)
    )

    class Bar:
        def update(self, _rows: int) -> None: ...

        def close(self) -> None:
            raise KeyboardInterrupt

    monkeypatch.setattr("producer.cli.run._progress_bar", lambda *_a, **_kw: Bar())
    out = tmp_path / "y.npz"
    argv = ["--redis-url", redis_url, "run", "--model", MODEL, "--input", str(tmp_path / "x.npy")]
    argv.append("--wait-for-worker")  # no worker: map() is a stand-in, or none is meant

    assert main([*argv, "--input-name", "x", "--output", str(out)]) == 130

    with np.load(out) as written:
        np.testing.assert_array_equal(written["y"], [[0.0], [2.0]])
    assert "interrupted; the rows answered so far are written" in capsys.readouterr().err


def test_status_that_cannot_reach_redis_names_its_url_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"

    code = main(["--redis-url", url, "--retry-s", "0", "status", "--model", MODEL])

    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(
        f"redbatch: error: Could not talk to Redis at {url} (retry_s=0, not retried): "
        "ConnectionError: "
    )
    assert err.count("Redis at") == 1
    assert "redbatch status (" not in err


def test_status_refused_a_command_names_the_redis_url(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    rconn.set(keys.workers_key(PREFIX, MODEL), "not a set")

    code = main(["--redis-url", redis_url, "--retry-s", "0", "status", "--model", MODEL])

    err = capsys.readouterr().err
    assert code == 2
    assert re.match(
        r"redbatch: error: Redis at redis://127\.0\.0\.1:\d+/0 rejected a command: WRONGTYPE", err
    )
    assert "redbatch status (" not in err


def test_a_command_without_the_cli_extra_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Given an install without redbatch[cli]: tqdm cannot be found
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tqdm" else real_find_spec(name, *a),
    )
    np.save(tmp_path / "x.npy", np.zeros((2, 16), np.float32))
    # When redbatch run starts, then it exits 2 with one line naming the extra
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    args = ["run", "--model", "demo", "--input", str(tmp_path / "x.npy"), "--output", "y.npz"]
    status = main(["--redis-url", nowhere, *args])
    assert status == 2
    assert "pip install 'redbatch[cli]'" in capsys.readouterr().err
