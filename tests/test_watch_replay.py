"""``redbatch status --watch`` and ``redbatch replay``, against a real Redis and no worker."""

from __future__ import annotations

import argparse
import io
import json
import os
import pty
import re
import select
import signal
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest
import redis

from producer.cli import replay as replaycmd
from producer.cli import status as status_command
from producer.cli.main import main as redbatch_main
from producer.ops import replay, watch, watchstats
from producer.ops.report import format_status
from producer.ops.status import WorkerInfo, gather_status
from producer.ops.textformat import printable
from producer.protocol import codec, keys
from producer.protocol.errors import ConnectionFailed, UsageError
from tools.localredis import free_port
from worker.ops.metrics import Metrics, MetricsServer

MODEL = "demo"
P = keys.DEFAULT_PREFIX
STREAM = keys.request_stream(P, MODEL)
DEAD = keys.dead_key(P, MODEL)
BODY = codec.encode_request({"x": np.ones((1, 2), np.float32)})


def _parser(add: Any) -> argparse.ArgumentParser:
    """A parser like the one producer.cli builds around the command's own options."""
    parser = argparse.ArgumentParser(prog="redbatch")
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", default=P)
    parser.add_argument("--retry-s", type=float, default=0.0)
    if add is status_command.add_watch_arguments:
        parser.add_argument("--model", default=MODEL)
        parser.add_argument("--json", action="store_true")
    add(parser)
    return parser


def _register(
    conn: redis.Redis,
    name: str,
    *,
    version: str = "1",
    requests: int = 0,
    batches: int = 0,
    beat: datetime | None = None,
) -> None:
    beat = beat or datetime.now(UTC)
    record = {
        "name": name,
        "state": "ready",
        "model": {"name": MODEL, "version": version, "sha256": "ab" * 32},
        "runtime": {"providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]},
        "batching": {"max_batch_size": 32, "max_wait_ms": 5},
        "heartbeat_at": beat.isoformat().replace("+00:00", "Z"),
        "served": {"requests": requests, "batches": batches},
    }
    conn.set(keys.worker_key(P, MODEL, name), json.dumps(record), ex=15)
    conn.sadd(keys.workers_key(P, MODEL), name)


def _queue(conn: redis.Redis, waiting: int, held_by: dict[str, int]) -> None:
    """Add entries to the stream; each consumer in ``held_by`` reads (and holds) that many."""
    conn.xgroup_create(STREAM, keys.CONSUMER_GROUP, id="0", mkstream=True)
    for i in range(waiting + sum(held_by.values())):
        conn.xadd(STREAM, {"rid": f"r{i}", "body": BODY})
    for consumer, count in held_by.items():
        conn.xreadgroup(keys.CONSUMER_GROUP, consumer, {STREAM: ">"}, count=count)


def _answer(conn: redis.Redis, consumer: str, count: int) -> None:
    """What a worker does: read, then acknowledge and delete."""
    reply = conn.xreadgroup(keys.CONSUMER_GROUP, consumer, {STREAM: ">"}, count=count)
    ids = [entry_id for entry_id, _ in reply[0][1]]
    conn.xack(STREAM, keys.CONSUMER_GROUP, *ids)
    conn.xdel(STREAM, *ids)


# ---------------------------------------------------------------------------------------------
# watch


def test_one_refresh_shows_backlog_dead_letters_and_workers(
    redis_url: str, rconn: redis.Redis
) -> None:
    # Given 5 waiting and 2 held entries, a dead letter and a live worker of version 2
    _queue(rconn, waiting=5, held_by={"gpu-0": 2})
    rconn.xadd(DEAD, {"rid": "bad id", "body": BODY, "reason": "rid breaks the pattern"})
    _register(rconn, "gpu-0", version="2", requests=40, batches=4)
    out = io.StringIO()

    # When one frame is drawn
    args = _parser(status_command.add_watch_arguments).parse_args(
        ["--redis-url", redis_url, "--watch", "--iterations", "1"]
    )
    assert status_command.run_watch(args, out=out) == 0

    # Then it names the queue, the dead letter and the worker, without escape codes
    text = out.getvalue()
    assert "\x1b" not in text
    assert "backlog 7 (waiting 5, held 2)" in text
    assert "in and out per second from the next refresh on" in text
    assert "dead     1 dead letter\n" in text
    assert "rid bad id: rid breaks the pattern" in text
    assert "not in Redis: pass --metrics-url" in text
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("gpu-0"))
    assert lines[at].split() == ["gpu-0", "2", "-", "10.0", "40"]  # held, req/s, per batch
    assert lines[at + 1].startswith("    ready, version 2 (sha256 abababababab), CUDA,CPU, ")


