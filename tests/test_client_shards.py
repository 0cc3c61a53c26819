"""A model whose queue has several shards (contract v2, section 1), through both clients
(``shell``) on a single Redis: submits spread over the listed shards and return handles that
name theirs; polls, waits, cancels and map find each request in its shard; a shard added to
the list gets traffic once the client reads it again. Also the sans-I/O pieces that do it
(``ShardSpread``, ``ReplyWaiter``'s turns, ``steps.settle``, ``steps.Routing``), and one smoke
test on a real Redis Cluster."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import redis
import redis.exceptions as rex
from fakes import MODEL, PREFIX, FakeReplier, answer, xs

from producer.client import driver, mapwindow, plans, results, steps, submission, waiting
from producer.client import routing as routing_module
from producer.client.blocking import Client
from producer.client.routing import Routing, ShardSpread
from producer.client.session import Session
from producer.client.settings import Settings
from producer.protocol import keys
from producer.protocol.errors import BacklogFull, RedisFull
from producer.redisio import resp, shards
from producer.redisio.memory import MemoryWatch
from producer.redisio.retry import RetryPolicy
from producer.redisio.shards import Shards

if TYPE_CHECKING:
    from shells import Shell

pytest_plugins = ["shells"]

TAGS = (MODEL, f"{MODEL}~b", f"{MODEL}~c")
SETTINGS = Settings.create(MODEL, PREFIX, None, False)


def list_shards(conn: redis.Redis, tags: tuple[str, ...] = TAGS) -> None:
    """Write ``P:{M}:shards`` as an operator's ``redbatch shards place`` would."""
    conn.delete(keys.shards_key(PREFIX, MODEL))
    conn.rpush(keys.shards_key(PREFIX, MODEL), *tags)


def xlens(conn: redis.Redis, tags: tuple[str, ...] = TAGS) -> list[int]:
    return [conn.xlen(keys.request_stream(PREFIX, tag)) for tag in tags]


def rids_in(conn: redis.Redis, tag: str) -> set[str]:
    entries = conn.xrange(keys.request_stream(PREFIX, tag))
    return {fields[b"rid"].decode() for _, fields in entries}


@pytest.fixture
def sharded(rconn: redis.Redis) -> None:
    list_shards(rconn)


@pytest.fixture
def replier3(redis_url: str, sharded: None) -> Iterator[FakeReplier]:
    fake = FakeReplier(redis_url, TAGS).start()
    yield fake
    fake.stop()


# ---------------------------------------------------------------------------------------------
# Through both clients, on one Redis


@pytest.mark.usefixtures("sharded")
def test_submits_spread_evenly_and_handles_name_the_shard(client: Any, rconn: redis.Redis) -> None:
    # When 30 requests go one by one, then 30 at once
    one_by_one = [client.submit({"x": xs(1)}) for _ in range(30)]
    at_once = client.submit_many([{"x": xs(1)}] * 30)

    # Then every shard got a third of each, whichever shard came first
    assert xlens(rconn) == [20, 20, 20]
    order = [SETTINGS.target(h)[0] for h in one_by_one]
    assert sorted(order[:3]) == sorted(TAGS)  # each in turn
    assert order[3:6] == order[:3]
    # And each handle names the shard whose stream holds its request: the bare rid on the first
    for handle in one_by_one + at_once:
        tag, rid = SETTINGS.target(handle)
        assert rid in rids_in(rconn, tag)
        assert handle == (rid if tag == MODEL else f"{tag}/{rid}")
    assert client.backlog() == 60  # the sum over the shards


def test_a_model_without_a_shard_list_keeps_rids_as_handles(
    client: Any, rconn: redis.Redis
) -> None:
    handles = [client.submit({"x": xs(1)}), *client.submit_many([{"x": xs(1)}] * 3)]
    assert all("/" not in h for h in handles)
    assert rids_in(rconn, MODEL) == set(handles)


