"""The operator commands' fit and finish (issue 27): a ``status --watch`` frame fits 80 columns,
its verdict says ``idle`` when nothing was served, the read commands fail within seconds on a
Redis that never answers, counted nouns agree with their numbers, and ``--help`` says what
``run`` reads."""

from __future__ import annotations

import io
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest
import redis

from producer.cli import status as status_command
from producer.cli.main import build_parser, main
from producer.cli.replay import format_report
from producer.cli.shards import format_placement, format_retirement
from producer.ops import stages, watch
from producer.ops.damage import DamageNote, damage_lines
from producer.ops.replay import ReplayReport, Resent
from producer.ops.report import format_status
from producer.ops.shards import Placement, Retirement
from producer.ops.status import (
    ConsumerInfo,
    DeadLetter,
    DeadLetters,
    GroupInfo,
    ModelStatus,
    RequestsInfo,
    ShardStatus,
    WorkerInfo,
)
from producer.ops.watchstats import Counters, Scrape, Snapshot, StageWatch, WorkerRates
from producer.ops.watchworkers import RATE_PENDING, STAGE_WINDOW, WORKER_WINDOW, verdict_now
from producer.ops.words import clip, count, fit
from producer.protocol import codec, keys
from producer.redisio import firstcontact
from producer.redisio.memory import MemoryReading
from tools.localredis import LocalRedis, free_port

P = keys.DEFAULT_PREFIX
MODEL = "sentence-embeddings-large"
TAGS = (MODEL, f"{MODEL}~k3f9", f"{MODEL}~p0q1")
PODS = ("redbatch-worker-7d9f8c6b5-x2k4p", "redbatch-worker-7d9f8c6b5-z9m1c")
BODY = codec.encode_request({"x": np.ones((1, 2), np.float32)})


# ---------------------------------------------------------------------------------------------
# A watch frame fits 80 columns


def _stage(requests: int, busy_s: float, cpu_s: float) -> dict[str, Any]:
    return {"requests": requests, "busy_s": busy_s, "cpu_s": cpu_s}


def _stages(requests: int, pre_busy: float, model_busy: float, cpu_s: float, up: float) -> Any:
    return {
        "threads": 8,
        "cpu_s": cpu_s,
        "uptime_s": up,
        "preprocess": _stage(requests, pre_busy, pre_busy * 0.8),
        "postprocess": _stage(requests, pre_busy / 100, pre_busy / 120),
        "model": _stage(requests, model_busy, 0.0),
    }


