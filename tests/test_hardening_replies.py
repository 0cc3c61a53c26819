"""Replies Redis will not take, and error replies under a full Redis (contract section 4, v3).

A reply over Redis's ``proto-max-bulk-len`` makes Redis drop the connection; before the reply
bound the worker took that for an outage and retried the batch for ever (issue 26). A flood of
tiny malformed requests answered with error replies pushed Redis far past ``maxmemory``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import redis
from eventually import eventually
from harness import PREFIX, running_worker, send, wait_reply, write_config

from producer import Client, RedisFull
from producer.protocol.codec import encode_request
from producer.protocol.keys import request_stream
from producer.redisio.bulklimit import REDIS_DEFAULT_BULK_BYTES
from tools.localredis import LocalRedis
from worker.answer.pressure import COMPACT_MESSAGE_CHARS, COMPACT_TTL_S
from worker.answer.replybound import ReplyBound
from worker.config import LimitsConfig
from worker.config.table import Table
from worker.errors import ConfigError

MODEL = "demo"
WIDTH = 64
TILES = 1024  # one row of output y is WIDTH * TILES float32: 256 KiB; five rows pass 1 MiB
ROW_BYTES = WIDTH * TILES * 4
NO_CONFIG = "user default on nopass ~* &* +@all -config"


def _tile_model(path: Path) -> Path:
    """x float32 [N,64] -> y [N,65536] (x tiled) and s [N] (row sums): the reply grows with
    the rows, the request does not."""
    helper, f32 = onnx.helper, onnx.TensorProto.FLOAT
    nodes = [
        helper.make_node("Tile", ["x", "repeats"], ["y"]),
        helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "tile",
        [helper.make_tensor_value_info("x", f32, ["N", WIDTH])],
        [
            helper.make_tensor_value_info("y", f32, ["N", WIDTH * TILES]),
            helper.make_tensor_value_info("s", f32, ["N"]),
        ],
        initializer=[
            onnx.numpy_helper.from_array(np.array([1, TILES], np.int64), "repeats"),
            onnx.numpy_helper.from_array(np.array([1], np.int64), "axes"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, path)
    return path


def _config(tmp_path: Path, url: str, limits: str = "") -> Path:
    model = _tile_model(tmp_path / "tile.onnx")
    config = tmp_path / "tile.toml"
    config.write_text(
        f"""
[redis]
url = "{url}"

[model]
name = "{MODEL}"
path = "{model.name}"
providers = ["cpu"]

[batching]
max_batch_size = 32
max_wait_ms = 20

[warmup]
runs = 0

