"""Backpressure from the request stream's length (``max_backlog``), in both clients (``shell``);
the backlog gate's arithmetic without Redis at the end."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import pytest
import redis
from fakes import MODEL, STREAM, FakeReplier, xs

from producer.client import backlog
from producer.client.aio import AsyncClient
from producer.protocol.errors import BacklogFull

if TYPE_CHECKING:
    from shells import Shell

pytest_plugins = ["shells"]


def test_submit_refuses_at_max_backlog(shell: Shell, redis_url: str) -> None:
    with shell.Client(MODEL, redis_url, max_backlog=3) as c:
        c.submit_many([{"x": xs(1)}] * 3)
        assert c.backlog() == 3

        with pytest.raises(BacklogFull) as info:
            c.submit({"x": xs(1)})

        assert info.value.backlog == 3
        assert info.value.max_backlog == 3
        assert c.backlog() == 3


def test_waiting_submit_goes_through_once_the_backlog_drains(
    shell: Shell, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a full backlog and a replier that starts only once the submit has begun waiting
    fake = FakeReplier(redis_url)

    def start_replier(_seconds: float) -> None:
        if not fake.started:
            fake.start()

    shell.patch_sleep(monkeypatch, start_replier)
    try:
        with shell.Client(MODEL, redis_url, max_backlog=2, wait_for_backlog=True) as c:
            c.submit_many([{"x": xs(1)}] * 2)

            # When submitting one more, it waits, then goes through
            rid = c.submit({"x": xs(1)})

            assert fake.started
            assert c.wait(rid, timeout_s=10).ok
    finally:
        fake.stop()


@pytest.mark.timeout(20)  # it waited for ever before infer's timeout_s bounded its submit
def test_infer_on_a_full_backlog_ends_at_its_timeout_with_nothing_sent(
    shell: Shell, redis_url: str, rconn: redis.Redis
) -> None:
    rconn.xadd(STREAM, {"filler": "1"})
    with shell.Client(MODEL, redis_url, max_backlog=1, wait_for_backlog=True) as c:
        started = time.monotonic()
        with pytest.raises(BacklogFull, match=r"max_backlog=1\. The call.s timeout_s ran out"):
            c.infer({"x": xs(1)}, timeout_s=0.3)
        elapsed_s = time.monotonic() - started

    assert 0.3 <= elapsed_s < 2
    assert rconn.xlen(STREAM) == 1


@pytest.mark.timeout(20)
def test_an_async_infer_behind_a_waiting_submit_ends_at_its_timeout_unsent(
    redis_url: str, rconn: redis.Redis
) -> None:
    # Queued behind a submit that waits for the backlog (its round trip is shared), the infer
    # waits in the queue, and still ends at its timeout_s with the error that held it up.
    rconn.xadd(STREAM, {"filler": "1"})

    async def scenario() -> None:
        async with AsyncClient(MODEL, redis_url, max_backlog=1, wait_for_backlog=True) as client:
            waiting = asyncio.create_task(client.submit({"x": xs(1)}))
            while client._session.backlog_seen is None:  # that submit waits for the backlog
                await asyncio.sleep(0.001)
            started = time.monotonic()
            with pytest.raises(BacklogFull, match=r"max_backlog=1\. The call.s timeout_s ran out"):
                await client.infer({"x": xs(1)}, timeout_s=0.3)
            assert time.monotonic() - started < 2
            waiting.cancel()

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    assert rconn.xlen(STREAM) == 1


def test_backlog_gate_backs_off_exponentially_up_to_a_cap() -> None:
    gate = backlog.BacklogGate(max_backlog=10, wait=True)
    assert gate.delay_s(9, now=0) is None
    delays = [gate.delay_s(10, now=0) for _ in range(8)]
    assert delays == [0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.2, 0.2]
    with pytest.raises(BacklogFull):
        backlog.BacklogGate(max_backlog=10, wait=False).delay_s(11, now=0)
    assert not backlog.BacklogGate(max_backlog=None, wait=False).active


def test_backlog_gate_waits_no_longer_than_its_deadline() -> None:
    gate = backlog.BacklogGate(max_backlog=10, wait=True, until=100.0)
    assert gate.delay_s(10, now=99.0) == 0.005
    assert gate.delay_s(10, now=99.995) == pytest.approx(0.005)  # cut to end at the deadline
    assert gate.delay_s(9, now=100.5) is None  # room: go ahead, late or not
    with pytest.raises(BacklogFull) as info:
        gate.delay_s(10, now=100.0)
    assert "timeout_s ran out" in str(info.value)
    assert "wait_for_backlog=True" not in str(info.value)  # it did wait: other advice