def test_second_refresh_shows_requests_in_and_out_per_second(
    redis_url: str, rconn: redis.Redis
) -> None:
    _queue(rconn, waiting=4, held_by={})
    clock = iter([100.0, 102.0])
    first = watch.take_snapshot(rconn, MODEL, clock=lambda: next(clock))
    # Over 2 s: 10 requests arrive, a worker answers 6 and holds 2 more
    for i in range(10):
        rconn.xadd(STREAM, {"rid": f"n{i}", "body": BODY})
    _answer(rconn, "w", 6)
    rconn.xreadgroup(keys.CONSUMER_GROUP, "w", {STREAM: ">"}, count=2)
    second = watch.take_snapshot(rconn, MODEL, clock=lambda: next(clock))

    frame = watch.render(first, second)
    assert "backlog 8 (waiting 6, held 2)" in frame
    assert "in 5/s, out 3/s, backlog +2/s (last 2.0 s)" in frame


def test_a_shrinking_backlog_shows_when_it_drains(redis_url: str, rconn: redis.Redis) -> None:
    _queue(rconn, waiting=30, held_by={})
    clock = iter([0.0, 1.0])
    first = watch.take_snapshot(rconn, MODEL, clock=lambda: next(clock))
    _answer(rconn, "w", 10)
    frame = watch.render(first, watch.take_snapshot(rconn, MODEL, clock=lambda: next(clock)))
    assert "out 10/s, backlog -10/s (last 1.0 s)" in frame
    assert "         drains in about 2.0 s at this rate" in frame.splitlines()


def test_worker_rates_are_taken_between_heartbeats() -> None:
    rates = watch.WorkerRates()
    start = datetime(2026, 1, 1, tzinfo=UTC)

    def worker(requests: int, batches: int, after_s: float) -> Any:
        record = {
            "served": {"requests": requests, "batches": batches},
            "heartbeat_at": (start + timedelta(seconds=after_s)).isoformat(),
        }
        return WorkerInfo("w", ttl_s=15, record=record)

    rates.update([worker(100, 10, 0)])
    assert rates.rates == {}
    rates.update([worker(100, 10, 0)])  # same heartbeat: nothing new to say
    assert rates.rates == {}
    rates.update([worker(600, 30, 5)])
    assert rates.rates == {"w": (100.0, 25.0)}
    rates.update([])  # the worker is gone
    assert rates.rates == {}


def test_metrics_urls_add_worker_side_percentiles_and_batch_rows(
    redis_url: str, rconn: redis.Redis
) -> None:
    # Given one worker's metrics with 100 answered requests in 4 runs of 25 rows
    metrics = Metrics()
    metrics.batch_done(
        codes=["OK"] * 100,
        queued_s=[0.004] * 50 + [0.02] * 50,
        decode_s=[0.0001] * 100,
        runs=[(25, 0.003)] * 4,
        write_s=0.001,
    )
    server = MetricsServer(metrics, lambda: True, 0)
    server.start()
    dead_port = free_port()
    try:
        args = _parser(status_command.add_watch_arguments).parse_args(
            [
                "--redis-url",
                redis_url,
                "--watch",
                "--iterations",
                "1",
                "--metrics-url",
                f"http://127.0.0.1:{server.port}/metrics",
                "--metrics-url",
                f"http://127.0.0.1:{dead_port}/metrics",
            ]
        )
        out = io.StringIO()
        assert status_command.run_watch(args, out=out) == 0
    finally:
        server.close()
    text = out.getvalue()
    assert "worker-side since the workers started, 1 of 2 workers scraped" in text
    assert f"http://127.0.0.1:{dead_port}/metrics:" in text  # the error, on its own line
    assert "queue wait p50 5.0 ms p99 24.7 ms" in text
    assert "mean 25.0 rows per model run, 4 runs, 100 requests answered" in text


