"""Redis memory in ``redbatch status`` (text and JSON) and ``--watch``, against a real Redis whose
``maxmemory`` each test sets on the module's own redis-server."""

from __future__ import annotations

import argparse
import io
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from producer.cli import status as status_command
from producer.cli.main import main
from producer.ops import watch
from producer.ops.textformat import memory_summary
from producer.protocol import keys
from producer.protocol.units import format_bytes
from producer.redisio.memory import MemoryReading
from tools.localredis import LocalRedis

MODEL = "demo"
STREAM = keys.request_stream(keys.DEFAULT_PREFIX, MODEL)
FILLER_BYTES = 4 << 20
NO_INFO_USER, NO_INFO_PASSWORD = "no-info", "no-info-password"


@pytest.fixture
def limits(rconn: redis.Redis) -> Iterator[redis.Redis]:
    """``rconn`` with the model's request stream there (``status --model`` of a model Redis
    knows nothing of exits 1), and the server's maxmemory and policy put back (0, noeviction)
    afterwards."""
    rconn.xgroup_create(STREAM, keys.CONSUMER_GROUP, id="0", mkstream=True)
    yield rconn
    rconn.config_set("maxmemory", 0)
    rconn.config_set("maxmemory-policy", "noeviction")


def _fill_to(conn: redis.Redis, fraction: float) -> None:
    """Store a few MiB, then set ``maxmemory`` so that Redis is ``fraction`` full.

    SETRANGE grows the string in Redis from a short command: a SET of the bytes themselves would
    leave a query buffer as large, counted in ``used_memory`` until Redis frees it moments later.
    """
    conn.setrange("filler", FILLER_BYTES - 1, "x")
    used = int(conn.info("memory")["used_memory"])
    conn.config_set("maxmemory", int(used / fraction))


