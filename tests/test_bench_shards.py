"""The bench on several shards: placement on distinct masters (a pure function of a slot map),
the producer's sends and reply sweeps spread over shard tags (one real Redis holding three tags
is enough), and Redis CPU per request by master. No cluster is started here."""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from producer.protocol import keys
from producer.protocol.codec import ModelRef, Reply, encode_reply
from producer.redisio.topology import Node, SlotMap, tag_slot
from tools.bench.__main__ import EXIT_USAGE, main
from tools.bench.shards import per_master, place_shards
from tools.bench.wire import ProducerTally, Replies, Sender

TINY = [{"name": "x", "dtype": "float32", "shape": ["N", 4]}]
A, B, C = Node("127.0.0.1", 7001), Node("127.0.0.1", 7002), Node("127.0.0.1", 7003)
# Three masters as redis-cli --cluster create splits the slots
SLOTS = SlotMap([(0, 5460, A), (5461, 10922, B), (10923, 16383, C)])


@pytest.mark.parametrize("model", ["tiny", "heavy", "demo", "m.1"])
@pytest.mark.parametrize("count", [1, 2, 3])
def test_shards_are_placed_on_distinct_masters(model: str, count: int) -> None:
    tags = place_shards(model, count, SLOTS.node)
    assert len(tags) == count
    assert tags[0] == model  # the model's own shard comes first, as P:{M}:shards lists it
    assert all(keys.is_valid_tag(t) and keys.model_of(t) == model for t in tags)
    masters = [SLOTS.node(tag_slot(t)) for t in tags]
    assert len(set(masters)) == count
    assert place_shards(model, count, SLOTS.node) == tags  # the same every time


def test_placement_needs_as_many_masters_as_shards() -> None:
    with pytest.raises(ValueError, match="4 shards of 'tiny' need 4 masters; the cluster has 3"):
        place_shards("tiny", 4, SLOTS.node)
    with pytest.raises(ValueError, match="at least one shard"):
        place_shards("tiny", 0, SLOTS.node)


def test_placement_uses_only_masters_that_own_slots() -> None:
    """A master owning a single slot (the model's own) still counts; unassigned slots never."""
    first = tag_slot("tiny")
    ranges = [(0, first - 1, B), (first, first, A), (first + 1, 16383, B)]
    sparse = SlotMap([r for r in ranges if r[0] <= r[1]])
    tags = place_shards("tiny", 2, sparse.node)
    assert [sparse.node(tag_slot(t)) for t in tags] == [A, B]
    lone = SlotMap([(first, first, C)])  # every other slot unassigned
    with pytest.raises(ValueError, match="need 2 masters; the cluster has 1"):
        place_shards("tiny", 2, lone.node)


def test_a_single_redis_gets_numbered_tags() -> None:
    assert place_shards("tiny", 3) == ["tiny", "tiny~1", "tiny~2"]
    assert place_shards("tiny", 3, lambda slot: None) == ["tiny", "tiny~1", "tiny~2"]


def test_the_cli_keeps_shards_to_a_load_it_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scenario", "tiny-closed", "--cluster"]) == EXIT_USAGE
    assert main(["--no-start", "--shards", "2"]) == EXIT_USAGE
    assert main(["--replicas", "0"]) == EXIT_USAGE
    assert main(["--cluster", "--redis-url", "redis://127.0.0.1:1/0"]) == EXIT_USAGE
    assert "--cluster and --shards go with a custom load" in capsys.readouterr().err


def _reply(rid: str) -> bytes:
    return encode_reply(
        Reply(
            rid=rid,
            ok=True,
            model=ModelRef("m", "1", "0" * 64),
            worker="w",
            timings_ms={"queued": 1.0, "inference": 2.0},
            outputs={},
            batch_rows=3,
        )
    )


def test_the_sender_deals_requests_to_every_shard_in_turn(rconn: redis.Redis) -> None:
    tags = ["m", "m~1", "m~2"]
    sender = Sender(rconn, "p", "m", TINY, seed=1, shards=dict.fromkeys(tags, rconn))
    sent = sender.rids(10)
    sender.send()
    by_tag = Counter(tag for tag, _ in sent)
    assert by_tag == {"m~1": 4, "m~2": 3, "m": 3}  # seed 1 starts at the second shard
    for tag in tags:
        entries = rconn.xrange(keys.request_stream("p", tag))
        assert [e[1][b"rid"].decode() for e in entries] == [r for t, r in sent if t == tag]
    sender.send()  # nothing queued: nothing sent
    assert sum(rconn.xlen(keys.request_stream("p", t)) for t in tags) == 10