def test_a_falling_gauge_is_not_a_worker_restart() -> None:
    # The backlog gauge falls all the time; only a counter or histogram falling means the
    # worker restarted (and only then are lifetime totals shown instead of the window's)
    def snap(t: float, backlog: float, served: float) -> watchstats.Snapshot:
        samples = {
            ("redbatch_backlog", ()): backlog,
            ("redbatch_requests_total", (("code", "OK"),)): served,
        }
        scrape = watchstats.Scrape("http://w:9100/metrics", samples)
        return watchstats.Snapshot(t, None, None, None, (scrape,))  # type: ignore[arg-type]

    label, window = watchstats.metrics_window(snap(0.0, 30, 100), snap(1.0, 2, 160))
    assert label == "last 1.0 s"
    assert window[("redbatch_requests_total", (("code", "OK"),))] == 60
    label, _ = watchstats.metrics_window(snap(0.0, 30, 100), snap(1.0, 2, 5))
    assert label == "since the workers started"


def test_quantiles_interpolate_like_histogram_quantile() -> None:
    buckets = [(0.001, 0.0), (0.005, 50.0), (0.01, 100.0), (float("inf"), 100.0)]
    assert watchstats.quantile(buckets, 0.5) == "5.0 ms"
    assert watchstats.quantile(buckets, 0.99) == "9.9 ms"
    assert watchstats.quantile([(0.01, 0.0), (float("inf"), 4.0)], 0.5) == "> 10.0 ms"
    assert watchstats.quantile([(float("inf"), 0.0)], 0.5) is None


def test_watch_refuses_json(redis_url: str) -> None:
    args = _parser(status_command.add_watch_arguments).parse_args(
        ["--redis-url", redis_url, "--watch", "--json"]
    )
    with pytest.raises(UsageError, match="--json"):
        status_command.run_watch(args, out=io.StringIO())


@pytest.mark.parametrize(
    "flags",
    [["--iterations", "2"], ["--metrics-url", "http://h:9100/metrics"], ["--interval-s", "1"]],
)
def test_watch_options_without_watch_are_a_usage_error(
    redis_url: str, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # They would be ignored: a script that forgot --watch would print one frame and exit 0
    assert redbatch_main(["--redis-url", redis_url, "status", "--model", MODEL, *flags]) == 2
    assert f"{flags[0]} go with --watch" in capsys.readouterr().err


def test_watch_fails_at_once_when_redis_cannot_be_reached() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    args = _parser(status_command.add_watch_arguments).parse_args(["--redis-url", url, "--watch"])
    with pytest.raises(ConnectionFailed, match=r"Could not talk to Redis at redis://127\.0\.0\.1"):
        status_command.run_watch(args, out=io.StringIO())


_CHILD = """
import argparse, sys
from producer.cli import status as status_command
parser = argparse.ArgumentParser()
parser.add_argument("--redis-url")
parser.add_argument("--prefix", default="redbatch")
parser.add_argument("--model", default="demo")
status_command.add_watch_arguments(parser)
sys.exit(status_command.run_watch(parser.parse_args(sys.argv[1:])))
"""


def _read_until(fd: int, marker: bytes, deadline: float) -> bytes:
    seen = b""
    while marker not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
    return seen


@pytest.fixture
def terminal_child(redis_url: str, rconn: redis.Redis) -> Iterator[tuple[int, int]]:
    """``redbatch status --watch`` in a pseudo-terminal: (pid, master fd)."""
    _queue(rconn, waiting=3, held_by={})
    argv = ["--redis-url", redis_url, "--watch", "--interval-s", "0.2"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session leader whose terminal is the pty
        os.execv(sys.executable, [sys.executable, "-c", _CHILD, *argv])
    try:
        yield pid, fd
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)


def test_ctrl_c_in_a_terminal_ends_the_watch_with_status_0(
    terminal_child: tuple[int, int],
) -> None:
    pid, fd = terminal_child
    deadline = time.monotonic() + 15
    # Given two frames drawn, each after clearing the screen
    shown = _read_until(fd, b"backlog 3", deadline)
    shown += _read_until(fd, b"(last ", deadline)
    assert shown.count(b"\x1b[H\x1b[2J") >= 2
    assert b"backlog 3 (waiting 3, held 0)" in shown

    # When Ctrl-C is typed, the terminal sends SIGINT to the watch
    os.write(fd, b"\x03")
    _read_until(fd, b"\0never", deadline)

    # Then it exits 0
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status)
    assert os.WEXITSTATUS(status) == 0


