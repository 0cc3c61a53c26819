"""Lanes from the producer side (issue 28, contract section 7): what ``priority=`` and
``tenant=`` make the clients and ``redbatch run`` write, on the module's own redis-server.

``MONITOR`` shows the commands as Redis ran them, so the tests see that a lane's request is
registered in the same ``MULTI`` as its ``XADD`` (``SADD`` first), and that the default lane is
sent as before: no ``SADD``, no lane set. Round trips go through ``LaneWorker``, a fake worker
that reads the lane streams it is given with ``XREADGROUP`` and writes the replies where a real
worker does (the shard's reply keys: replies are per shard, not per lane).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import redis
from fakes import MODEL, PREFIX, STREAM, answer, register_worker, xs

from producer.cli.main import main
from producer.client import lanes, lanesend, submission
from producer.protocol import keys
from producer.protocol.errors import BacklogFull
from producer.protocol.lanes import lane_stream, lanes_key
from producer.redisio import resp

if TYPE_CHECKING:
    from shells import Shell

pytest_plugins = ["shells"]

LANES = lanes_key(PREFIX, MODEL)
HIGH = lane_stream(PREFIX, MODEL, "high")
LOW = lane_stream(PREFIX, MODEL, "low")
ACME_LOW = lane_stream(PREFIX, MODEL, "low", "acme")
ACME_HIGH = lane_stream(PREFIX, MODEL, "high", "acme")
#: The commands that send a request, as MONITOR shows them (the others: reads of limits,
#: workers, shards and memory).
SENDING = ("MULTI", "SADD", "XADD", "EXEC", "XLEN")


# ---------------------------------------------------------------------------------------------
# Helpers


class Monitor:
    """The commands Redis runs while it is open (``MONITOR``), read up to a marker."""

    def __init__(self, url: str) -> None:
        self._conn = redis.Redis.from_url(url, socket_timeout=30)
        self._other = redis.Redis.from_url(url)
        self._monitor = self._conn.monitor()
        self._monitor.__enter__()

    def sending(self) -> list[list[str]]:
        """The sending commands run since the last call, each as its words (bodies cut)."""
        marker = "lanes-test-marker"
        self._other.echo(marker)
        seen = []
        while (command := self._monitor.next_command()["command"]) != f"ECHO {marker}":
            words = command.split(" ")
            if words[0] in SENDING:
                seen.append(words[:5] if words[0] == "XADD" else words)
        return seen

    def close(self) -> None:
        self._monitor.__exit__()
        self._conn.close()
        self._other.close()


@pytest.fixture
def monitor(redis_url: str) -> Iterator[Monitor]:
    watching = Monitor(redis_url)
    yield watching
    watching.close()


def xadd_of(stream: str, rid: str) -> list[str]:
    return ["XADD", stream, "*", "rid", rid]


class LaneWorker(threading.Thread):
    """Answers y = x * 2 to what it reads from ``streams`` (group ``workers``, as a worker
    would), replying in the shard's reply keys; ``seen`` holds (stream, rid) of each."""

    def __init__(self, url: str, streams: Sequence[str]) -> None:
        super().__init__(daemon=True)
        self.conn = redis.Redis.from_url(url, socket_timeout=30)
        self.streams = list(streams)
        self.seen: list[tuple[str, str]] = []
        self.error: BaseException | None = None
        self._halt = threading.Event()
        for stream in self.streams:
            self.conn.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                got = self.conn.xreadgroup(
                    keys.CONSUMER_GROUP, "lane-1", dict.fromkeys(self.streams, ">"), block=200
                )
                for stream, entries in got or []:
                    self._answer(stream.decode(), entries)
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def _answer(self, stream: str, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        pipe = self.conn.pipeline(transaction=False)
        for entry_id, fields in entries:
            rid, reply = answer(fields)
            self.seen.append((stream, rid))
            key = keys.reply_key(PREFIX, MODEL, rid)
            pipe.rpush(key, reply)
            pipe.expire(key, 60)
            pipe.xack(stream, keys.CONSUMER_GROUP, entry_id)
            pipe.xdel(stream, entry_id)
        pipe.execute()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)
        self.conn.close()
        if self.error is not None:
            raise self.error


@pytest.fixture
def lane_worker(redis_url: str) -> Iterator[Callable[..., LaneWorker]]:
    started: list[LaneWorker] = []

    def start(*streams: str) -> LaneWorker:
        worker = LaneWorker(redis_url, streams)
        worker.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


# ---------------------------------------------------------------------------------------------
# What each call writes


