"""A client given no URL reads ``$REDIS_URL``, as the CLI and the worker do: the examples'
``Client("orientation")`` snippet reaches the Redis the worker serves, not whatever answers on
6379. An explicit URL still wins."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis

from producer import AsyncClient, Client
from producer.client.shell import DEFAULT_URL, default_url
from producer.redisio.connection import redact_url

ROW = {"x": np.zeros((1, 2), np.float32)}


def test_default_url_is_redis_url_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert default_url() == DEFAULT_URL
    monkeypatch.setenv("REDIS_URL", "redis://10.0.0.7:6380/2")
    assert default_url() == "redis://10.0.0.7:6380/2"
    monkeypatch.setenv("REDIS_URL", "")  # set but empty, as `REDIS_URL= cmd` leaves it
    assert default_url() == DEFAULT_URL


def test_client_without_url_submits_to_redis_url(
    redis_url: str, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    with Client("envmodel", retry_s=1) as client:
        client.submit(ROW)
    assert rconn.xlen("redbatch:{envmodel}:requests") == 1


def test_async_client_without_url_submits_to_redis_url(
    redis_url: str, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)

    async def send() -> None:
        async with AsyncClient("envmodel", retry_s=1) as client:
            await client.submit(ROW)

    asyncio.run(send())
    assert rconn.xlen("redbatch:{envmodel}:requests") == 1


def test_explicit_url_wins_over_redis_url(
    redis_url: str, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    with Client("envmodel", redis_url, retry_s=1) as client:
        client.submit(ROW)
    assert rconn.xlen("redbatch:{envmodel}:requests") == 1


@pytest.mark.parametrize(
    ("written", "shown"),
    [
        ("redis//127.0.0.1:6379", "redis//127.0.0.1:6379"),  # was '://redis//127.0.0.1:6379'
        ("redis//u:secret@127.0.0.1:6379", "redis//***@127.0.0.1:6379"),
        ("redis:/10.0.0.9:7000", "redis:/10.0.0.9:7000"),  # was 'redis:///10.0.0.9:7000'
        ("127.0.0.1:6379", "127.0.0.1:6379"),
        ("redis://u:secret@h:6379/0", "redis://u@h:6379/0"),  # the user stays, the password not
    ],
)
def test_a_url_is_shown_as_written_less_its_password(written: str, shown: str) -> None:
    assert redact_url(written) == shown