# ---------------------------------------------------------------------------------------------
# replay


def _replay(redis_url: str, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    args = _parser(replaycmd.add_arguments).parse_args(
        ["--redis-url", redis_url, "--model", MODEL, "--from-dead", "--json", *argv]
    )
    code = replaycmd.run_command(args)
    return code, json.loads(capsys.readouterr().out)


def _requests(conn: redis.Redis) -> list[tuple[str, dict[bytes, bytes]]]:
    return [(eid.decode(), fields) for eid, fields in conn.xrange(STREAM, "-", "+")]


def _reply(rid: str, *, ok: bool) -> bytes:
    model = codec.ModelRef(MODEL, "1", "ab" * 32)
    if ok:
        return codec.encode_reply(
            codec.Reply(
                rid,
                True,
                model,
                "w",
                {"queued": 1.0, "inference": 1.0},
                outputs={"y": np.zeros((1, 2), np.float32)},
                batch_rows=1,
            )
        )
    error = codec.ErrorInfo("POISONED", "delivered 3 times without an answer", False)
    return codec.encode_reply(
        codec.Reply(rid, False, model, "w", {"queued": 1.0, "inference": 0.0}, error=error)
    )


def test_replay_with_new_ids_sends_every_dead_letter_with_a_body(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a poisoned request and one whose rid could not be used
    first = rconn.xadd(DEAD, {"rid": "req-1", "body": BODY, "reason": "POISONED"}).decode()
    second = rconn.xadd(DEAD, {"rid": "bad id!", "body": BODY, "reason": "bad rid"}).decode()

    code, report = _replay(redis_url, capsys)

    # Then both are requests again, with fresh ids and exactly the protocol's two fields
    assert code == 0
    assert report["ids"] == "new"
    assert [(r["dead_entry"], r["old_rid"]) for r in report["resent"]] == [
        (first, "req-1"),
        (second, "bad id!"),
    ]
    sent = _requests(rconn)
    assert [eid for eid, _ in sent] == [r["entry_id"] for r in report["resent"]]
    for (_, fields), resent in zip(sent, report["resent"], strict=True):
        assert list(fields) == [b"rid", b"body"]
        assert fields[b"rid"].decode() == resent["rid"]
        assert fields[b"body"] == BODY
        assert len(resent["rid"]) == 32
        assert keys.is_valid_rid(resent["rid"])
    assert rconn.xlen(DEAD) == 2  # kept without --delete
    assert report["deleted"] == 0


def test_replay_with_same_ids_removes_the_old_error_reply(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given dead letters: poisoned (its POISONED reply exists), one already answered ok,
    # one with a broken rid, one without a body
    poisoned = rconn.xadd(DEAD, {"rid": "r1", "body": BODY, "reason": "POISONED"}).decode()
    rconn.rpush(keys.reply_key(P, MODEL, "r1"), _reply("r1", ok=False))
    answered = rconn.xadd(DEAD, {"rid": "r2", "body": BODY, "reason": "POISONED"}).decode()
    rconn.rpush(keys.reply_key(P, MODEL, "r2"), _reply("r2", ok=True))
    broken = rconn.xadd(DEAD, {"rid": "no good", "body": BODY, "reason": "bad rid"}).decode()
    bodiless = rconn.xadd(DEAD, {"rid": "r4", "reason": "no body"}).decode()

    code, report = _replay(redis_url, capsys, "--same-ids", "--delete")

    # Then only r1 is sent again, under its own id, and its old reply is gone
    assert code == 1  # some were skipped
    assert [(r["rid"], r["reply_removed"]) for r in report["resent"]] == [("r1", True)]
    ((entry_id, fields),) = _requests(rconn)
    assert entry_id == report["resent"][0]["entry_id"]
    assert fields == {b"rid": b"r1", b"body": BODY}
    assert rconn.exists(keys.reply_key(P, MODEL, "r1")) == 0
    assert codec.decode_reply(rconn.lindex(keys.reply_key(P, MODEL, "r2"), 0)).ok

    skipped = {s["dead_entry"]: s["reason"] for s in report["skipped"]}
    assert set(skipped) == {answered, broken, bodiless}
    assert "already answered ok" in skipped[answered]
    assert "--new-ids" in skipped[broken]
    assert "no body" in skipped[bodiless]

    # Only the dead letter that was re-sent is deleted
    assert report["deleted"] == 1
    left = [eid.decode() for eid, _ in rconn.xrange(DEAD, "-", "+")]
    assert left == [answered, broken, bodiless]
    assert poisoned not in left


def test_replay_limit_takes_the_oldest_dead_letters_across_pages(
    redis_url: str,
    rconn: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(replay, "PAGE_SIZE", 2)
    dead = [rconn.xadd(DEAD, {"rid": f"r{i}", "body": BODY}).decode() for i in range(5)]

    code, report = _replay(redis_url, capsys, "--limit", "3", "--delete")

    assert code == 0
    assert [r["dead_entry"] for r in report["resent"]] == dead[:3]
    assert [r["old_rid"] for r in report["resent"]] == ["r0", "r1", "r2"]
    assert [eid.decode() for eid, _ in rconn.xrange(DEAD, "-", "+")] == dead[3:]
    assert rconn.xlen(STREAM) == 3


def test_replay_dry_run_changes_nothing(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    rconn.xadd(DEAD, {"rid": "r1", "body": BODY})
    rconn.rpush(keys.reply_key(P, MODEL, "r1"), _reply("r1", ok=False))

    code, report = _replay(redis_url, capsys, "--same-ids", "--delete", "--dry-run")

    assert code == 0
    assert report["dry_run"] is True
    assert [(r["rid"], r["entry_id"], r["reply_removed"]) for r in report["resent"]] == [
        ("r1", None, True)
    ]
    assert rconn.exists(STREAM) == 0
    assert rconn.xlen(DEAD) == 1
    assert rconn.exists(keys.reply_key(P, MODEL, "r1")) == 1


def test_replay_table_reports_mapping_and_skips(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    rconn.xadd(DEAD, {"rid": "r1", "body": BODY})
    rconn.xadd(DEAD, {"reason": "no rid, no body"})
    args = _parser(replaycmd.add_arguments).parse_args(
        ["--redis-url", redis_url, "--model", MODEL, "--from-dead"]
    )
    assert replaycmd.run_command(args) == 1
    text = capsys.readouterr().out
    assert "examined 2 dead letters: re-sent 1, skipped 1" in text
    assert "OLD RID" in text
    assert "r1" in text
    assert "no body field: nothing to send" in text


def test_replay_of_an_empty_dead_stream_says_so(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _parser(replaycmd.add_arguments).parse_args(
        ["--redis-url", redis_url, "--model", MODEL, "--from-dead"]
    )
    assert replaycmd.run_command(args) == 0
    assert "no dead letters" in capsys.readouterr().out


def test_replay_needs_from_dead() -> None:
    with pytest.raises(SystemExit):
        _parser(replaycmd.add_arguments).parse_args(["--redis-url", "redis://x", "--model", MODEL])


# ---------------------------------------------------------------------------------------------
# What others wrote to Redis, printed safely


# A request id a producer chose: an ANSI colour, a line break and a byte that is not UTF-8.
HOSTILE_RID = b"x\x1b[31mRED\nline2\xff"
SHOWN_RID = r"x\x1b[31mRED\nline2\xff"


def _hostile(conn: redis.Redis) -> None:
    """A dead letter, a consumer and a worker record whose text would drive a terminal."""
    conn.xadd(DEAD, {"rid": HOSTILE_RID, "body": BODY, "reason": "died\x1b[2J"})
    conn.xgroup_create(STREAM, keys.CONSUMER_GROUP, id="0", mkstream=True)
    conn.xadd(STREAM, {"rid": HOSTILE_RID, "body": BODY})
    conn.xreadgroup(keys.CONSUMER_GROUP, "gpu\x1b[5m\n0", {STREAM: ">"}, count=1)
    record = {
        "state": "ready\x07",
        "host": "box\r\nfake: row",
        "pid": 7,
        "error": "bad\x1b]0;t\x07",
    }
    conn.set(keys.worker_key(P, MODEL, "w1"), json.dumps(record), ex=15)
    conn.sadd(keys.workers_key(P, MODEL), "w1")


def _assert_escaped(text: str) -> None:
    assert not any(c in text for c in "\x1b\x07\r"), text
    assert "\ufffd" not in text  # the byte that is not UTF-8 is shown, not replaced
    assert not any(line.lstrip().startswith(("line2", "fake: row")) for line in text.splitlines())
    assert SHOWN_RID in text


def test_printable_passes_text_and_escapes_what_a_terminal_acts_on() -> None:
    assert printable("r-1 café ✓ a\\b") == "r-1 café ✓ a\\b"
    assert printable("x\x1b[31m\n\t\x00\u202e") == r"x\x1b[31m\n\t\x00\u202e"


def test_status_text_escapes_rids_reasons_consumers_and_records(
    redis_url: str, rconn: redis.Redis
) -> None:
    _hostile(rconn)

    text = format_status(gather_status(rconn, MODEL))

    _assert_escaped(text)
    assert r"died\x1b[2J" in text
    assert r"gpu\x1b[5m\n0" in text
    assert r"ready\x07" in text
    assert r"box\r\nfake: row:7" in text
    assert r"bad\x1b]0;t\x07" in text
    # The dead letters' table stays aligned: the escaped rid is measured as it is printed, and
    # the reason, escaped, goes on the line under its row.
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split() == ["ENTRY", "AGE", "RID"])
    header, row = lines[at], lines[at + 1]
    assert row.index(SHOWN_RID) == header.index("RID")
    assert lines[at + 2] == r"    died\x1b[2J"


def test_watch_frame_escapes_rids_reasons_and_records(redis_url: str, rconn: redis.Redis) -> None:
    _hostile(rconn)
    out = io.StringIO()
    args = _parser(status_command.add_watch_arguments).parse_args(
        ["--redis-url", redis_url, "--watch", "--iterations", "1"]
    )

    assert status_command.run_watch(args, out=out) == 0

    text = out.getvalue()
    _assert_escaped(text)
    assert f"rid {SHOWN_RID}: died\\x1b[2J" in text
    assert r"ready\x07" in text


def test_replay_report_escapes_old_rids(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    rconn.xadd(DEAD, {"rid": HOSTILE_RID, "body": BODY})
    args = _parser(replaycmd.add_arguments).parse_args(
        ["--redis-url", redis_url, "--model", MODEL, "--from-dead", "--dry-run"]
    )

    assert replaycmd.run_command(args) == 0

    _assert_escaped(capsys.readouterr().out)


def test_the_first_watch_refresh_retries_for_retry_s() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    args = _parser(status_command.add_watch_arguments).parse_args(
        ["--redis-url", url, "--retry-s", "0.2", "--watch"]
    )

    with pytest.raises(ConnectionFailed) as failed:
        status_command.run_watch(args, out=io.StringIO())

    # It tried for the 0.2 s (a first contact tries at most 3 s unless --retry-s is given)
    message = str(failed.value)
    assert re.match(
        rf"Could not talk to Redis at {re.escape(url)}: nothing answered in 0\.\d s ", message
    )
    assert "not retried" not in message
    assert message.count("Redis at") == 1


# ---------------------------------------------------------------------------------------------
# A model with three shards (P:{M}:shards), on one Redis

TAGS = ("demo", "demo~1", "demo~2")


def _rows(text: str, first: str, indent: str = "  ") -> dict[str, list[str]]:
    """The table that follows the line starting with ``first``, by its first cell."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first)) + 1
    rows = {}
    for line in lines[start:]:
        if not line.startswith(indent):
            break
        rows[line.split()[0]] = line.split()
    return rows


def _three_shards(conn: redis.Redis, waiting: tuple[int, int, int]) -> None:
    """Three shards, each with a group and ``waiting`` entries; the last one retiring."""
    conn.rpush(keys.shards_key(P, MODEL), *TAGS[:2])
    conn.sadd(keys.retiring_key(P, MODEL), TAGS[2])
    for tag, count in zip(TAGS, waiting, strict=True):
        stream = keys.request_stream(P, tag)
        conn.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
        for i in range(count):
            conn.xadd(stream, {"rid": f"{tag[-1]}{i}", "body": BODY})


def test_status_of_three_shards_shows_each_and_the_total(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given 1, 2 and 3 waiting, the second shard's worker holding one, a dead letter on the third
    _three_shards(rconn, (1, 2, 3))
    rconn.xreadgroup(keys.CONSUMER_GROUP, "gpu-0", {keys.request_stream(P, "demo~1"): ">"}, count=1)
    rconn.xadd(keys.dead_key(P, "demo~2"), {"rid": "d1", "body": BODY, "reason": "POISONED"})

    assert redbatch_main(["--redis-url", redis_url, "status", "--model", MODEL, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert redbatch_main(["--redis-url", redis_url, "status", "--model", MODEL]) == 0
    text = capsys.readouterr().out

    # Then JSON has each shard, and the totals where they always were
    assert [(s["tag"], s["state"], s["requests"]["backlog"]) for s in doc["shards"]] == [
        ("demo", "send", 1),
        ("demo~1", "send", 2),
        ("demo~2", "retiring", 3),
    ]
    assert doc["requests"]["backlog"] == 6
    assert doc["requests"]["group"]["pending"] == 1
    assert doc["requests"]["group"]["consumers"] == [
        {
            "name": "gpu-0",
            "pending": 1,
            "idle_ms": doc["requests"]["group"]["consumers"][0]["idle_ms"],
        }
    ]
    assert doc["dead"]["count"] == 1
    assert doc["dead"]["recent"][0]["shard"] == "demo~2"
    # And the text has a row per shard and a total
    assert "Shards: 3 (2 taking requests, 1 retiring" in text
    rows = _rows(text, "Shards:")
    assert rows["demo~1"][:5] == ["demo~1", "send", "2", "1", "1"]
    assert rows["demo~2"][:6] == ["demo~2", "retiring", "3", "0", "3", "1"]
    assert rows["total"][:5] == ["total", "6", "1", "5", "1"]
    assert "Dead letters: 1 over all shards" in text


def test_watch_of_three_shards_shows_each_shards_flow(rconn: redis.Redis) -> None:
    _three_shards(rconn, (0, 0, 0))
    clock = iter([10.0, 12.0])
    first = watch.take_snapshot(rconn, MODEL, clock=lambda: next(clock))
    # Over 2 s: 4 requests arrive on the first shard, 2 on the second; 2 are answered there
    for tag, count in (("demo", 4), ("demo~1", 2)):
        for i in range(count):
            rconn.xadd(keys.request_stream(P, tag), {"rid": f"n{i}", "body": BODY})
    stream = keys.request_stream(P, "demo~1")
    reply = rconn.xreadgroup(keys.CONSUMER_GROUP, "w", {stream: ">"}, count=2)
    ids = [entry_id for entry_id, _ in reply[0][1]]
    rconn.xack(stream, keys.CONSUMER_GROUP, *ids)
    rconn.xdel(stream, *ids)
    second = watch.take_snapshot(rconn, MODEL, clock=lambda: next(clock))

    frame = watch.render(first, second)

    assert "backlog 4 (waiting 4, held 0)" in frame
    assert "in 3/s, out 1/s" in frame  # summed over the shards
    assert "shards   3, 1 retiring (*: no longer sent to, served until drained)" in frame
    rows = _rows(frame, "shards ")
    assert rows["SHARD"] == ["SHARD", "BACKLOG", "HELD", "DEAD", "IN/S", "OUT/S"]
    assert rows["demo"] == ["demo", "4", "0", "0", "2", "0"]
    assert rows["demo~1"] == ["demo~1", "0", "0", "0", "1", "1"]
    assert rows["demo~2*"] == ["demo~2*", "0", "0", "0", "0", "0"]  # retiring


def test_replay_of_three_shards_sends_each_back_to_its_own_shard(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a poisoned request on each shard, its POISONED reply in the shard's reply key
    _three_shards(rconn, (0, 0, 0))
    for i, tag in enumerate(TAGS):
        rconn.xadd(keys.dead_key(P, tag), {"rid": f"r{i}", "body": BODY, "reason": "POISONED"})
        rconn.rpush(keys.reply_key(P, tag, f"r{i}"), _reply(f"r{i}", ok=False))

    code, report = _replay(redis_url, capsys, "--same-ids", "--delete")

    # Then each is back on its own shard's stream, its old reply removed there
    assert code == 0
    assert [(r["shard"], r["rid"], r["reply_removed"]) for r in report["resent"]] == [
        ("demo", "r0", True),
        ("demo~1", "r1", True),
        ("demo~2", "r2", True),  # retiring: workers still serve it
    ]
    for i, tag in enumerate(TAGS):
        ((_, fields),) = rconn.xrange(keys.request_stream(P, tag))
        assert fields[b"rid"] == f"r{i}".encode()
        assert rconn.exists(keys.reply_key(P, tag, f"r{i}")) == 0
        assert rconn.xlen(keys.dead_key(P, tag)) == 0
    assert [(s["tag"], s["examined"], s["resent"], s["deleted"]) for s in report["shards"]] == [
        ("demo", 1, 1, 1),
        ("demo~1", 1, 1, 1),
        ("demo~2", 1, 1, 1),
    ]
    assert report["deleted"] == 3


def test_replay_limit_counts_over_all_shards_and_the_table_names_them(
    redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    _three_shards(rconn, (0, 0, 0))
    for tag in TAGS:
        for i in range(2):
            rconn.xadd(keys.dead_key(P, tag), {"rid": f"r{i}", "body": BODY})
    args = _parser(replaycmd.add_arguments).parse_args(
        ["--redis-url", redis_url, "--model", MODEL, "--from-dead", "--limit", "3"]
    )

    assert replaycmd.run_command(args) == 0

    text = capsys.readouterr().out
    assert "replay P:{T}:dead -> P:{T}:requests of 3 shards (new request ids)" in text
    assert "examined 3 dead letters: re-sent 3, skipped 0" in text
    rows = _rows(text, "replay ")
    assert rows["demo"] == ["demo", "2", "2", "0"]
    assert rows["demo~1"] == ["demo~1", "1", "1", "0"]
    assert rows["demo~2"] == ["demo~2", "0", "0", "0"]  # the limit was reached before it
    assert rows["total"] == ["total", "3", "3", "0"]
    assert [rconn.xlen(keys.request_stream(P, tag)) for tag in TAGS] == [2, 1, 0]
