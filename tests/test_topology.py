"""Shard tags, handles, the shard list and the topology on one Redis (the cluster tests are in
test_cluster.py): the names every key of a sharded model is built from, and the routing that
must cost a single Redis nothing."""

from __future__ import annotations

import pytest
import redis
from redis.backoff import NoBackoff
from redis.exceptions import AskError, ClusterDownError, ConnectionError, MovedError
from redis.retry import Retry

from producer.protocol import keys
from producer.redisio.retry import is_transient
from producer.redisio.shards import Shards, parse_shards, read_shards
from producer.redisio.topology import Node, SlotMap, Topology, seed_client, tag_slot

# -- tags and handles ------------------------------------------------------------------------


@pytest.mark.parametrize("tag", ["demo", "demo~b", "demo~s12", "a.b-c_d~0123456789abcdef"])
def test_valid_tags(tag: str) -> None:
    assert keys.is_valid_tag(tag)


@pytest.mark.parametrize("tag", ["", "demo~", "demo~B", "demo~a~b", "de mo", "demo~" + "a" * 17])
def test_invalid_tags(tag: str) -> None:
    assert not keys.is_valid_tag(tag)
    with pytest.raises(ValueError, match="Shard tag"):
        keys.request_stream("redbatch", tag)


def test_every_key_of_a_request_carries_its_shard_tag() -> None:
    assert keys.request_stream("p", "m~b") == "p:{m~b}:requests"
    assert keys.reply_key("p", "m~b", "r1") == "p:{m~b}:reply:r1"
    assert keys.cancel_key("p", "m~b", "r1") == "p:{m~b}:cancel:r1"
    assert keys.dead_key("p", "m~b") == "p:{m~b}:dead"
    assert keys.staging_key("p", "m~b", "w", "t.1") == "p:{m~b}:staging:w:t.1"
    assert keys.shards_key("p", "m") == "p:{m}:shards"
    slots = {tag_slot("m~b")} | {
        redis.crc.key_slot(k.encode())
        for k in (keys.request_stream("p", "m~b"), keys.reply_key("p", "m~b", "r1"))
    }
    assert len(slots) == 1


def test_a_handle_is_the_rid_on_the_first_shard_and_names_any_other() -> None:
    assert keys.handle("demo", "r1") == "r1"
    assert keys.handle("demo~b", "r1") == "demo~b/r1"
    assert keys.parse_handle("r1", "demo") == ("demo", "r1")
    assert keys.parse_handle("demo~b/r1", "demo") == ("demo~b", "r1")
    assert keys.parse_handle("demo~b/a:b", "demo") == ("demo~b", "a:b")


