"""The clients' logic without Redis: the sans-I/O pieces (``core``, ``window``, ``connection``),
and the plans (``producer.client.plans``) driven by a scripted shell that answers each step
itself."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis.exceptions as rex
from fakes import FAKE_MODEL, MODEL, PREFIX, xs

import producer
from producer.client import driver, mapwindow, plans, steps, submission, waiting
from producer.client.session import Session
from producer.client.settings import MAX_SPAN_S, Settings, check_timeout_s, check_ttl_s
from producer.protocol import codec
from producer.protocol.codec import Reply
from producer.protocol.errors import RedisFull, WaitTimeout
from producer.redisio import connection
from producer.redisio.memory import MemoryWatch
from producer.redisio.retry import RetryPolicy
from producer.redisio.shards import Shards

SETTINGS = Settings.create(MODEL, PREFIX, None, False)


def fake_reply(rid: str, rows: int) -> bytes:
    outputs = {"y": np.full((rows, 1), 1.0, np.float32)}
    reply = Reply(rid, True, FAKE_MODEL, "w", {}, outputs=outputs, batch_rows=rows)
    return codec.encode_reply(reply)


def make_plan(rows: int, rows_per_request: int, concurrency: int) -> mapwindow.MapPlan:
    return mapwindow.MapPlan(
        SETTINGS,
        {"x": np.zeros((rows, 1), np.float32)},
        rows_per_request=rows_per_request,
        concurrency=concurrency,
        outputs=None,
        timeout_s=5,
    )


def send(plan: mapwindow.MapPlan) -> list[submission.Submission]:
    subs = plan.take(now_s=0)
    plan.sent(subs, now=0)
    return subs


def reply(plan: mapwindow.MapPlan, subs: list[submission.Submission]) -> None:
    """Feed replies for ``subs`` through the plan's waiter, as a pipelined LPOP would."""
    reply_keys = [SETTINGS.reply_key(s.rid).encode() for s in subs]
    raws = [fake_reply(s.rid, 1) for s in subs]
    plan.answered(plan.waiter.take_popped(reply_keys, raws), now=0.25)


def test_map_plan_yields_in_input_order_whatever_order_replies_come_in() -> None:
    plan = make_plan(rows=10, rows_per_request=3, concurrency=2)
    first, second = send(plan)
    assert send(plan) == []  # the window is full

    reply(plan, [second])
    assert plan.ready() == []  # rows 0-3 are still outstanding
    [third] = send(plan)
    reply(plan, [first])

    ready = plan.ready()
    assert [(c.start, c.stop) for c in ready] == [(0, 3), (3, 6)]
    assert [c.latency_ms for c in ready] == [250.0, 250.0]  # sent at 0, answered at 0.25
    assert ready[0].result.rid == ready[0].rid == first.rid
    reply(plan, [third, *send(plan)])
    assert [(c.start, c.stop) for c in plan.ready()] == [(6, 9), (9, 10)]
    assert plan.finished
    assert plan.waiter.pending == 0


def test_map_plan_holds_at_most_twice_concurrency_behind_a_slow_head() -> None:
    plan = make_plan(rows=100, rows_per_request=1, concurrency=2)
    _head, *rest = send(plan)
    sent = 2
    for _ in range(10):  # everything but the head is answered at once
        reply(plan, rest)
        rest = send(plan)
        sent += len(rest)

    assert sent == 4
    assert plan.waiter.pending == 1
    assert plan.ready() == []


def test_reply_waiter_blocks_until_the_first_deadline_then_times_out() -> None:
    waiter = waiting.ReplyWaiter(SETTINGS, timeout_s=5)
    waiter.add("a", now=100)
    waiter.add("b", now=101)
    assert waiter.block_s(now=100, cap_s=2) == 2
    assert waiter.block_s(now=104.9999, cap_s=2) == 0.001  # never 0, which blocks forever
    assert waiter.block_s(now=106, cap_s=2) == 0.001  # a late request still gets one look
    assert waiter.take_blpopped(None, now=104) == []
    with pytest.raises(WaitTimeout, match="for 1 request\\(s\\) to model 'demo': a\\. "):
        waiter.take_blpopped(None, now=105)