def test_submit_to_a_lane_registers_it_in_the_same_multi(
    client: Any, monitor: Monitor, rconn: redis.Redis
) -> None:
    handle = client.submit({"x": xs(1)}, priority="high")

    assert monitor.sending() == [
        ["MULTI"],
        ["SADD", LANES, HIGH],
        xadd_of(HIGH, handle),
        ["EXEC"],
    ]
    assert rconn.smembers(LANES) == {HIGH.encode()}
    assert rconn.xlen(HIGH) == 1
    assert not rconn.exists(STREAM)


def test_the_default_lane_is_sent_as_before_without_the_lane_set(
    client: Any, monitor: Monitor, rconn: redis.Redis
) -> None:
    one = client.submit({"x": xs(1)}, priority="normal", tenant=None)
    many = client.submit_many([{"x": xs(1)}, {"x": xs(2)}])

    assert monitor.sending() == [
        xadd_of(STREAM, one),  # one request: a bare XADD, as version 2 sends it
        ["MULTI"],
        *(xadd_of(STREAM, rid) for rid in many),
        ["EXEC"],
    ]
    assert not rconn.exists(LANES)
    assert rconn.xlen(STREAM) == 3


def test_submit_many_of_a_tenant_sends_one_multi_with_tenant_rids(
    client: Any, monitor: Monitor, rconn: redis.Redis
) -> None:
    handles = client.submit_many([{"x": xs(1)}] * 3, priority="low", tenant="acme")

    assert all(handle.startswith("acme.") and keys.is_valid_rid(handle) for handle in handles)
    assert len(set(handles)) == 3
    assert monitor.sending() == [
        ["MULTI"],
        ["SADD", LANES, ACME_LOW],
        *(xadd_of(ACME_LOW, rid) for rid in handles),
        ["EXEC"],
    ]
    entries = rconn.xrange(ACME_LOW)
    assert [fields[b"rid"].decode() for _, fields in entries] == handles


def test_a_tenant_without_a_class_goes_to_its_normal_lane(
    client: Any, monitor: Monitor, rconn: redis.Redis
) -> None:
    handle = client.submit({"x": xs(1)}, tenant="acme")

    normal = lane_stream(PREFIX, MODEL, "normal", "acme")
    assert normal == f"{STREAM}:normal:acme"
    assert monitor.sending() == [
        ["MULTI"],
        ["SADD", LANES, normal],
        xadd_of(normal, handle),
        ["EXEC"],
    ]
    assert rconn.smembers(LANES) == {normal.encode()}


@pytest.mark.parametrize(
    ("priority", "tenant", "message"),
    [
        ("urgent", None, "Priority 'urgent' is not a class: use one of high, normal, low"),
        ("HIGH", None, "is not a class"),
        (None, None, "is not a class"),
        ("high", "a.b", r"Tenant 'a\.b' does not match"),
        ("normal", "", "does not match"),
        ("low", "x" * 65, "does not match"),
    ],
)
def test_a_bad_priority_or_tenant_raises_before_anything_is_sent(
    client: Any, rconn: redis.Redis, priority: Any, tenant: Any, message: str
) -> None:
    lane = {"priority": priority, "tenant": tenant}
    with pytest.raises(ValueError, match=message):
        client.submit({"x": xs(1)}, **lane)
    with pytest.raises(ValueError, match=message):
        client.submit_many([{"x": xs(1)}], **lane)
    with pytest.raises(ValueError, match=message):
        client.infer({"x": xs(1)}, timeout_s=5, **lane)
    with pytest.raises(ValueError, match=message):
        client.map({"x": xs(4)}, rows_per_request=2, **lane)
    assert rconn.dbsize() == 0  # nothing sent: no stream, no lane set


def test_a_tenants_own_rid_must_carry_its_name(client: Any, rconn: redis.Redis) -> None:
    with pytest.raises(ValueError, match=r"must begin with 'acme\.': pass rid='acme\.r1'"):
        client.submit({"x": xs(1)}, rid="r1", tenant="acme")
    assert rconn.dbsize() == 0

    assert client.submit({"x": xs(1)}, rid="acme.r1", tenant="acme") == "acme.r1"
    assert client.submit({"x": xs(1)}, rid="r2", priority="high") == "r2"  # no tenant: any rid


