"""The client library and CLI against a real worker: map, infer, typed errors, status.

The client tests run against both clients (``shell``: see ``tests/shells.py``)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import redis
from harness import direct_run, running_worker, write_config

from producer import AsyncClient, Client
from producer.cli.main import main as redbatch
from producer.client import steps
from producer.protocol.errors import InvalidInput, TooLarge

if TYPE_CHECKING:
    from shells import Shell

pytest_plugins = ["shells"]

ROOT = Path(__file__).resolve().parents[1]
RANGE = "[inputs.features]\nmin = -10.0\nmax = 10.0"


@pytest.fixture
def demo_config(tmp_path: Path, redis_url: str) -> Path:
    return write_config(tmp_path, "demo", redis_url, extra=RANGE)


def test_map_over_thousands_of_rows_equals_a_direct_run(
    shell: Shell, demo_config: Path, redis_url: str, tmp_path: Path
) -> None:
    x = np.random.default_rng(9).normal(size=(3000, 16)).astype(np.float32)
    x[1234, 5] = 50.0  # one row out of range
    with running_worker(demo_config), shell.Client("demo", redis_url) as client:
        chunks = list(client.map({"features": x}, rows_per_request=8, concurrency=32))

    assert [c.start for c in chunks] == list(range(0, 3000, 8))
    failed = [c for c in chunks if not c.ok]
    assert [(c.start, c.stop) for c in failed] == [(1232, 1240)]
    assert failed[0].error.code == "INVALID_INPUT"
    want = direct_run(tmp_path / "demo.onnx", {"features": x})
    for c in chunks:
        if c.ok:
            np.testing.assert_allclose(
                c.outputs["probs"], want["probs"][c.start : c.stop], atol=1e-6
            )
            np.testing.assert_array_equal(c.outputs["label"], want["label"][c.start : c.stop])
    assert np.mean([c.result.batch_rows for c in chunks if c.ok]) > 8


def test_map_defaults_to_the_workers_row_limit(
    shell: Shell, demo_config: Path, redis_url: str
) -> None:
    x = np.zeros((100, 16), np.float32)
    with running_worker(demo_config), shell.Client("demo", redis_url) as client:
        chunks = list(client.map({"features": x}))
    assert [c.stop - c.start for c in chunks] == [32, 32, 32, 4]


def test_map_refuses_rows_per_request_over_the_workers_limit(
    shell: Shell, demo_config: Path, redis_url: str
) -> None:
    # Every request would be answered TOO_LARGE, one by one: say so before sending any
    x = np.zeros((100, 16), np.float32)
    with running_worker(demo_config), shell.Client("demo", redis_url) as client:
        with pytest.raises(ValueError, match="rows_per_request=64 is over the live workers' max"):
            next(iter(client.map({"features": x}, rows_per_request=64)))
        assert client.backlog() == 0
        with pytest.raises(TooLarge, match="Send at most 32 rows a request"):
            client.infer({"features": np.zeros((33, 16), np.float32)}, timeout_s=10)


def test_infer_raises_the_typed_error_from_the_worker(
    shell: Shell, demo_config: Path, redis_url: str
) -> None:
    with running_worker(demo_config), shell.Client("demo", redis_url) as client:
        out = client.infer({"features": np.zeros((2, 16), np.float32)}, timeout_s=10)
        with pytest.raises(InvalidInput, match=r"input 'features': expected shape \[-1, 16\]"):
            client.infer({"features": np.zeros((1, 15), np.float32)}, timeout_s=10)
        with pytest.raises(TooLarge, match="max_batch_size is 32"):
            client.infer({"features": np.zeros((33, 16), np.float32)}, timeout_s=10)
    assert out["probs"].shape == (2, 4)
    assert out["label"].dtype == np.int64


def test_async_client_gets_the_same_answers(demo_config: Path, redis_url: str) -> None:
    x = np.random.default_rng(2).normal(size=(5, 16)).astype(np.float32)

    async def run() -> list[dict[str, np.ndarray]]:
        async with AsyncClient("demo", redis_url) as client:
            return await asyncio.gather(
                *(client.infer({"features": x[i : i + 1]}) for i in range(5))
            )

    with running_worker(demo_config), Client("demo", redis_url) as client:
        sync = [client.infer({"features": x[i : i + 1]}) for i in range(5)]
        got = asyncio.run(run())
    for a, b in zip(sync, got, strict=True):
        np.testing.assert_array_equal(a["probs"], b["probs"])


def test_status_shows_the_live_workers_validation_record(
    demo_config: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with running_worker(demo_config, name="status-probe"):
        assert redbatch(["--redis-url", redis_url, "status", "--model", "demo", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert redbatch(["--redis-url", redis_url, "status", "--model", "demo"]) == 0
        table = capsys.readouterr().out
    text = json.dumps(doc)
    assert "status-probe" in text
    assert "CPUExecutionProvider" in text
    assert "status-probe" in table
    assert "features" in table


def test_json_logs_are_one_object_per_line(demo_config: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker",
            "--config",
            str(demo_config),
            "--check",
            "--log-format",
            "json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert {"warmup done", "validation record"} <= {line["msg"] for line in lines}
    assert all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    # The record's line alone says what was enforced: ranges, limits, delivery
    [record] = [line for line in lines if line["msg"] == "validation record"]
    assert record["inputs"] == ["features float32 [?, 16] range [-10.0, 10.0] finite only"]
    assert record["limits"]["max_request_bytes"] > 0
    assert record["delivery"]["max_deliveries"] == 3
    assert record["batching"]["adaptive_wait"] is True


def _lose_the_first_popped_reply(
    shell: Shell, monkeypatch: pytest.MonkeyPatch, command: str
) -> list[bool]:
    """Make the client drop its connection once, right after Redis popped a reply with
    ``command`` (LPOP, BLPOP): the reply is gone from Redis and never reaches the client, as
    when a stall outlasts the socket timeout. Returns a list that holds True once that
    happened."""
    lost: list[bool] = []

    def drop(cmd: steps.Call | steps.Batch, answer: Any) -> None:
        if cmd.name != command or lost:
            return
        if answer if command == "BLPOP" else any(a is not None for a in answer):
            lost.append(True)
            raise redis.ConnectionError("connection dropped with the reply in it (test)")

    shell.patch_tries(monkeypatch, drop)
    return lost


def test_map_sends_again_a_request_whose_reply_was_lost_in_flight(
    shell: Shell, demo_config: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lost = _lose_the_first_popped_reply(shell, monkeypatch, "LPOP")
    x = np.random.default_rng(4).normal(size=(64, 16)).astype(np.float32)
    with running_worker(demo_config), shell.Client("demo", redis_url) as client:
        chunks = list(client.map({"features": x}, rows_per_request=4, timeout_s=10))
    assert lost == [True]
    assert [c.error for c in chunks if not c.ok] == []  # not WAIT_TIMEOUT after 10 s
    assert [c.start for c in chunks] == list(range(0, 64, 4))


def test_a_retried_submit_sends_nothing_again(
    shell: Shell,
    demo_config: Path,
    redis_url: str,
    rconn: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A submit that failed before reaching Redis and was retried lost no reply: no copies, which
    # a worker would run again and whose replies would sit unread for reply_ttl_s
    failed: list[bool] = []

    def fail_once(cmd: steps.Call | steps.Batch) -> None:
        if cmd.name == "XADD" and not failed:
            failed.append(True)
            raise redis.ConnectionError("dropped before it was sent (test)")

    shell.patch_tries(monkeypatch, before=fail_once)
    x = np.zeros((64, 16), np.float32)
    with running_worker(demo_config), shell.Client("demo", redis_url) as client:
        chunks = list(client.map({"features": x}, rows_per_request=4, timeout_s=10))
    assert failed == [True]
    assert all(c.ok for c in chunks)
    assert rconn.xinfo_stream("redbatch:{demo}:requests")["entries-added"] == 16


def test_infer_sends_again_a_request_whose_reply_was_lost_in_flight(
    shell: Shell, demo_config: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lost = _lose_the_first_popped_reply(shell, monkeypatch, "BLPOP")
    with running_worker(demo_config), shell.Client("demo", redis_url) as client:
        out = client.infer({"features": np.zeros((1, 16), np.float32)}, timeout_s=10)
    assert lost == [True]
    assert out["probs"].shape == (1, 4)