def test_deadlines_and_ttls_up_to_the_longest_span_are_accepted() -> None:
    sub = submission.build_submission(
        {"x": xs(1)}, deadline_s=MAX_SPAN_S, reply_ttl_s=MAX_SPAN_S, now_s=2e9
    )
    body = codec.decode_request(sub.body, max_bytes=1 << 20)
    assert body.deadline_ms == (2e9 + MAX_SPAN_S) * 1000
    assert body.reply_ttl_s == MAX_SPAN_S


def test_a_numpy_ttl_and_an_unlimited_timeout_are_taken() -> None:
    assert check_ttl_s("ttl_s", np.int64(60)) == 60
    assert type(check_ttl_s("ttl_s", np.int64(60))) is int  # as Redis's client wants it
    assert check_timeout_s(math.inf) == math.inf  # wait with no limit, as before


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@host:6379/0", "redis://host:6379/0"),
        ("rediss://alice:pw@host/2", "rediss://alice@host/2"),
        ("redis://host:1/0?password=pw&db=1", "redis://host:1/0?db=1"),
        ("unix:///tmp/r.sock?password=pw", "unix:///tmp/r.sock"),
    ],
)
def test_redact_url_drops_passwords(url: str, shown: str) -> None:
    assert connection.redact_url(url) == shown


def test_block_cap_stays_under_the_socket_timeout() -> None:
    assert connection.block_cap_s(None) == connection.MAX_BLOCK_S
    assert connection.block_cap_s(5) == 2.0
    assert connection.block_cap_s(1) == 0.5


def test_package_exports_exactly_its_public_names() -> None:
    # dir(): AsyncClient is imported at first use, so it is not in vars() until then
    public = {
        name
        for name in dir(producer)
        if not name.startswith("_")
        and not inspect.ismodule(getattr(producer, name))
        and name != "annotations"
    }
    assert sorted(producer.__all__) == sorted(public)


def test_both_clients_have_the_same_public_methods_and_signatures() -> None:
    def api(cls: type) -> dict[str, inspect.Signature]:
        return {
            name: inspect.signature(getattr(cls, name))
            for name in dir(cls)
            if not name.startswith("_") and callable(getattr(cls, name))
        }

    sync, aio = api(producer.Client), api(producer.AsyncClient)
    assert sync.keys() == aio.keys()
    for name, signature in sync.items():
        assert list(signature.parameters) == list(aio[name].parameters), name
    assert inspect.signature(producer.Client) == inspect.signature(producer.AsyncClient)


# ---------------------------------------------------------------------------------------------
# Plans, driven by a scripted shell


def session(*, max_backlog: int | None = None, wait: bool = False) -> Session:
    settings = Settings.create(MODEL, PREFIX, max_backlog, wait)
    where = "redis://test"
    return Session(
        settings, where, 2.0, RetryPolicy(where, 0), True, MemoryWatch(where, 0.8), lambda r: None
    )


def drive(plan: steps.Plan[Any], answer: Callable[[Any], Any], stop_after: int = -1) -> Any:
    """Run ``plan`` as a shell would, with ``answer(step)`` for each command's answer (it may
    raise); returns (its result, the steps it took, its outputs). After ``stop_after``
    outputs, the caller stops iterating, as closing the iterator does."""
    stepper = driver.Stepper(plan)
    taken: list[Any] = []
    outputs: list[Any] = []
    while (step := stepper.step()) is not driver.DONE:
        if isinstance(step, steps.Step):
            taken.append(step)
            if isinstance(step, steps.Sleep):
                continue
            try:
                stepper.answer(answer(step))
            except Exception as exc:
                stepper.fail(exc)
            continue
        outputs.append(step)
        if len(outputs) == stop_after:
            stepper.fail(GeneratorExit())
    return stepper.result, taken, outputs


def names(taken: list[Any]) -> list[str]:
    return [f"sleep {t.seconds:g}" if isinstance(t, steps.Sleep) else t.name for t in taken]