def test_the_backlog_check_reads_only_the_lane_it_sends_to(
    shell: Shell, redis_url: str, monitor: Monitor, rconn: redis.Redis
) -> None:
    # Given a default lane far over the limit, and the tenant's high lane at it
    for i in range(5):
        rconn.xadd(STREAM, {"rid": f"d{i}", "body": b"x"})
    with shell.Client(MODEL, redis_url, max_backlog=2) as client:
        first = client.submit({"x": xs(1)}, priority="high", tenant="acme")
        client.submit({"x": xs(1)}, priority="high", tenant="acme")
        sent = monitor.sending()

        # Then it sent both, having read the XLEN of its own lane only
        assert [words for words in sent if words[0] == "XLEN"] == [["XLEN", ACME_HIGH]] * 2
        assert xadd_of(ACME_HIGH, first) in sent

        # And a third finds its own lane full
        with pytest.raises(BacklogFull):
            client.submit({"x": xs(1)}, priority="high", tenant="acme")
    assert rconn.xlen(ACME_HIGH) == 2


# ---------------------------------------------------------------------------------------------
# Round trips through a fake lane worker


def test_infer_round_trips_through_a_lane(
    client: Any, lane_worker: Callable[..., LaneWorker], monitor: Monitor
) -> None:
    worker = lane_worker(ACME_HIGH)

    y = client.infer({"x": xs(2)}, timeout_s=20, priority="high", tenant="acme")

    np.testing.assert_array_equal(y["y"], xs(2) * 2)
    [(stream, rid)] = worker.seen
    assert stream == ACME_HIGH
    assert rid.startswith("acme.")
    assert monitor.sending()[:2] == [["MULTI"], ["SADD", LANES, ACME_HIGH]]


def test_wait_poll_and_cancel_of_a_lane_request_use_the_shards_keys(
    client: Any, lane_worker: Callable[..., LaneWorker], rconn: redis.Redis
) -> None:
    handle = client.submit({"x": xs(1)}, priority="low", tenant="acme")
    client.cancel(handle, ttl_s=60)
    assert rconn.exists(keys.cancel_key(PREFIX, MODEL, handle))

    lane_worker(ACME_LOW)  # the fake worker ignores cancel keys: it answers anyway
    result = client.wait(handle, timeout_s=20)
    assert result.ok
    assert result.rid == handle

    other = client.submit({"x": xs(1)}, priority="low", tenant="acme")
    assert client.wait(other, timeout_s=20).ok
    assert client.poll(other) is None  # consumed by wait, as on the default lane


def test_map_sends_every_request_to_its_lane(
    client: Any, lane_worker: Callable[..., LaneWorker], rconn: redis.Redis
) -> None:
    register_worker(rconn, "fake-1", 64)
    worker = lane_worker(ACME_LOW)
    x = xs(10)

    chunks = list(
        client.map({"x": x}, rows_per_request=3, concurrency=2, priority="low", tenant="acme")
    )

    assert [(c.start, c.stop) for c in chunks] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    np.testing.assert_array_equal(np.concatenate([c.outputs["y"] for c in chunks]), x * 2)
    assert {stream for stream, _ in worker.seen} == {ACME_LOW}
    assert all(c.rid.startswith("acme.") for c in chunks)
    assert rconn.smembers(LANES) == {ACME_LOW.encode()}
    assert not rconn.exists(STREAM)


def test_concurrent_async_submits_to_several_lanes_each_reach_their_own(
    redis_url: str, rconn: redis.Redis, monitor: Monitor
) -> None:
    import asyncio

    from producer.client.aio import AsyncClient

    async def submit_all() -> list[str]:
        async with AsyncClient(MODEL, redis_url) as client:
            return list(
                await asyncio.gather(
                    client.submit({"x": xs(1)}),
                    client.submit({"x": xs(1)}, priority="high"),
                    client.submit({"x": xs(1)}, priority="low", tenant="acme"),
                    client.submit({"x": xs(1)}, priority="high"),
                )
            )

    default, high1, acme, high2 = asyncio.run(submit_all())

    def rids(stream: str) -> list[str]:
        return [fields[b"rid"].decode() for _, fields in rconn.xrange(stream)]

    assert rids(STREAM) == [default]
    assert sorted(rids(HIGH)) == sorted([high1, high2])
    assert rids(ACME_LOW) == [acme]
    assert rconn.smembers(LANES) == {HIGH.encode(), ACME_LOW.encode()}
    sent = monitor.sending()
    assert ["SADD", LANES, HIGH] in sent
    assert ["SADD", LANES, ACME_LOW] in sent
    # every lane XADD sits in a MULTI that opened with its lane's SADD
    for at, words in enumerate(sent):
        if words[0] == "XADD" and words[1] != STREAM:
            opened = max(i for i in range(at) if sent[i] == ["MULTI"])
            assert sent[opened + 1] == ["SADD", LANES, words[1]]