def _status(redis_url: str, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    assert main(["--redis-url", redis_url, "status", "--model", MODEL, *flags]) == 0
    return capsys.readouterr().out


def _status_json(redis_url: str, capsys: pytest.CaptureFixture[str]) -> Any:
    return json.loads(_status(redis_url, capsys, "--json"))


def test_status_above_the_watermark_says_producers_are_refused(
    redis_url: str, limits: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given Redis 90% full, past the producers' 80% watermark
    _fill_to(limits, 0.9)

    lines = _status(redis_url, capsys).splitlines()
    doc = _status_json(redis_url, capsys)

    # Then the second line gives the figures, the third headroom and policy, and the next
    # says producers are refused
    figures = re.fullmatch(
        r"Redis memory: used [\d.]+ MiB of maxmemory [\d.]+ MiB \((\d+)%\)", lines[1]
    )
    assert figures, lines[1]
    assert 85 <= int(figures[1]) <= 95  # the status's own connection takes a little more
    assert re.fullmatch(r"  headroom [\d.]+ [KM]iB; policy noeviction", lines[2]), lines[2]
    assert lines[3:5] == [
        "  producers are refused (RedisFull) above 80% of maxmemory; workers keep",
        "    draining",
    ]
    redis_doc = doc["redis"]
    assert redis_doc["producers_refused"] is True
    assert redis_doc["maxmemory_policy"] == "noeviction"
    assert redis_doc["maxmemory"] == limits.info("memory")["maxmemory"]
    assert 0.85 < redis_doc["used_fraction"] < 0.95
    assert redis_doc["headroom_bytes"] == redis_doc["maxmemory"] - redis_doc["used_memory"]
    assert doc["requests"]["backlog"] == 0  # the existing keys are still there


def test_status_below_the_watermark_does_not_say_refused(
    redis_url: str, limits: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    _fill_to(limits, 0.5)

    text = _status(redis_url, capsys)
    doc = _status_json(redis_url, capsys)

    figures = re.search(r"^Redis memory: used .* \((\d+)%\)$", text, flags=re.MULTILINE)
    assert figures, text
    assert 45 <= int(figures[1]) <= 55
    assert "producers are refused" not in text
    assert doc["redis"]["producers_refused"] is False


def test_status_without_maxmemory_says_producers_are_never_refused(
    redis_url: str, limits: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    limits.config_set("maxmemory", 0)

    lines = _status(redis_url, capsys).splitlines()
    doc = _status_json(redis_url, capsys)

    assert re.fullmatch(r"Redis memory: used [\d.]+ [KM]iB, no maxmemory", lines[1]), lines[1]
    assert lines[2] == "  producers are never refused for memory"
    assert doc["redis"]["maxmemory"] == 0
    assert doc["redis"]["used_memory"] > 0
    assert doc["redis"]["used_fraction"] is None
    assert doc["redis"]["headroom_bytes"] is None
    assert doc["redis"]["producers_refused"] is False


def test_status_warns_of_a_policy_that_evicts(
    redis_url: str, limits: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given an eviction policy: producers are not held back, and Redis may drop the queue
    _fill_to(limits, 0.9)
    limits.config_set("maxmemory-policy", "allkeys-lru")

    text = _status(redis_url, capsys)
    doc = _status_json(redis_url, capsys)

    said = " ".join(text.split())  # the note is folded to 80 columns
    assert "policy allkeys-lru" in said
    assert "Redis may evict queued requests or replies" in said
    assert "set noeviction (docs/security.md)" in said
    assert "producers are refused" not in text
    assert doc["redis"]["maxmemory_policy"] == "allkeys-lru"
    assert doc["redis"]["producers_refused"] is False


@pytest.fixture
def no_info_url(redis_server: LocalRedis, rconn: redis.Redis) -> Iterator[str]:
    """A user who may do anything but ``INFO``, as an operator whose ACL lacks ``+info``."""
    rconn.execute_command(
        "ACL", "SETUSER", NO_INFO_USER, "on", f">{NO_INFO_PASSWORD}", "~*", "&*", "+@all", "-info"
    )
    yield redis_server.url_for(NO_INFO_USER, NO_INFO_PASSWORD)
    rconn.execute_command("ACL", "DELUSER", NO_INFO_USER)


def test_status_without_info_permission_still_works(
    no_info_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    rconn.xadd(STREAM, {"rid": "r1", "body": b"\x80"})
    with (
        redis.Redis.from_url(no_info_url) as operator,
        pytest.raises(redis.exceptions.NoPermissionError),
    ):
        operator.info("memory")

    text = _status(no_info_url, capsys)
    doc = _status_json(no_info_url, capsys)

    assert text.splitlines()[1] == "Redis memory unknown (INFO refused: grant +info)"
    assert "backlog (XLEN): 1" in text
    assert doc["redis"] is None
    assert doc["requests"]["backlog"] == 1


# ---------------------------------------------------------------------------------------------
# --watch


def test_watch_shows_memory_growth_per_second_and_refused_producers(
    redis_url: str, limits: redis.Redis
) -> None:
    # Given 4 MiB written over 2 s between two refreshes, after which Redis is 90% full
    clock = iter([10.0, 12.0])
    first = watch.take_snapshot(limits, MODEL, clock=lambda: next(clock))
    _fill_to(limits, 0.9)
    second = watch.take_snapshot(limits, MODEL, clock=lambda: next(clock))

    frame = watch.render(first, second)

    assert first.status.memory is not None
    assert second.status.memory is not None
    grown_per_s = (second.status.memory.used_bytes - first.status.memory.used_bytes) / 2.0
    assert grown_per_s >= FILLER_BYTES / 2.0
    lines = frame.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("memory "))
    assert f"used {format_bytes(second.status.memory.used_bytes)} " in lines[at]
    assert f"(+{format_bytes(grown_per_s)}/s) of maxmemory " in lines[at]
    assert re.fullmatch(r"         headroom [\d.]+ [KM]iB, policy noeviction", lines[at + 1])
    assert lines[at + 2 : at + 4] == [
        "         !! producers are refused (RedisFull) above 80% of maxmemory; workers",
        "         keep draining",
    ]


def test_watch_first_frame_shows_memory_without_a_rate(redis_url: str, limits: redis.Redis) -> None:
    _fill_to(limits, 0.5)
    out = io.StringIO()

    assert status_command.run_watch(_watch_args(redis_url), out=out) == 0

    lines = out.getvalue().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("memory "))
    figures = re.fullmatch(
        r"memory   used [\d.]+ MiB of maxmemory [\d.]+ MiB \((\d+)%\)", lines[at]
    )
    memory_line = lines[at]
    assert re.fullmatch(r"         headroom [\d.]+ MiB, policy noeviction", lines[at + 1])
    assert figures, memory_line
    assert 45 <= int(figures[1]) <= 55
    assert "producers are refused" not in out.getvalue()


def test_watch_without_info_permission_says_memory_unknown(
    no_info_url: str, rconn: redis.Redis
) -> None:
    with redis.Redis.from_url(no_info_url) as operator:
        frame = watch.render(None, watch.take_snapshot(operator, MODEL))

    assert "memory   unknown (INFO refused: grant +info)" in frame.splitlines()


def _watch_args(redis_url: str) -> argparse.Namespace:
    """``redbatch status --watch --iterations 1``, parsed as ``producer.cli.main`` would."""
    parser = argparse.ArgumentParser(prog="redbatch")
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", default=keys.DEFAULT_PREFIX)
    parser.add_argument("--model", default=MODEL)
    status_command.add_watch_arguments(parser)
    return parser.parse_args(["--redis-url", redis_url, "--watch", "--iterations", "1"])


# ---------------------------------------------------------------------------------------------
# The figures


def test_sizes_and_percentages_are_shown_as_people_read_them() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 << 10) == "3.0 KiB"
    assert format_bytes(int(9.7 * (1 << 20))) == "9.7 MiB"
    assert format_bytes(3 << 30) == "3.0 GiB"
    assert format_bytes(-(2 << 20)) == "-2.0 MiB"
    # The percentage is floored: 79.99% full is not yet shown as the 80% watermark
    reading = MemoryReading(7999, 10000, "noeviction")
    assert "(79%)" in memory_summary(reading)
    assert "headroom 2.0 KiB" in memory_summary(reading)
    past = MemoryReading(10300, 10000, "noeviction")
    assert "(103%), headroom -300 B" in memory_summary(past)
    assert "(-1.0 MiB/s)" in memory_summary(past, change_bytes_per_s=-(1 << 20))