INFO_ROOM = "used_memory:100\r\nmaxmemory:1000\r\nmaxmemory_policy:noeviction\r\n"
ONE_SHARD = [Shards.single(MODEL)]  # the shard-list read's answer: one part, one shard


def room(step: Any) -> Any:
    """What a shell hands back for a command the test does not script: one shard, room in
    Redis memory, and nothing else."""
    if step.name == "LRANGE":
        return ONE_SHARD
    return INFO_ROOM if step.name == "INFO" else []


def test_send_looks_again_after_each_backoff_until_the_backlog_has_room() -> None:
    backlogs = iter([5, 5, 2])

    def answer(step: Any) -> Any:
        if step.name == "XLEN":
            return [next(backlogs)]  # one shard's
        return room(step)

    sub = submission.build_submission({"x": xs(1)}, now_s=0)
    _, taken, _ = drive(plans.send(session(max_backlog=3, wait=True), [sub]), answer)
    assert names(taken) == [
        "LRANGE", "XLEN", "sleep 0.005", "XLEN", "sleep 0.01", "XLEN", "INFO", "XADD"
    ]  # fmt: skip


@pytest.mark.parametrize("wait", [False, True])
def test_a_write_redis_refuses_for_memory_is_refused_or_waited_out(wait: bool) -> None:
    refused: list[bool] = []

    def answer(step: Any) -> Any:
        if step.name == "XADD" and not refused:
            refused.append(True)
            raise RedisFull("redis://test", None, None, None, refused="OOM command not allowed")
        return room(step)

    sub = submission.build_submission({"x": xs(1)}, now_s=0)
    one = session(wait=wait)
    if not wait:
        with pytest.raises(RedisFull, match="OOM command not allowed"):
            drive(plans.send(one, [sub]), answer)
        return
    _, taken, _ = drive(plans.send(one, [sub]), answer)
    # The refusal made the reading stale: memory is read again before the next try
    assert names(taken) == ["LRANGE", "INFO", "XADD", "sleep 0.005", "INFO", "XADD"]
    assert one.full_seen is None  # what held the send up is forgotten once it is sent


def test_a_pop_that_needed_a_retry_marks_the_wait_interrupted() -> None:
    waiter = waiting.ReplyWaiter(SETTINGS, timeout_s=0)
    waiter.add("a", now=0)

    def answer(step: Any) -> Any:
        step.tries = 2  # the shell retried it: a reply may have been lost with a connection
        return [[None]] if step.name == "LPOP" else None  # LPOP: one shard's part

    with pytest.raises(WaitTimeout):
        drive(plans.wait_round(session(), waiter), answer)
    assert waiter.interrupted


class Recorder:
    """A stand-in redis-py pipeline that notes the keys SET on it."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    def set(self, key: str, value: bytes, ex: int) -> None:
        self.keys.append(key)


def test_a_map_stopped_early_cancels_what_is_in_flight_before_it_ends() -> None:
    plan = make_plan(rows=10, rows_per_request=1, concurrency=4)
    cancelled: list[str] = []

    def answer(step: Any) -> Any:
        if step.name == "LPOP":  # only the first request's reply is there
            return [[fake_reply("r", 1)] + [None] * (len(plan.waiter.keys()) - 1)]
        if step.name == "SET":
            for part in step.parts:
                part.queue(Recorder(cancelled))
        return room(step)

    with pytest.raises(GeneratorExit):
        drive(plans.run_map(session(), plan), answer, stop_after=1)
    assert len(cancelled) == 4  # the window was refilled before the chunk was yielded
    assert sorted(cancelled) == sorted(SETTINGS.cancel_key(rid, tag) for tag, rid in plan.in_flight)


def test_poll_finds_a_kept_reply_without_a_round_trip() -> None:
    result, taken, _ = drive(
        plans.poll(session(), "r1", kept=lambda key: fake_reply("r1", 1)), answer=list
    )
    assert taken == []
    assert result.ok


def test_a_redis_error_goes_back_into_the_plan_where_it_yielded() -> None:
    def answer(step: Any) -> Any:
        raise rex.ConnectionError("down")

    with pytest.raises(rex.ConnectionError):
        drive(plans.backlog(session()), answer)
