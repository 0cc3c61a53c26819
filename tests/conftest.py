"""Shared fixtures: each test module gets its own private redis-server on a free port."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import redis

from tools.localredis import LocalRedis


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    """A redis-server started for this module alone; only this module may flush or kill it."""
    with LocalRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: LocalRedis) -> Iterator[str]:
    """The module's Redis URL, flushed after each test so tests do not see each other's keys."""
    yield redis_server.url
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()


@pytest.fixture
def rconn(redis_url: str) -> Iterator[redis.Redis]:
    """A raw redis-py connection to the module's server (bytes in, bytes out).

    redis-py 8 defaults to a 5 s socket timeout; blocking waits in tests may be longer.
    """
    client = redis.Redis.from_url(redis_url, socket_timeout=60)
    yield client
    client.close()


@pytest.fixture
def admin(server: LocalRedis) -> Iterator[redis.Redis]:
    """An administrator's client of the module's own ACL ``server`` fixture (the security and
    tenant tests), flushing what the test left."""
    client = server.client(socket_timeout=60)
    yield client
    client.flushall()
    client.close()


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs a command's main() in-process lets it point the root logger at that
    test's captured stderr; restore the handlers, so that no later test logs to a closed one."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