[limits]
{limits}
"""
    )
    return config


@pytest.fixture(scope="module")
def small_bulk() -> Iterator[LocalRedis]:
    """A Redis taking bulk strings of at most 1 MiB, the least it accepts."""
    with LocalRedis("--proto-max-bulk-len", "1mb") as server:
        yield server


@pytest.fixture(scope="module")
def no_config_get() -> Iterator[LocalRedis]:
    """The same limit on a Redis whose user may not run CONFIG (an ACL, a managed Redis)."""
    with LocalRedis("--proto-max-bulk-len", "1mb", acl=NO_CONFIG) as server:
        yield server


def _rows(n: int, value: float = 1.0) -> dict[str, np.ndarray]:
    return {"x": np.full((n, WIDTH), value, np.float32)}


def _serves_oversized_with_its_batch(config: Path, url: str, source: str) -> None:
    """One request whose reply is over 1 MiB, batched with small ones: it alone is TOO_LARGE."""
    r = redis.Redis.from_url(url)
    try:
        # Given four requests queued before the worker starts, so that one read takes them all
        small = [send(r, MODEL, f"small-{i}", _rows(1, float(i))) for i in range(3)]
        big = send(r, MODEL, "big", _rows(5))
        with running_worker(config):
            # Then the big one is TOO_LARGE, naming its largest output and the limit
            reply = wait_reply(r, big, timeout_s=15)
            assert reply.error is not None
            assert not reply.ok
            assert reply.error.code == "TOO_LARGE"
            assert not reply.error.retryable
            message = reply.error.message
            assert "output 'y' alone is 1.3 MiB" in message, message
            assert "over the 1.0 MiB limit" in message, message
            assert source in message, message
            # And its batch-mates are answered as usual
            for i, rid in enumerate(small):
                got = wait_reply(r, rid, timeout_s=15)
                assert got.ok, got.error
                assert got.outputs is not None
                np.testing.assert_array_equal(got.outputs["s"], [WIDTH * float(i)])
                assert got.outputs["y"].shape == (1, WIDTH * TILES)
            # And the worker is alive: a later request is answered
            later = send(r, MODEL, "later", _rows(2))
            assert wait_reply(r, later, timeout_s=15).ok
    finally:
        r.flushall()
        r.close()


def test_a_reply_over_the_servers_bulk_limit_is_too_large_and_its_batch_mates_are_served(
    tmp_path: Path, small_bulk: LocalRedis
) -> None:
    config = _config(tmp_path, small_bulk.url)
    _serves_oversized_with_its_batch(config, small_bulk.url, "(Redis proto-max-bulk-len)")


def test_a_configured_bound_serves_where_config_get_is_refused(
    tmp_path: Path, no_config_get: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path, no_config_get.url, "max_reply_bytes = 1048576")
    with caplog.at_level(logging.WARNING):
        _serves_oversized_with_its_batch(config, no_config_get.url, "(limits.max_reply_bytes)")
    # the operator set the bound: nothing to warn about; the oversized reply is logged
    assert not [r for r in caplog.records if r.name == "worker.answer.replybound"]
    [logged] = [r for r in caplog.records if r.name == "worker.answer.answerer"]
    assert logged.levelno == logging.WARNING
    assert logged.fields["rid"] == "big"


def test_a_refused_config_get_assumes_redis_default_and_warns_once(
    no_config_get: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    client = no_config_get.client()
    bound = ReplyBound(lambda tag: client)
    with caplog.at_level(logging.WARNING, logger="worker.answer.replybound"):
        first, second = bound.of("demo"), bound.of("demo~b")
    assert first.nbytes == second.nbytes == REDIS_DEFAULT_BULK_BYTES
    [record] = [r for r in caplog.records if r.name == "worker.answer.replybound"]
    assert "limits.max_reply_bytes" in record.getMessage()
    assert "+config|get" in record.getMessage()
    client.close()


def test_a_configured_bound_above_the_servers_is_lowered_to_it_once(
    small_bulk: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    client = small_bulk.client()
    with caplog.at_level(logging.WARNING, logger="worker.answer.replybound"):
        assert ReplyBound(lambda tag: client, 4 << 20).of("demo").nbytes == 1 << 20
        assert ReplyBound(lambda tag: client, 1 << 19).of("demo").nbytes == 1 << 19
        assert ReplyBound(lambda tag: client).of("demo").nbytes == 1 << 20
    [record] = [r for r in caplog.records if r.name == "worker.answer.replybound"]
    assert "above Redis's proto-max-bulk-len" in record.getMessage()
    client.close()


# -- error replies under a full Redis ----------------------------------------------------------

MAXMEMORY = 16 * 1024 * 1024
MALFORMED_BODY = b"\xc1"  # never valid msgpack: answered MALFORMED


@pytest.fixture(scope="module")
def full_redis() -> Iterator[LocalRedis]:
    with LocalRedis("--maxmemory", str(MAXMEMORY), "--maxmemory-policy", "noeviction") as s:
        yield s


class _Peak:
    """Samples ``used_memory`` on a thread until stopped; keeps the peak."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.peak = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(0.01):
            self.peak = max(self.peak, int(self.client.info("memory")["used_memory"]))

    def stop(self) -> int:
        self.done.set()
        self.thread.join(5)
        self.client.close()
        return self.peak


def _flood(url: str, refused_for_s: float = 3.0, longest_s: float = 25.0) -> int:
    """Raw malformed XADDs in pipelines of 500 until Redis has refused them for memory for
    ``refused_for_s``; returns how many it took."""
    client = redis.Redis.from_url(url)
    stream = f"redbatch:{{{MODEL}}}:requests"
    taken, refused_since = 0, None
    ends = time.monotonic() + longest_s
    while time.monotonic() < ends:
        pipe = client.pipeline(transaction=False)
        for _ in range(500):
            pipe.xadd(stream, {"rid": str(uuid.uuid4()), "body": MALFORMED_BODY})
        results = pipe.execute(raise_on_error=False)
        ok = sum(not isinstance(result, Exception) for result in results)
        taken += ok
        if ok:
            refused_since = None
        elif refused_since is None:
            refused_since = time.monotonic()
        elif time.monotonic() - refused_since >= refused_for_s:
            break
    client.close()
    return taken


def _readmitted_s(url: str, within_s: float) -> float:
    """Seconds until ``Client.submit`` of a valid request is admitted (no RedisFull), or
    infinity when not within ``within_s``; once admitted, its reply must come."""
    started = time.monotonic()
    with Client(MODEL, url) as client:
        while True:
            try:
                handle = client.submit({"features": np.zeros((1, 16), np.float32)})
                break
            except RedisFull:
                if time.monotonic() - started > within_s:
                    return float("inf")  # still refused
                time.sleep(0.2)
        admitted_s = time.monotonic() - started
        assert client.wait(handle, timeout_s=30).ok
    return admitted_s


def flood_once(tmp_path: Path, url: str) -> tuple[float, float, int]:
    """A worker, a malformed flood and a producer after it: (peak used_memory / maxmemory,
    seconds to re-admission after the flood, requests the flood queued)."""
    config = write_config(tmp_path, MODEL, url)
    with running_worker(config):
        peak = _Peak(url)
        taken = _flood(url)
        readmitted_s = _readmitted_s(url, within_s=60)
        return peak.stop() / MAXMEMORY, readmitted_s, taken