@pytest.mark.usefixtures("replier3")
def test_wait_and_wait_many_take_handles_of_every_shard(client: Any) -> None:
    handles = client.submit_many([{"x": xs(1) + i} for i in range(12)])
    first = client.wait(handles[0], timeout_s=10)
    results = {r.handle: r for r in client.wait_many(handles[1:], timeout_s=10)}

    assert first.handle == handles[0]
    assert results.keys() == set(handles[1:])
    for i, handle in enumerate(handles):
        result = first if i == 0 else results[handle]
        tag, rid = SETTINGS.target(handle)
        assert (result.rid, result.shard) == (rid, tag)  # the rid as ever, and its shard
        np.testing.assert_array_equal(result.outputs["y"], (xs(1) + i) * 2)
    assert {SETTINGS.target(h)[0] for h in handles} == set(TAGS)


@pytest.mark.usefixtures("sharded")
def test_poll_and_cancel_find_the_request_in_its_shard(client: Any, rconn: redis.Redis) -> None:
    # Given a request on each shard, and a reply written for each by hand
    handles = client.submit_many([{"x": xs(1)}] * 3)
    targets = [SETTINGS.target(h) for h in handles]
    assert {tag for tag, _ in targets} == set(TAGS)
    for (tag, _), handle in zip(targets, handles, strict=True):
        assert client.poll(handle) is None
        [(_, fields)] = rconn.xrange(keys.request_stream(PREFIX, tag))
        rid, raw = answer(fields)
        rconn.rpush(keys.reply_key(PREFIX, tag, rid), raw)

    # Then polling by handle finds it, and leaves it there
    for (tag, rid), handle in zip(targets, handles, strict=True):
        result = client.poll(handle)
        assert (result.rid, result.shard, result.handle) == (rid, tag, handle)
        assert rconn.llen(keys.reply_key(PREFIX, tag, rid)) == 1

    # And a cancel sets the cancel key in the request's own shard, nowhere else
    tag, rid = next(t for t in targets if t[0] != MODEL)
    client.cancel(keys.handle(tag, rid), ttl_s=60)
    assert rconn.get(keys.cancel_key(PREFIX, tag, rid)) == b"1"
    assert not rconn.exists(keys.cancel_key(PREFIX, MODEL, rid))


@pytest.mark.usefixtures("sharded")
def test_infer_is_answered_on_whichever_shard_it_went_to(
    client: Any, redis_url: str, rconn: redis.Redis
) -> None:
    fake = FakeReplier(redis_url, TAGS).start()
    try:
        for i in range(6):  # twice round the shards
            np.testing.assert_array_equal(client.infer({"x": xs(1) + i})["y"], (xs(1) + i) * 2)
    finally:
        fake.stop()
    assert sorted(fake.answered.values()) == [2, 2, 2]


@pytest.mark.usefixtures("replier3")
def test_map_over_three_shards_yields_every_row_in_order(client: Any) -> None:
    x = xs(100)
    chunks = list(client.map({"x": x}, rows_per_request=3, concurrency=8, timeout_s=10))

    assert [(c.start, c.stop) for c in chunks] == [(i, min(i + 3, 100)) for i in range(0, 100, 3)]
    assert all(c.ok for c in chunks)
    np.testing.assert_array_equal(np.concatenate([c.outputs["y"] for c in chunks]), x * 2)
    shards_used = [c.result.shard for c in chunks]
    assert {t: shards_used.count(t) for t in TAGS} in (
        {TAGS[0]: 11, TAGS[1]: 11, TAGS[2]: 12},
        {TAGS[0]: 11, TAGS[1]: 12, TAGS[2]: 11},
        {TAGS[0]: 12, TAGS[1]: 11, TAGS[2]: 11},
    )  # 34 requests: even, whichever shard came first


def test_a_map_stopped_early_cancels_each_request_in_its_shard(
    client: Any, rconn: redis.Redis, sharded: None
) -> None:
    # No replier: the first window stays in flight
    chunks = client.map({"x": xs(30)}, rows_per_request=1, concurrency=6, timeout_s=0.3)
    next(chunks)  # a WAIT_TIMEOUT: that window's requests were given up on, and cancelled
    chunks.close()  # and the refilled window is cancelled on the way out
    for tag in TAGS:
        cancelled = {k.decode().rpartition(":")[2] for k in rconn.keys(cancel_pattern(tag))}
        assert cancelled, tag
        assert cancelled <= rids_in(rconn, tag)  # each in its own request's shard
    assert sum(len(rconn.keys(cancel_pattern(tag))) for tag in TAGS) == 12