@pytest.mark.parametrize(
    ("value", "message"),
    [("other~b/r1", "model 'other'"), ("demo~b/", "Request id"), ("demo~B/r1", "Shard tag")],
)
def test_a_bad_handle_is_refused_with_what_is_wrong(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        keys.parse_handle(value, "demo")


def test_shard_keys_are_checked() -> None:
    assert keys.shard_tag("demo") == "demo"
    assert keys.shard_tag("demo", "b") == "demo~b"
    with pytest.raises(ValueError, match="Shard key"):
        keys.shard_tag("demo", "B")


# -- the shard list --------------------------------------------------------------------------


def test_the_shard_list_starts_with_the_model_and_skips_what_is_not_its_own() -> None:
    shards = parse_shards("demo", [b"demo~b", b"other~c", b"demo", b"bad tag", b"demo~b"], [])
    assert shards.send == ("demo", "demo~b")
    assert parse_shards("demo", [], []) == Shards.single("demo")


def test_retiring_shards_are_served_but_not_sent_to() -> None:
    shards = parse_shards("demo", [b"demo", b"demo~b"], {b"demo~c", b"demo~b"})
    assert shards.send == ("demo", "demo~b")
    assert shards.serve == ("demo", "demo~b", "demo~c")


def test_read_shards_reads_the_list_and_the_retiring_set(rconn: redis.Redis) -> None:
    rconn.delete("t:{m}:shards", "t:{m}:retiring")
    assert read_shards(rconn, "t", "m").send == ("m",)
    rconn.rpush("t:{m}:shards", "m", "m~a", "m~b")
    rconn.sadd("t:{m}:retiring", "m~z")
    shards = read_shards(rconn, "t", "m")
    assert shards.send == ("m", "m~a", "m~b")
    assert shards.serve == ("m", "m~a", "m~b", "m~z")


# -- the topology ----------------------------------------------------------------------------


def test_on_one_redis_every_tag_uses_the_seeds_own_pool(rconn: redis.Redis) -> None:
    topology = Topology(rconn)
    assert topology.refresh() is False
    assert not topology.cluster
    clients = [topology.client(t) for t in ("m", "m~a", "m~b")]
    assert all(c.connection_pool is rconn.connection_pool for c in clients)
    assert topology.client("m") is clients[0]  # one client per tag, for the tag's life
    assert topology.node_of("m") is None
    assert list(topology.pools()) == []


def test_a_slot_map_routes_each_tag_to_its_master() -> None:
    reply = [
        [0, 8000, [b"10.0.0.1", 7000, b"id1"], [b"10.0.0.4", 7003, b"id4"]],
        [8001, 16383, [b"", 7001, b"id2"]],
    ]
    slots = SlotMap.parse(reply, seed_host="10.0.0.9")
    assert slots.cluster
    assert slots.node(0) == Node("10.0.0.1", 7000, "id1")
    assert slots.node(16383) == Node("10.0.0.9", 7001, "id2")  # empty host: the seed's
    assert [n.port for n in slots.masters()] == [7000, 7001]
    assert slots.replicas == [Node("10.0.0.4", 7003, "id4")]  # asked when the masters are gone


def test_a_refresh_asks_the_replicas_the_last_map_named_when_its_seed_is_gone(
    rconn: redis.Redis,
) -> None:
    # Given a client that only ever talked to its seed, whose last map named a replica (here:
    # the live test server) and a master that no longer answers
    dead = redis.Redis(
        host="127.0.0.1", port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    topology = Topology(dead)
    live = rconn.connection_pool.connection_kwargs
    reply = [[0, 16383, [b"127.0.0.1", 1, b"gone"], [live["host"].encode(), live["port"], b"r"]]]
    topology._apply(reply)
    # When it refreshes, the seed refusing, it asks the replica: a single Redis answers that it
    # is no cluster (before, it tried the dead seed alone and raised)
    assert topology.refresh() is False
    topology.close()
    dead.close()


def test_moved_repoints_every_tag_of_that_slot_at_once(rconn: redis.Redis) -> None:
    topology = Topology(rconn)
    topology.refresh()
    before = topology.client("m")
    slot = tag_slot("m")
    host = rconn.connection_pool.connection_kwargs["host"]
    assert topology.follow(MovedError(f"{slot} {host}:1"))
    after = topology.client("m")
    assert after is before  # the same object: scripts registered on it follow too
    assert after.connection_pool is not rconn.connection_pool
    assert after.connection_pool.connection_kwargs["port"] == 1
    other = next(t for t in ("a", "b", "c") if tag_slot(t) != slot)
    assert topology.client(other).connection_pool is rconn.connection_pool  # other slots stay
    topology.close()


def test_cluster_replies_are_transient_and_followed() -> None:
    for exc in (MovedError("1 h:1"), AskError("1 h:1"), ClusterDownError("down")):
        assert is_transient(exc)
    assert is_transient(ConnectionError("gone"))


def test_a_cluster_client_is_accepted_as_a_seed(rconn: redis.Redis) -> None:
    assert seed_client(rconn) is rconn

    class ClusterNode:
        redis_connection = rconn

    class FakeCluster:
        def get_nodes(self) -> list[ClusterNode]:
            return [ClusterNode()]

    assert seed_client(FakeCluster()) is rconn
    with pytest.raises(TypeError, match="neither"):
        seed_client(object())
