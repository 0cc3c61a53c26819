"""Bad arguments are refused by name, before anything is sent, by both clients (``shell``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import redis
from fakes import MODEL, PREFIX, STREAM, xs

from producer.cli import argtypes
from producer.client import settings
from producer.protocol import keys

if TYPE_CHECKING:
    from shells import Shell

pytest_plugins = ["shells"]


BAD_HANDLE = r"does not match|not 'demo'|neither a model"


def test_invalid_rid_is_rejected(client: Any, rconn: redis.Redis) -> None:
    for bad in ["", "has space", "a/b", "x" * 129, "é"]:
        with pytest.raises(ValueError, match="does not match"):
            client.submit({"x": xs(1)}, rid=bad)
    # poll and cancel take handles too: "a/b" is request b on a shard of model a
    for bad in ["", "has space", "a/b", "demo~b/", "demo~B/r", "x" * 129, "é", "demo~b/a b"]:
        with pytest.raises(ValueError, match=BAD_HANDLE):
            client.poll(bad)
        with pytest.raises(ValueError, match=BAD_HANDLE):
            client.cancel(bad)
        with pytest.raises(ValueError, match=BAD_HANDLE):
            client.wait(bad, 1)
    assert rconn.exists(STREAM) == 0


def test_bad_arguments_are_rejected_before_anything_is_sent(client: Any, shell: Shell) -> None:
    with pytest.raises(ValueError, match="reply_ttl_s"):
        client.submit({"x": xs(1)}, reply_ttl_s=0)
    with pytest.raises(ValueError, match="outputs"):
        client.submit({"x": xs(1)}, outputs="y")
    with pytest.raises(ValueError, match="Model name"):
        shell.Client("bad model", "redis://127.0.0.1:1/0")
    with pytest.raises(ValueError, match="max_backlog"):
        shell.Client(MODEL, "redis://127.0.0.1:1/0", max_backlog=0)


@pytest.mark.parametrize("timeout_s", [float("nan"), -1, True, "1"])
def test_a_bad_timeout_is_refused_by_name_before_anything_is_sent(
    client: Any, rconn: redis.Redis, timeout_s: float
) -> None:
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds >= 0"):
        client.infer({"x": xs(1)}, timeout_s=timeout_s)
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds >= 0"):
        client.wait("r-1", timeout_s)
    assert rconn.exists(STREAM) == 0


@pytest.mark.parametrize("deadline_s", [float("nan"), float("inf"), 1e20, 0, -1, True])
def test_a_bad_deadline_is_refused_by_name(
    client: Any, rconn: redis.Redis, deadline_s: float
) -> None:
    with pytest.raises(ValueError, match="deadline_s must be a number of seconds above 0"):
        client.submit({"x": xs(1)}, deadline_s=deadline_s)
    assert rconn.exists(STREAM) == 0


def test_a_reply_ttl_past_the_longest_span_is_refused(client: Any) -> None:
    with pytest.raises(ValueError, match="reply_ttl_s must be a whole number"):
        client.submit({"x": xs(1)}, reply_ttl_s=2**64)


@pytest.mark.parametrize("ttl_s", [0, -5, 1.5, True, settings.MAX_SPAN_S + 1])
def test_a_bad_cancel_ttl_is_refused_before_redis_sees_it(
    client: Any, rconn: redis.Redis, ttl_s: int
) -> None:
    with pytest.raises(ValueError, match="ttl_s must be a whole number of seconds"):
        client.cancel("abc", ttl_s=ttl_s)
    assert rconn.exists(keys.cancel_key(PREFIX, MODEL, "abc")) == 0


@pytest.mark.parametrize("prefix", ["", "a b", "a{b}", "a}", "tab\there", "line\n", 7])
def test_a_prefix_the_workers_and_cli_refuse_is_refused(shell: Shell, prefix: str) -> None:
    with pytest.raises(ValueError, match="is not a key prefix"):
        shell.Client(MODEL, "redis://127.0.0.1:1/0", prefix=prefix)
    if isinstance(prefix, str):  # the CLI's rule is the same one
        with pytest.raises(argparse.ArgumentTypeError):
            argtypes.prefix(prefix)


@pytest.mark.parametrize("requests", ["ab", b"ab", {"x": np.zeros((1, 3))}, 5])
def test_submit_many_wants_a_list_of_requests(client: Any, requests: object) -> None:
    with pytest.raises(TypeError, match="submit_many takes a list of requests"):
        client.submit_many(requests)


def test_a_request_must_be_a_mapping_of_inputs(client: Any, rconn: redis.Redis) -> None:
    with pytest.raises(TypeError, match="inputs must be a mapping of input name to array"):
        client.submit("ab")
    with pytest.raises(TypeError, match="inputs must be a mapping of input name to array"):
        client.submit_many([{"x": xs(1)}, "ab"])
    with pytest.raises(TypeError, match="inputs must be a mapping of input name to array"):
        client.infer("ab", timeout_s=1)
    assert rconn.exists(STREAM) == 0


def test_map_rejects_bad_arguments_at_the_call(client: Any) -> None:
    with pytest.raises(ValueError, match="same number of rows"):
        client.map({"x": xs(3), "z": xs(4)}, rows_per_request=2)
    with pytest.raises(ValueError, match="concurrency must be a positive integer"):
        client.map({"x": xs(3)}, rows_per_request=2, concurrency=0)
    with pytest.raises(ValueError, match="rows_per_request must be a positive integer"):
        client.map({"x": xs(3)}, rows_per_request=0)
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds >= 0"):
        client.wait_many(["r-1"], timeout_s=-1)
    with pytest.raises(ValueError, match="does not match"):
        client.wait_many(["bad rid"], timeout_s=1)