def test_one_shard_sends_as_before(rconn: redis.Redis) -> None:
    sender = Sender(rconn, "p", "m", TINY, seed=0)
    sent = sender.rids(5)
    sender.send()
    assert {tag for tag, _ in sent} == {"m"}
    assert sender.stream == keys.request_stream("p", "m")
    assert rconn.xlen(sender.stream) == 5


def test_replies_are_awaited_and_counted_per_shard(rconn: redis.Redis) -> None:
    tags = ["m", "m~1", "m~2"]
    shards = dict.fromkeys(tags, rconn)
    sender = Sender(rconn, "p", "m", TINY, seed=0, shards=shards)
    tally = ProducerTally()
    now = time.monotonic()
    replies = Replies(rconn, "p", "m", 5.0, tally, (now - 1, now + 60), shards)
    sent = sender.rids(7)
    for sent_as in sent:
        replies.add(sent_as, now, now)
    assert replies.in_flight == 7
    for tag, rid in sent[1:]:  # the oldest request's shard answers later than the others
        rconn.rpush(keys.reply_key("p", tag, rid), _reply(rid))
    replies.round()  # a short block on the oldest's shard, then a sweep of every shard
    assert replies.in_flight == 1
    tag, rid = sent[0]
    rconn.rpush(keys.reply_key("p", tag, rid), _reply(rid))
    replies.round()
    assert replies.in_flight == 0
    assert tally.completed_in_window == 7
    assert tally.shard_completed == Counter(t for t, _ in sent)
    assert tally.codes == {"OK": 7}
    assert tally.batch_rows == [3] * 7


def test_redis_cpu_is_set_against_each_masters_requests() -> None:
    nodes = [
        {"address": "a:1", "role": "master", "master": ""},
        {"address": "b:2", "role": "master", "master": ""},
        {"address": "c:3", "role": "master", "master": ""},
        {"address": "a:4", "role": "replica", "master": "a:1"},
        {"address": "b:5", "role": "replica", "master": "b:2"},
    ]
    before = {"a:1": 1.0, "b:2": 2.0, "c:3": 3.0, "a:4": 0.5, "b:5": 0.5}
    after = {"a:1": 1.4, "b:2": 2.2, "c:3": 3.01, "a:4": 0.7, "b:5": 0.6}
    where = {"m": "a:1", "m~1": "b:2", "m~2": "a:1"}
    got = per_master(nodes, where, before, after, 2.0, {"m": 3000, "m~1": 1000, "m~2": 1000})
    a, b, c = got["masters"]
    assert a["shards"] == ["m", "m~2"]
    assert a["replicas"] == ["a:4"]
    assert a["requests"] == 4000
    assert a["requests_per_s"] == 2000
    assert a["master_us_per_request"] == pytest.approx(100.0)  # 0.4 s over 4000
    assert a["replica_us_per_request"] == pytest.approx(50.0)
    assert a["master_cores"] == pytest.approx(0.2)
    assert b["master_us_per_request"] == pytest.approx(200.0)
    assert c["shards"] == []
    assert c["master_us_per_request"] is None
    assert c["replica_us_per_request"] is None
    assert c["master_cores"] == pytest.approx(0.005)
    assert got["total"]["us_per_request"] == pytest.approx(1e6 * 0.91 / 5000)


@pytest.mark.slow
def test_a_run_on_a_cluster_spreads_over_three_masters(tmp_path: Path) -> None:
    """``--cluster --shards 3``: a private cluster, three shards on three masters, one worker
    serving them all, and Redis CPU per request reported for each master and its replica."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"a local Redis Cluster needs {' and '.join(missing)} on PATH")
    path = tmp_path / "cluster.json"
    argv = ["--cluster", "--shards", "3", "--model", "tiny", "--concurrency", "12"]
    argv += ["--no-ceilings", "--duration-s", "1.5", "--warmup-s", "0.3", "--json", str(path)]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    assert report["redis"]["cluster"] is True
    where = report["redis"]["shards"]["tiny"]
    assert next(iter(where)) == "tiny"
    assert len(set(where.values())) == 3  # three shards, three masters
    [phase] = report["phases"]
    assert phase["lost"] == 0
    assert phase["ok"] == phase["requests"] > 0
    assert set(phase["throughput_by_shard"]) == set(where)
    assert all(rate > 0 for rate in phase["throughput_by_shard"].values())
    masters = phase["redis_cpu"]["masters"]
    assert sorted(m["address"] for m in masters) == sorted(where.values())
    for m in masters:
        assert len(m["shards"]) == 1
        assert len(m["replicas"]) == 1
        assert m["requests"] > 0
        assert m["master_us_per_request"] > 0
        assert m["replica_us_per_request"] > 0
    assert phase["redis_cpu"]["total"]["us_per_request"] > 0