def cancel_pattern(tag: str) -> str:
    return f"{PREFIX}:{{{tag}}}:cancel:*"


def test_a_shard_added_while_a_client_runs_gets_traffic_after_the_refresh(
    client: Any, rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a client that has read the shard list (absent: one shard) and keeps it for long
    monkeypatch.setattr(shards, "REFRESH_S", 3600.0)
    client.submit_many([{"x": xs(1)}] * 3)
    # When a shard is added, the client sends on as it was until it reads the list again
    list_shards(rconn, TAGS[:2])
    client.submit_many([{"x": xs(1)}] * 4)
    assert xlens(rconn, TAGS[:2]) == [7, 0]
    # Then once the list is due again (REFRESH_S passed), the new shard takes its share
    monkeypatch.setattr(shards, "REFRESH_S", 0.0)
    handles = client.submit_many([{"x": xs(1)}] * 4)
    assert xlens(rconn, TAGS[:2]) == [9, 2]
    assert sum("/" in h for h in handles) == 2


@pytest.mark.usefixtures("sharded")
def test_the_backlog_limit_counts_every_shard(shell: Shell, redis_url: str) -> None:
    with shell.Client(MODEL, redis_url, max_backlog=6) as client:
        client.submit_many([{"x": xs(1)}] * 6)  # two per shard: each below 6, the sum at it
        with pytest.raises(BacklogFull):
            client.submit({"x": xs(1)})
        assert client.backlog() == 6


# ---------------------------------------------------------------------------------------------
# The pieces, without Redis


def subs(n: int) -> list[submission.Submission]:
    return [submission.Submission(f"r{i}", b"") for i in range(n)]


def test_the_spread_round_robins_from_a_random_start_and_keeps_a_resent_shard() -> None:
    spread = ShardSpread(MODEL)
    spread.seen(Shards(MODEL, TAGS), now=0)
    one = [next(iter(spread.assign(subs(1)))) for _ in range(6)]
    assert sorted(one[:3]) == sorted(TAGS)  # each in turn
    assert one[3:] == one[:3]
    by_tag = spread.assign(subs(10))
    assert sorted(len(v) for v in by_tag.values()) == [3, 3, 4]  # evenly
    resent = submission.Submission("again", b"", TAGS[2])
    assert spread.assign([resent]) == {TAGS[2]: [resent]}
    starts = {next(iter(ShardSpread(MODEL).assign(subs(1)))) for _ in range(50)}
    assert starts == {MODEL}  # one shard until the list is read
    spread_starts = set()
    for _ in range(60):
        fresh = ShardSpread(MODEL)
        fresh.seen(Shards(MODEL, TAGS), now=0)
        spread_starts.add(next(iter(fresh.assign(subs(1)))))
    assert spread_starts == set(TAGS)  # clients do not all start on the same shard


def test_the_spread_is_read_again_once_refresh_s_old(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shards, "REFRESH_S", 5.0)
    spread = ShardSpread(MODEL)
    assert spread.stale(now=0)
    spread.seen(Shards.single(MODEL), now=100)
    assert not spread.stale(now=104.9)
    assert spread.stale(now=105)


def test_a_wait_over_several_shards_blocks_on_each_in_turn_briefly() -> None:
    waiter = waiting.ReplyWaiter(SETTINGS, timeout_s=30)
    for i, tag in enumerate([*TAGS, MODEL]):
        waiter.add(f"r{i}", now=0, tag=tag)
    turns = [waiter.blpop_keys() for _ in range(4)]
    assert [t for t, _, _ in turns] == [MODEL, TAGS[1], TAGS[2], MODEL]
    assert turns[0][1] == [SETTINGS.reply_key("r0").encode(), SETTINGS.reply_key("r3").encode()]
    assert all(shared for _, _, shared in turns)
    assert waiter.block_s(now=0, cap_s=2, shared=True) == waiting.SHARD_TURN_S
    # One shard left: the BLPOP blocks until the first deadline (at most the cap)
    waiter.take_popped([SETTINGS.reply_key("r1", TAGS[1]).encode()], [fake_reply_for("r1")])
    waiter.take_popped([SETTINGS.reply_key("r2", TAGS[2]).encode()], [fake_reply_for("r2")])
    assert waiter.blpop_keys()[2] is False
    assert waiter.block_s(now=0, cap_s=2) == 2


def test_a_wait_timeout_names_the_late_requests_by_handle() -> None:
    waiter = waiting.ReplyWaiter(SETTINGS, timeout_s=1)
    waiter.add("r1", now=0, tag=TAGS[1])
    with pytest.raises(Exception, match=f"{TAGS[1]}/r1"):
        waiter.take_blpopped(None, now=2)


def part(tag: str, replies: int) -> steps.Part:
    packer = resp.Packer()
    for _ in range(replies):
        packer.add(b"PING")
    return steps.Part(tag, lambda pipe: None, packer)


def test_a_part_that_failed_is_sent_again_alone() -> None:
    # Given a batch over two shards, whose second part got an error reply
    batch = steps.Batch("XADD", None, [part(TAGS[0], 2), part(TAGS[1], 1)])  # type: ignore[arg-type]
    driver.packed(batch.parts)
    with pytest.raises(rex.BusyLoadingError, match="LOADING"):
        driver.settle(batch.parts, [b"a", b"b", rex.BusyLoadingError("LOADING")])
    # Then the first is done with its answer, and a retry sends the second only
    assert [p.done for p in batch.parts] == [True, False]
    assert batch.parts[0].answer == [b"a", b"b"]


class StubTopology:
    cluster = True

    def __init__(self) -> None:
        self.followed: list[BaseException] = []

    def follow(self, exc: BaseException) -> bool:
        self.followed.append(exc)
        return True

    def client(self, tag: str) -> str:
        return f"client of {tag}"


def test_routing_follows_moved_and_reads_the_map_again_after_other_trouble(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topology = StubTopology()
    routing = Routing(topology, MODEL)
    assert routing.refresh_due()  # before the first command
    routing.refreshed()
    assert routing.client(None) == routing.client(MODEL) == f"client of {MODEL}"

    moved = rex.MovedError("903 127.0.0.1:7001")
    routing.failed(moved)
    assert topology.followed == [moved]
    assert not routing.refresh_due()  # MOVED names the new master: no map to read

    routing.failed(rex.ConnectionError("master gone"))  # a failover under way
    assert not routing.refresh_due()  # not twice within REFRESH_MIN_S
    monkeypatch.setattr(routing_module, "REFRESH_MIN_S", 0.0)
    assert routing.refresh_due()
    routing.refreshed()
    routing.failed(rex.TryAgainError("TRYAGAIN"))
    assert routing.refresh_due()


# ---------------------------------------------------------------------------------------------
# Redis Cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    localcluster = pytest.importorskip("tools.localcluster")
    try:
        with localcluster.LocalCluster(masters=3, replicas=0) as started:
            yield started
    except localcluster.RedisNotInstalled as exc:
        pytest.skip(str(exc))


def test_client_on_a_cluster_spreads_over_shards_on_three_masters(cluster: Any) -> None:
    from redis.cluster import RedisCluster

    from producer.redisio.topology import Topology
    from tools.bench.shards import place_shards

    # Given three shards placed on three distinct masters, and a replier on each
    seed = redis.Redis.from_url(cluster.url)
    topology = Topology(seed)
    topology.refresh()
    tags = tuple(place_shards(MODEL, 3, topology.slots.node))
    assert len({topology.node_of(tag) for tag in tags}) == 3
    topology.client(MODEL).rpush(keys.shards_key(PREFIX, MODEL), *tags)
    fake = FakeReplier(cluster.url, tags).start()
    try:
        # When a Client seeded with a RedisCluster sends 300 requests and waits for them
        with RedisCluster.from_url(cluster.url) as rc, Client(MODEL, redis_client=rc) as client:
            handles = client.submit_many([{"x": xs(1) + i} for i in range(150)])
            handles += [client.submit({"x": xs(1) + 150 + i}) for i in range(150)]
            results = {r.handle: r for r in client.wait_many(handles, timeout_s=30)}
    finally:
        fake.stop()
        topology.close()
        seed.close()
    # Then every one is answered, from its own shard, and each master served a third
    assert results.keys() == set(handles)
    for i, handle in enumerate(handles):
        np.testing.assert_array_equal(results[handle].outputs["y"], (xs(1) + i) * 2)
    assert sorted(fake.answered.values()) == [100, 100, 100]


def fake_reply_for(rid: str) -> bytes:
    """A reply element for ``rid``, as a worker writes it."""
    fields = {
        b"rid": rid.encode(),
        b"body": submission.build_submission({"x": xs(1)}, now_s=0).body,
    }
    return answer(fields)[1]


def test_a_refusal_on_one_shard_ends_map_at_the_first_request_taken_back() -> None:
    # Given a window of six requests, round-robin over three shards, whose second shard was full
    plan = mapwindow.MapPlan(
        SETTINGS,
        {"x": np.zeros((6, 1), np.float32)},
        rows_per_request=1,
        concurrency=6,
        outputs=None,
        timeout_s=5,
    )
    taken = plan.take(now_s=0)
    refused = [taken[1], taken[4]]
    accepted = [sub for sub in taken if sub not in refused]
    plan.sent(accepted, now=0)
    plan.refused(refused, RedisFull("redis://test", None, None, None, refused="OOM"))
    # When the others are answered
    reply_keys = [SETTINGS.reply_key(sub.rid).encode() for sub in accepted]
    raws = [fake_reply_for(sub.rid) for sub in accepted]
    plan.answered(plan.waiter.take_popped(reply_keys, raws), now=0.1)
    # Then the chunks up to the hole are yielded, and the plan is finished (the refusal follows)
    assert [c.start for c in plan.ready()] == [0]
    assert plan.finished


def test_map_awaits_what_a_shard_with_room_took_when_another_refuses_for_memory() -> None:
    # Given a map over three shards, as a scripted shell runs it: the first XADD part (one
    # shard's requests) goes in, another shard refuses for memory, and replies come for all
    # that went in
    plan = mapwindow.MapPlan(
        SETTINGS,
        {"x": np.zeros((6, 1), np.float32)},
        rows_per_request=1,
        concurrency=6,
        outputs=None,
        timeout_s=5,
    )
    where = "redis://test"
    session = Session(
        SETTINGS, where, 2.0, RetryPolicy(where, 0), True, MemoryWatch(where, None), lambda r: None
    )
    stepper = driver.Stepper(plans.run_map(session, plan))
    chunks: list[results.Chunk] = []
    sent_first: list[submission.Submission] = []

    def run() -> None:
        while (step := stepper.step()) is not driver.DONE:
            if isinstance(step, results.Chunk):
                chunks.append(step)
            elif step.name == "LRANGE":
                stepper.answer([Shards(MODEL, TAGS)])
            elif step.name == "XADD":
                step.parts[0].done = True
                sent_first.extend(step.parts[0].items)
                stepper.fail(RedisFull(where, None, None, None, refused="OOM command not allowed"))
            elif step.name == "LPOP":
                stepper.answer([[fake_reply_for("x")] * len(p.items) for p in step.parts])
            else:  # INFO: memory is not watched here
                stepper.answer(None)

    with pytest.raises(RedisFull, match="OOM"):
        run()
    # Then the shard that took its part had its requests awaited (not taken back), and the
    # chunks yielded stop at the first request of a refused shard
    assert [c.start for c in chunks] == [0]
    assert [sub.rid for sub in sent_first] == [chunks[0].rid, sent_first[1].rid]
    assert plan.waiter.pending == 0
    assert plan.finished