def _big_status(backlog: int, dead: int, now_s: float, beat: datetime, served: int, st: Any) -> Any:
    """A model on three masters with figures in the millions, pods' long names, a long version
    string and reason: what a busy production queue shows."""
    consumers = tuple(ConsumerInfo(n, 2_300, 10) for n in PODS)
    group = GroupInfo("workers", 4_600, backlog - 4_600, "1700000000000-0", consumers)
    reason = "POISONED: delivered 3 times without an answer (max_deliveries 3)"
    newest = DeadLetter("1700000000000-0", "0123456789abcdef0123456789abcdef", reason, 2.1)
    shards = tuple(
        ShardStatus(
            tag,
            "retiring" if i == 2 else "send",
            f"10.0.12.{200 + i}:6379",
            RequestsInfo("k", True, backlog // 3, 754.0, GroupInfo("workers", 1_533, 0, "0-0", ())),
            DeadLetters("d", dead // 3, ()),
        )
        for i, tag in enumerate(TAGS)
    )
    providers = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    workers = tuple(
        WorkerInfo(
            name,
            14,
            {
                "name": name,
                "state": "draining" if i else "ready",
                "model": {"version": "2024-06-01-rc3", "sha256": "ab" * 32},
                "runtime": {"providers": providers},
                "heartbeat_at": beat.isoformat(),
                "served": {"requests": served, "batches": served // 31},
                "stages": st,
            },
        )
        for i, name in enumerate(PODS)
    )
    return ModelStatus(
        MODEL,
        P,
        now_s,
        RequestsInfo("k", True, backlog, 754.0, group),
        DeadLetters("d", dead, (newest,)),
        workers,
        memory=MemoryReading(used_bytes=870_000_000, max_bytes=1 << 30, policy="noeviction"),
        shards=shards,
        cluster=True,
        memory_node="10.0.12.201:6379",
    )


def _scrape(scale: float) -> Scrape:
    samples: dict[Any, float] = {
        (f"redbatch_{m}_seconds_bucket", (("le", le),)): count_ * scale
        for m in ("queue_wait", "decode_validate", "inference", "reply_write")
        for le, count_ in (("0.005", 50.0), ("0.05", 90.0), ("+Inf", 100.0))
    }
    samples[("redbatch_batch_rows_sum", ())] = 31.0 * scale * 100
    samples[("redbatch_batch_rows_count", ())] = scale * 100
    samples[("redbatch_requests_total", ())] = 31.0 * scale * 100
    return Scrape("http://10.0.7.12:9100/metrics", samples)


def _big_frame() -> str:
    start = datetime.now(UTC) - timedelta(seconds=10)
    now = time.time()
    first_st = _stages(100_000, 500.0, 50.0, 100.0, 100.0)
    second_st = _stages(223_450, 577.0, 51.5, 180.0, 110.0)
    a = _big_status(1_234_567, 1_234, now - 2, start, 12_345_678, first_st)
    b = _big_status(1_233_000, 1_237, now, start + timedelta(seconds=10), 12_469_128, second_st)
    gone = Scrape("http://10.0.7.13:9100/metrics", None, "<urlopen error [Errno 111] refused>")

    def counters(added: int, read: int, pending: int) -> dict[str, Counters]:
        return {tag: Counters(added, read, pending) for tag in TAGS}

    first = Snapshot(
        100.0,
        a,
        150_000_000,
        144_000_000,
        (_scrape(1000), gone),
        counters(50_000_000, 48_000_000, 1_500),
    )
    second = Snapshot(
        102.0,
        b,
        150_074_070,
        144_078_000,
        (_scrape(1100), gone),
        counters(50_024_690, 48_026_000, 1_533),
    )
    rates, staged = WorkerRates(), StageWatch()
    for snap in (first, second):
        rates.update(snap.status.workers)
        staged.update(snap.status.workers)
    return watch.render(
        first,
        second,
        rates=rates,
        stage_rates=staged,
        redis_url="rediss://operator@redis-prod.example.internal:6380/0",
        interval_s=2.0,
        problem="Redis unreachable (ConnectionError: Error 111 connecting to "
        "redis-prod.example.internal:6380. Connection refused); showing the last view, retrying",
    )


def test_a_busy_watch_frame_fits_80_columns_and_keeps_its_figures() -> None:
    frame = _big_frame()
    lines = frame.splitlines()

    too_wide = [line for line in lines if len(line) > 80]
    assert too_wide == []
    # Nothing was lost on the way: each figure is still there
    for figure in (
        "backlog 1,233,000 (waiting 1,228,400, held 4,600), oldest 13 min",
        "in 37,035/s, out 38,950/s, backlog -784/s (last 2.0 s)",
        "drains in about 26 min at this rate",
        "1,237 dead letters (+3 since last refresh)",
        "fullest master 10.0.12.201:6379",
        "queue wait p50 5.0 ms p99 > 50.0 ms",
        "mean 31.0 rows per model run",
        "bound by preprocessing",
        "version 2024-06-01-rc3 (sha256 abababababab), Tensorrt,CUDA,CPU,",
    ):
        assert figure in frame, figure
    shard_rows = [line for line in lines if line.startswith("  sentence-e")]
    assert [row.split()[1:] for row in shard_rows] == [
        [f"10.0.12.{200 + i}:6379", "411,000", "1,533", "412", "12,345", "12,984"] for i in range(3)
    ]
    assert shard_rows[2].split()[0].endswith("~p0q1*")  # the retiring shard, cut in the middle
    worker_rows = [line.split() for line in lines if line.startswith("  redbatch-worker-")]
    assert worker_rows[0] == [PODS[0], "2,300", "12,345", "31.0", "12,469,128"]


def test_a_frame_from_redis_with_long_text_fits_80_columns(
    redis_url: str, rconn: redis.Redis
) -> None:
    # Given a dead letter with a long reason and a long unbroken rid, a worker with a long name
    stream = keys.request_stream(P, "demo")
    rconn.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
    rconn.xadd(stream, {"rid": "r1", "body": BODY})
    reason = "INFERENCE_FAILED: " + "the runtime said something long " * 6
    rconn.xadd(keys.dead_key(P, "demo"), {"rid": "r" * 128, "body": BODY, "reason": reason})
    name = "worker-" + "x" * 90
    record = {"name": name, "state": "ready", "model": {"version": "v" * 40}}
    rconn.set(keys.worker_key(P, "demo", name), json.dumps(record), ex=15)
    rconn.sadd(keys.workers_key(P, "demo"), name)
    args = build_parser().parse_args(
        ["--redis-url", redis_url, "status", "--model", "demo", "--watch", "--iterations", "1"]
    )
    out = io.StringIO()

    assert status_command.run_watch(args, out=out) == 0

    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "r" * 60 in out.getvalue()  # folded, not dropped


def test_fit_folds_under_the_label_and_clip_keeps_both_ends() -> None:
    long = "dead     " + "word " * 30
    folded = fit([long, "short", "  " + "x" * 100])
    assert all(len(line) <= 80 for line in folded)
    assert folded[1].startswith("         word")  # under the label column
    assert "short" in folded
    assert folded[-1].startswith("    x")  # an indented line goes on two further in
    assert clip("redbatch-worker-7d9f8c6b5-x2k4p", 20) == "redbatch-..6b5-x2k4p"
    assert len(clip("a" * 50, 20)) == 20


def test_the_watch_says_which_window_each_rate_covers() -> None:
    lines = _big_frame().splitlines()

    # The workers' rates are from their heartbeats, the stages' too, the flow from the refresh
    assert f"workers  2 live; {WORKER_WINDOW}" in lines
    assert f"stages   {STAGE_WINDOW}" in lines
    assert any(line.startswith("flow ") and line.endswith("(last 2.0 s)") for line in lines)
    assert f"  {RATE_PENDING}" not in lines  # every worker has a rate


def test_a_first_watch_frame_says_once_why_worker_rates_are_missing() -> None:
    # Given the first refresh of a watch: no worker has a rate yet
    beat = datetime.now(UTC)
    first = Snapshot(100.0, _big_status(10, 0, time.time(), beat, 5, None), 0, 0)
    rates = WorkerRates()
    rates.update(first.status.workers)

    lines = watch.render(None, first, rates=rates).splitlines()

    rows = [line.split() for line in lines if line.startswith("  redbatch-worker-")]
    assert [row[2] for row in rows] == ["-", "-"]  # REQ/S
    assert lines.count(f"  {RATE_PENDING}") == 1
    assert RATE_PENDING == "REQ/S -: rates after the next heartbeat (a rate needs two, 5 s apart)"


# ---------------------------------------------------------------------------------------------
# The plain report (status --model) fits 80 columns


def _pipeline_worker(worker: WorkerInfo, now: datetime) -> WorkerInfo:
    """``worker`` serving behind a pipeline whose handler declares no outputs, on a host with a
    cloud provider's long name, with a model of long tensor names."""
    record = {
        **worker.record,
        "host": "ip-10-0-12-200.eu-west-1.compute.internal",
        "pid": 4242,
        "started_at": (now - timedelta(hours=3)).isoformat(),
        "batching": {"max_batch_size": 512, "max_wait_ms": 100},
        "runtime": {**worker.record["runtime"], "onnxruntime": "1.20.1"},
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": [-1, 512]}],
        "outputs": [{"name": "last_hidden_state", "dtype": "float32", "shape": [-1, 512, 1024]}],
        "pipeline": {
            "handler": "myhandlers:CsvStats",
            "sha256": "6edcc2b5b136" + "0" * 52,
            "threads": 2,
            "timeout_s": 30.0,
            "batch_hooks": ["preprocess_batch"],
            "options": {"delimiter": ";"},
            "inputs": [{"name": "text", "dtype": "string", "shape": [-1]}],
            "outputs": None,
        },
    }
    return WorkerInfo(worker.name, worker.ttl_s, record)


def _big_report() -> str:
    now = datetime.now(UTC)
    big = _big_status(1_234_567, 1_234, time.time(), now - timedelta(seconds=2), 12_469_128, None)
    dead = DeadLetters(
        "d", big.dead.count, tuple(replace(d, tag=TAGS[2]) for d in big.dead.recent * 2)
    )
    note = DamageNote("trimmed", keys.request_stream(P, TAGS[1]), 12, "entries deleted unread")
    status = replace(
        big,
        workers=tuple(_pipeline_worker(w, now) for w in big.workers),
        dead=dead,
        damage=(note,),
        expired_workers=("redbatch-worker-7d9f8c6b5-q7r8s",),
    )
    return format_status(status, redis_url="rediss://operator@redis-prod.example.internal:6380/0")


def test_a_busy_status_report_fits_80_columns_and_keeps_its_figures() -> None:
    text = _big_report()
    lines = text.splitlines()

    assert [line for line in lines if len(line) > 80] == []
    said = " ".join(text.split())  # what was folded, read as one text
    for figure in (
        "used 829.7 MiB of maxmemory 1.0 GiB (81%)",
        "headroom 194.3 MiB; policy noeviction; master 10.0.12.201:6379",
        "trimmed redbatch:{sentence-embeddings-large~k3f9}:requests (now, at least 12 requests",
        "master 10.0.12.202:6379",
        "Dead letters: 1,234 over all shards",
        "shard sentence-embeddings-large~p0q1: POISONED: delivered 3 times without an answer "
        "(max_deliveries 3)",
        "removed 1 expired from the registry: redbatch-worker-7d9f8c6b5-q7r8s",
        "ready, version 2024-06-01-rc3 (sha256 abababababab), Tensorrt,CUDA,CPU",
        "onnxruntime 1.20.1, ip-10-0-12-200.eu-west-1.compute.internal:4242, started 3.0 h ago",
        "pipeline myhandlers:CsvStats (sha256 6edcc2b5b136), 2 threads, timeout 30.0 s, "
        "batch hooks preprocess_batch, options delimiter=';'",
        "request input text string [?]",
        "replies: outputs not declared by the handler",
        "model output last_hidden_state float32 [?, 512, 1024]",
    ):
        assert figure in said, figure
    # Rows of numbers, each with its full figures; each worker's full name heads its details
    shard_rows = [line.split() for line in lines if line.startswith("  sentence")]
    assert [row[1:6] for row in shard_rows] == [["send", "411,522", "1,533", "0", "411"]] * 2 + [
        ["retiring", "411,522", "1,533", "0", "411"]
    ]
    total = next(line.split() for line in lines if line.startswith("  total"))
    assert total[:6] == ["total", "1,234,567", "4,600", "1,229,967", "1,234", "13"]
    workers_at = lines.index("Workers: 2 live")
    worker_rows = [
        line.split() for line in lines[workers_at:] if line.startswith("  redbatch-worker-")
    ]
    assert worker_rows[0] == [PODS[0], "512", "rows/100", "ms", "12,469,128", "402,229"]
    assert f"  {PODS[1]}:" in lines
    # The pipeline's text folds under its label, a figure kept with its unit
    at = next(i for i, line in enumerate(lines) if line.startswith("    pipeline "))
    assert lines[at + 1].startswith(" " * 13 + "timeout 30.0 s,")


# ---------------------------------------------------------------------------------------------
# The verdict says idle when nothing was served


def _rates(requests_after: int, pre_busy_after: float) -> stages.StageRates:
    before = _stages(100, 5.0, 0.5, 10.0, 100.0)
    after = _stages(
        requests_after, pre_busy_after, 0.5 + (requests_after - 100) / 1000, 28.0, 110.0
    )
    return stages.rates(before, after, 10.0)


def test_a_worker_that_served_nothing_between_heartbeats_is_idle() -> None:
    # Its hooks' threads were busy (a hook call that ran past the heartbeat), but no request
    # came through: no verdict on what bounds it
    r = _rates(100, 85.0)
    assert r.requests_per_s == 0
    assert verdict_now(r, held=0, flow=None) == (
        "idle: served nothing in the 10.0 s between its last two heartbeats"
    )


def test_a_busy_heartbeat_window_is_not_the_verdict_once_the_queue_went_quiet() -> None:
    # Its last two heartbeats saw saturated threads; since then the queue answered nothing
    # over the last refresh and the worker holds nothing: it is idle now
    r = _rates(2_000, 85.0)
    assert stages.verdict(r).startswith("bound by preprocessing")
    assert verdict_now(r, held=0, flow=(0.0, 0.0, 2.0)) == (
        "idle now: nothing answered in the last 2.0 s and nothing held (the figures above are "
        "from its last heartbeats)"
    )
    # Still busy with what it holds, or the queue still answering: the verdict stands
    assert verdict_now(r, held=3, flow=(0.0, 0.0, 2.0)).startswith("bound by preprocessing")
    assert verdict_now(r, held=0, flow=(5.0, 40.0, 2.0)).startswith("bound by preprocessing")
    assert verdict_now(r, held=0, flow=None).startswith("bound by preprocessing")


def test_the_watch_frame_says_idle_at_0_requests_per_second(
    redis_url: str, rconn: redis.Redis
) -> None:
    # Given a pipeline worker whose last two heartbeats saw busy threads and no request
    stream = keys.request_stream(P, "demo")
    rconn.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
    start = datetime.now(UTC) - timedelta(seconds=10)
    watched = StageWatch()
    snaps = []
    for i, busy in enumerate((5.0, 85.0)):
        record = {
            "name": "cpu-0",
            "state": "ready",
            "heartbeat_at": (start + timedelta(seconds=5 * i)).isoformat(),
            "stages": _stages(100, busy, 0.5, 10.0 + 9 * i, 100.0 + 10 * i),
        }
        rconn.set(keys.worker_key(P, "demo", "cpu-0"), json.dumps(record), ex=15)
        rconn.sadd(keys.workers_key(P, "demo"), "cpu-0")
        snaps.append(watch.take_snapshot(rconn, "demo"))
        watched.update(snaps[-1].status.workers)

    frame = watch.render(snaps[0], snaps[1], stage_rates=watched)

    lines = frame.splitlines()
    stages_at = next(i for i, line in enumerate(lines) if line.startswith("stages "))
    at = next(i for i in range(stages_at, len(lines)) if lines[i].startswith("  cpu-0"))
    assert lines[at].split()[-1] == "0"  # REQ/S
    assert lines[at + 1] == "    idle: served nothing in the 10.0 s between its last two heartbeats"
    assert "bound by" not in frame


# ---------------------------------------------------------------------------------------------
# A Redis that never answers: a few seconds, one line, exit status 2


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "--model", "demo"],
        ["status"],
        ["status", "--model", "demo", "--watch", "--iterations", "1"],
        ["shards", "show", "--model", "demo"],
        ["replay", "--model", "demo", "--from-dead", "--dry-run"],
    ],
)
def test_read_commands_give_up_on_an_unreachable_redis_within_seconds(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()  # nothing listens there
    default = argv == ["status", "--model", "demo"]  # the others: the same window, made short
    if not default:
        monkeypatch.setattr(firstcontact, "FIRST_CONTACT_S", 0.5)
    started = time.monotonic()

    code = main(["--redis-url", f"redis://ops:s3cret@127.0.0.1:{port}/0", *argv])

    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 2
    if default:
        assert 2.0 <= took < 6.0  # it tried for about 3 s, not the 30 s of --retry-s
    else:
        assert 0.3 <= took < 3.0  # the first contact's window, whatever the command
    assert err.count("\n") == 1
    assert err.startswith(
        f"redbatch: error: Could not talk to Redis at redis://ops@127.0.0.1:{port}/0: nothing "
        "answered in "
    )
    assert "s3cret" not in err
    assert "Check that Redis is running there and that --redis-url (or $REDIS_URL) names it" in err


def test_an_explicit_retry_s_sets_how_long_the_first_contact_tries(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    assert main(["--redis-url", url, "--retry-s", "0.5", "status", "--model", "demo"]) == 2
    assert time.monotonic() - started < 2.0
    assert "nothing answered in 0." in capsys.readouterr().err


def test_an_explicit_retry_s_waits_for_a_redis_that_is_starting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given a Redis that starts 3.5 s from now, past the 3 s a first contact takes by default
    port = free_port()
    server = LocalRedis(port=port)
    timer = threading.Timer(3.5, server.start)
    timer.start()
    try:
        code = main(
            ["--redis-url", server.url, "--retry-s", "20", "status", "--model", "demo", "--json"]
        )
    finally:
        timer.join()
        server.close()

    # Then it reached it and reported: the new Redis holds no model 'demo' (exit status 1)
    assert code == 1
    assert json.loads(capsys.readouterr().out)["requests"]["backlog"] == 0


@pytest.fixture
def not_redis() -> Iterator[int]:
    """A port where an HTTP server answers whatever is sent."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield port
    stop.set()
    thread.join()
    listener.close()


def test_a_port_that_does_not_speak_redis_is_named_at_once(
    not_redis: int, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    code = main(["--redis-url", f"redis://127.0.0.1:{not_redis}/0", "status", "--model", "demo"])
    err = capsys.readouterr().err
    assert code == 2
    assert time.monotonic() - started < 2.0
    assert err.startswith(
        f"redbatch: error: What answers at redis://127.0.0.1:{not_redis}/0 is not"
    )
    assert "Check the host and port in --redis-url (or $REDIS_URL)." in err
    assert "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# Counted nouns


def test_count_agrees_with_its_number() -> None:
    assert count(1, "dead letter") == "1 dead letter"
    assert count(0, "dead letter") == "0 dead letters"
    assert count(1_204, "entry", "entries") == "1,204 entries"
    assert count(1, "old reply", "old replies") == "1 old reply"


def test_reports_say_one_dead_letter_one_shard_one_entry() -> None:
    resent = Resent("1-0", "r1", "r2", "2-0", reply_removed=True)
    report = ReplayReport(
        model="demo",
        prefix=P,
        dead_key="redbatch:{demo}:dead",
        stream_key="redbatch:{demo}:requests",
        same_ids=False,
        delete=True,
        dry_run=False,
        examined=1,
        resent=(resent,),
    )
    assert (
        "examined 1 dead letter: re-sent 1, skipped 0; removed 1 old reply; deleted 1 dead letter"
        in format_report(report)
    )
    placed = Placement("demo", P, False, 2, ("demo",), ("demo~1",), {}, ())
    assert format_placement(placed).startswith("added 1 shard to redbatch:{demo}:shards: demo~1;")
    done = Retirement("demo", P, "demo~1", True, False, True, False, 1, 0, 1, 5.0, timed_out=True)
    text = format_retirement(done)
    assert "demo~1 still holds 1 entry (0 pending)" in text
    assert "holds 1 dead letter;" in text
    note = DamageNote("trimmed", "redbatch:{demo}:requests", 1, "entries deleted")
    assert "at least 1 request lost" in damage_lines((note,), 0.0)[1]


# ---------------------------------------------------------------------------------------------
# --help


def test_help_says_what_run_reads_and_that_status_lists_models() -> None:
    text = build_parser().format_help()
    run_line = re.search(r"\n\s+run\s+(.+?)\n\s+status", text, re.S)
    assert run_line is not None
    said = " ".join(run_line[1].split())
    assert said == (
        "run .npy/.npz arrays, files (a folder or glob), .txt lines, .jsonl or .parquet/.arrow "
        "rows through the model"
    )
    assert "list the models" in text
    assert "  redbatch status\n" in text