# ---------------------------------------------------------------------------------------------
# Packing: both forms of the commands, one layout


def test_lane_xadds_packed_and_queued_send_the_same_and_check_their_replies(
    rconn: redis.Redis,
) -> None:
    high, acme = lanes.choose("high", None), lanes.choose("low", "acme")
    subs = [submission.Submission(f"r{i}", b"b") for i in range(3)]
    subs[1].lane, subs[2].lane = high, acme
    sent = lanesend.lane_xadds(PREFIX, MODEL, subs)
    # the default lane's one entry stays a bare XADD; each lane's is a MULTI of its own
    assert sent.xadds.blocks == ((1, False), (1, True), (1, True))
    assert sent.xadds.sadds == frozenset({1, 2})

    replies = resp.round_trip(rconn, sent.xadds.packer)
    sent.check(replies)
    pipe = rconn.pipeline(transaction=False)
    sent.queue(pipe)
    queued = pipe.execute(raise_on_error=False)
    assert len(queued) == len(replies) == sent.xadds.packer.count
    sent.check(queued)

    assert rconn.xlen(STREAM) == rconn.xlen(HIGH) == rconn.xlen(ACME_LOW) == 2
    assert rconn.smembers(LANES) == {HIGH.encode(), ACME_LOW.encode()}


def test_a_lanes_transaction_error_is_raised(rconn: redis.Redis) -> None:
    rconn.set(HIGH, "not a stream")
    sub = submission.Submission("r1", b"b", lane=lanes.choose("high", None))
    sent = lanesend.lane_xadds(PREFIX, MODEL, [sub])
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        sent.check(resp.round_trip(rconn, sent.xadds.packer))


# ---------------------------------------------------------------------------------------------
# redbatch run


def _run(redis_url: str, tmp_path: Path, *extra: str) -> int:
    np.save(tmp_path / "x.npy", xs(6))
    return main(["--redis-url", redis_url, "run", "--model", MODEL, "--input",
                 str(tmp_path / "x.npy"), "--input-name", "x", "--output",
                 str(tmp_path / "y.npz"), "--no-progress", *extra])  # fmt: skip


def test_run_sends_to_the_low_lane_by_default(
    redis_url: str, rconn: redis.Redis, tmp_path: Path, lane_worker: Callable[..., LaneWorker]
) -> None:
    register_worker(rconn, "fake-1", 64)
    worker = lane_worker(LOW)

    assert _run(redis_url, tmp_path) == 0

    np.testing.assert_array_equal(np.load(tmp_path / "y.npz")["y"], xs(6) * 2)
    assert len(worker.seen) == 6
    assert {stream for stream, _ in worker.seen} == {LOW}
    assert rconn.smembers(LANES) == {LOW.encode()}


def test_run_priority_and_tenant_choose_the_lane(
    redis_url: str, rconn: redis.Redis, tmp_path: Path, lane_worker: Callable[..., LaneWorker]
) -> None:
    register_worker(rconn, "fake-1", 64)
    worker = lane_worker(ACME_HIGH)

    assert _run(redis_url, tmp_path, "--priority", "high", "--tenant", "acme") == 0

    np.testing.assert_array_equal(np.load(tmp_path / "y.npz")["y"], xs(6) * 2)
    assert {stream for stream, _ in worker.seen} == {ACME_HIGH}
    assert all(rid.startswith("acme.") for _, rid in worker.seen)


def test_run_priority_normal_is_the_default_lane(
    redis_url: str, rconn: redis.Redis, tmp_path: Path, lane_worker: Callable[..., LaneWorker]
) -> None:
    register_worker(rconn, "fake-1", 64)
    worker = lane_worker(STREAM)

    assert _run(redis_url, tmp_path, "--priority", "normal") == 0
    assert len(worker.seen) == 6
    assert not rconn.exists(LANES)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--priority", "urgent"], "invalid choice: 'urgent'"),
        (["--tenant", "a.b"], "argument --tenant: 'a.b' does not match [A-Za-z0-9_-]{1,64}"),
    ],
)
def test_run_refuses_a_bad_priority_or_tenant(
    redis_url: str,
    rconn: redis.Redis,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    assert _run(redis_url, tmp_path, *extra) == 2
    assert message in capsys.readouterr().err
    assert rconn.dbsize() == 0


def test_run_help_says_a_run_is_a_low_batch_job(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "default: low, a batch job" in out
    assert "--tenant NAME" in out