def test_a_malformed_flood_keeps_redis_within_the_margin_and_producers_return(
    tmp_path: Path, full_redis: LocalRedis
) -> None:
    ratio, readmitted_s, taken = flood_once(tmp_path, full_redis.url)
    print(f"\nFIGURE peak_x_maxmemory={ratio:.2f}\nFIGURE readmitted_s={readmitted_s:.1f}")
    print(f"FIGURE malformed_sent={taken}")
    assert taken > 10_000
    assert ratio < 1.5
    assert readmitted_s < 60


@pytest.fixture
def filled(full_redis: LocalRedis) -> Iterator[redis.Redis]:
    """The full_redis server holding 10 MiB of other data (0.6x of its maxmemory)."""
    client = full_redis.client()
    client.flushall()  # what an earlier test left
    for i in range(10):  # one 10 MiB value would need as much again in its query buffer
        client.set(f"ballast-{i}", b"x" * (1 << 20))
    yield client
    client.config_set("maxmemory", MAXMEMORY)
    client.flushall()
    client.close()


def test_error_replies_past_the_watermark_are_compact_and_short_lived(
    tmp_path: Path, full_redis: LocalRedis, filled: redis.Redis
) -> None:
    # Given Redis past half its maxmemory
    config = write_config(tmp_path, MODEL, full_redis.url)
    with running_worker(config):
        # When a bad request with meta arrives
        rid = send(filled, MODEL, "bad", {"features": np.zeros((1, 3), np.float32)}, meta="m" * 300)
        reply = wait_reply(filled, rid, timeout_s=15)
        # Then its error reply echoes no meta, cuts its message short and expires soon
        assert reply.error is not None
        assert reply.error.code == "INVALID_INPUT"
        assert reply.meta_raw is None
        assert len(reply.error.message) <= COMPACT_MESSAGE_CHARS
        send(filled, MODEL, "bad-2", body=MALFORMED_BODY)
        key = f"redbatch:{{{MODEL}}}:reply:bad-2"
        eventually(lambda: filled.exists(key), 15, "the reply to bad-2")
        assert 0 < filled.ttl(key) <= COMPACT_TTL_S


# An XADD past maxmemory, as no client can make: so that a request reaches a worker only once
# Redis is already past the ceiling (a CONFIG SET after a plain XADD would race the worker).
_ADD_PAST_MAXMEMORY = """#!lua flags=allow-oom
return redis.call('XADD', KEYS[1], '*', 'rid', ARGV[1], 'body', ARGV[2])
"""


def _send_past_maxmemory(r: redis.Redis, rid: str, body: bytes) -> str:
    r.eval(_ADD_PAST_MAXMEMORY, 1, request_stream(PREFIX, MODEL), rid, body)
    return rid


def test_error_only_batches_wait_past_the_ceiling_and_ok_ones_do_not(
    tmp_path: Path, full_redis: LocalRedis, filled: redis.Redis
) -> None:
    # Given a worker reading one request at a time, and Redis past 1.25x its maxmemory
    config = write_config(tmp_path, MODEL, full_redis.url, batching="max_batch_size = 1")
    with running_worker(config):
        filled.config_set("maxmemory", 7 << 20)
        # When a malformed request comes
        _send_past_maxmemory(filled, "bad", MALFORMED_BODY)
        # Then its error reply waits
        with pytest.raises(AssertionError, match="no reply"):
            wait_reply(filled, "bad", timeout_s=1)
        # And a valid request after it is answered at once, the malformed one with it
        good = encode_request({"features": np.zeros((1, 16), np.float32)})
        assert wait_reply(filled, _send_past_maxmemory(filled, "good", good), timeout_s=5).ok
        assert wait_reply(filled, "bad", timeout_s=1).error is not None
        # And a malformed one alone is answered once memory falls below the ceiling
        _send_past_maxmemory(filled, "bad-2", MALFORMED_BODY)
        with pytest.raises(AssertionError, match="no reply"):
            wait_reply(filled, "bad-2", timeout_s=1)
        filled.config_set("maxmemory", MAXMEMORY)
        assert wait_reply(filled, "bad-2", timeout_s=5).error is not None


@pytest.mark.parametrize("value", [100, -1, 1.5, True, "1mb"])
def test_a_bad_max_reply_bytes_is_refused_with_the_fix(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        Table({"max_reply_bytes": value}, "limits").build(LimitsConfig)
    assert str(info.value) == (
        f"Config 'limits.max_reply_bytes' has value {value!r}. Use 0 (the worker reads Redis's "
        "proto-max-bulk-len) or the largest reply in bytes, 65536 or more, at most the "
        "server's proto-max-bulk-len."
    )
    assert Table({"max_reply_bytes": 65536}, "limits").build(LimitsConfig).max_reply_bytes == 65536
    assert Table({}, "limits").build(LimitsConfig).max_reply_bytes == 0
