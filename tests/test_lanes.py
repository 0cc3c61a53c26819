"""A worker serves every shard of its model (contract section 4), on one Redis here; the same
code on a real cluster is tested in test_cluster.py.

Each shard is a lane: its own stream, leases and reading thread; one batch may mix them, and
each finish step, cancel check and dead letter goes to the shard its entry came from.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import redis
from eventually import eventually
from harness import PREFIX, running_worker, write_config

from producer.protocol import keys
from producer.protocol.codec import decode_reply, encode_request
from producer.redisio.topology import Topology
from worker.answer.finisher import Finisher
from worker.config import load_config
from worker.events import NO_EVENTS
from worker.intake import leases as leases_module
from worker.intake.lanes import Lanes
from worker.intake.leases import Stuck
from worker.intake.settings import IntakeSettings
from worker.intake.shardmap import ShardMap
from worker.redisio.stream import Finish
from worker.service import Worker, prepare

MODEL = "demo"
TAGS = ["demo", "demo~b", "demo~c"]
X = np.zeros((1, 16), np.float32)


def _send(r: redis.Redis, tag: str, rid: str, **kw: object) -> None:
    body = encode_request({"features": X}, **kw)  # type: ignore[arg-type]
    r.xadd(keys.request_stream(PREFIX, tag), {"rid": rid, "body": body})


def _reply(r: redis.Redis, tag: str, rid: str, timeout_s: float = 20.0):  # type: ignore[no-untyped-def]
    got = r.blpop([keys.reply_key(PREFIX, tag, rid)], timeout=timeout_s)
    assert got is not None, f"no reply for {tag}/{rid}"
    return decode_reply(got[1])


def _drained(r: redis.Redis, tag: str) -> bool:
    stream = keys.request_stream(PREFIX, tag)
    return r.xlen(stream) == 0 and all(g["pending"] == 0 for g in r.xinfo_groups(stream))


def test_every_listed_shard_is_served_and_batches_mix_them(tmp_path: Path, rconn) -> None:
    # Given a model with three shards, listed before the worker starts, and requests in each
    # sent while the worker waits to read them
    url = rconn.connection_pool.connection_kwargs
    config = write_config(
        tmp_path,
        MODEL,
        f"redis://{url['host']}:{url['port']}/0",
        batching="max_batch_size = 32\nmax_wait_ms = 50",
    )
    rconn.rpush(keys.shards_key(PREFIX, MODEL), *TAGS)
    with running_worker(config) as worker:
        assert sorted(worker.lanes.tags()) == sorted(TAGS)
        pipe = rconn.pipeline(transaction=False)
        for i in range(30):
            tag = TAGS[i % 3]
            body = encode_request({"features": X})
            pipe.xadd(keys.request_stream(PREFIX, tag), {"rid": f"r{i}", "body": body})
        pipe.execute()
        # When they are answered
        replies = [_reply(rconn, TAGS[i % 3], f"r{i}") for i in range(30)]
        eventually(lambda: all(_drained(rconn, t) for t in TAGS))
    # Then each reply is in its own shard's slot, and some batch held more rows than one
    # shard's requests could have filled on their own
    assert all(r.ok for r in replies)
    assert max(r.batch_rows or 0 for r in replies) > 10


def test_cancels_and_dead_letters_go_to_the_requests_own_shard(tmp_path: Path, rconn) -> None:
    url = rconn.connection_pool.connection_kwargs
    config = write_config(tmp_path, MODEL, f"redis://{url['host']}:{url['port']}/0")
    rconn.rpush(keys.shards_key(PREFIX, MODEL), *TAGS)
    # A request cancelled before any worker read it, and an entry without a valid rid, both on
    # the third shard; the same rid on the first shard is not cancelled
    rconn.set(keys.cancel_key(PREFIX, "demo~c", "same"), 1, ex=60)
    _send(rconn, "demo~c", "same")
    _send(rconn, "demo", "same")
    body = encode_request({"features": X})
    rconn.xadd(keys.request_stream(PREFIX, "demo~c"), {"rid": "not a rid!", "body": body})
    with running_worker(config):
        cancelled = _reply(rconn, "demo~c", "same")
        served = _reply(rconn, "demo", "same")
        eventually(lambda: rconn.xlen(keys.dead_key(PREFIX, "demo~c")) == 1)
        eventually(lambda: all(_drained(rconn, t) for t in TAGS))
    assert cancelled.error is not None
    assert cancelled.error.code == "CANCELLED"
    assert served.ok
    assert rconn.xlen(keys.dead_key(PREFIX, "demo")) == 0


def test_a_shard_added_or_retired_is_followed_without_a_restart(tmp_path: Path, rconn) -> None:
    url = rconn.connection_pool.connection_kwargs
    config = write_config(tmp_path, MODEL, f"redis://{url['host']}:{url['port']}/0")
    with running_worker(config) as worker:
        assert worker.lanes.tags() == ["demo"]
        # When an operator adds a shard (the heartbeat reads the list; beat_soon is that beat)
        rconn.rpush(keys.shards_key(PREFIX, MODEL), "demo", "demo~n")
        _send(rconn, "demo~n", "new")
        worker.registry.beat_soon()
        # Then the worker serves it
        assert _reply(rconn, "demo~n", "new").ok
        assert "demo~n" in worker.lanes.tags()
        # And while the shard is retiring (off the list, in the retiring set) it is still served
        pipe = rconn.pipeline(transaction=True)
        pipe.lrem(keys.shards_key(PREFIX, MODEL), 0, "demo~n")
        pipe.sadd(keys.retiring_key(PREFIX, MODEL), "demo~n")
        pipe.execute()
        worker.registry.beat_soon()
        _send(rconn, "demo~n", "late")
        assert _reply(rconn, "demo~n", "late").ok
        # Once retired, its lane stops reading and closes
        rconn.srem(keys.retiring_key(PREFIX, MODEL), "demo~n")
        lane = next(lane for lane in worker.lanes if lane.tag == "demo~n")

        def retired() -> bool:
            worker.registry.beat_soon()  # each beat syncs the lanes with the list
            return "demo~n" not in worker.lanes.tags()

        eventually(retired)
        assert not lane.reader.is_alive()
        assert ("demo~n",) not in worker.metrics.backlog._metrics  # its series went with it
        _send(rconn, "demo", "first-shard-still-served")
        assert _reply(rconn, "demo", "first-shard-still-served").ok


def test_a_mixed_finish_retried_after_one_shard_failed_resends_only_that_shard(
    tmp_path: Path, rconn
) -> None:
    # Given lanes on two shards (not started: finish steps only), an entry read on each, and
    # the writer's finisher over them
    url = rconn.connection_pool.connection_kwargs
    config = load_config(write_config(tmp_path, MODEL, f"redis://{url['host']}:{url['port']}/0"))
    prepared = prepare(config, "me")
    settings = IntakeSettings(
        prefix=PREFIX,
        consumer="me",
        schema=prepared.intake_schema,
        max_request_bytes=1 << 20,
        max_element_bytes=None,
        read_count=8,
        claim_idle_ms=30_000,
        max_deliveries=3,
        out=queue.Queue(),
        stop=threading.Event(),
        stuck=Stuck(),
        events=NO_EVENTS,
        burst=False,
    )
    shards = ShardMap(MODEL)
    lanes = Lanes(Topology(rconn), MODEL, settings, shards)
    finisher = Finisher(shards)
    lanes.first.stream.ensure_group()  # the worker does this at start; sync for the others
    lanes.sync(["demo", "demo~b"])
    finishes = []
    for tag in ("demo", "demo~b"):
        _send(rconn, tag, f"in-{tag}")
        [entry] = shards.stream(tag).read(8, 0)
        finishes.append(Finish(entry.entry_id, f"in-{tag}", b"reply", shard=tag))
    # When the second shard's step fails once (its master failing over), then is retried
    sends: Counter[str] = Counter()
    for tag in ("demo", "demo~b"):
        stream = shards.stream(tag)
        start = stream.finish_start

        def counted(items, tag=tag, start=start, stream=stream):  # type: ignore[no-untyped-def]
            sends[tag] += 1
            if tag == "demo~b" and sends[tag] == 1:
                raise redis.ConnectionError("master gone")
            return start(items)

        stream.finish_start = counted  # type: ignore[method-assign]
    with pytest.raises(redis.ConnectionError):
        finisher.finish_each(finishes)
    done = finisher.finish_each(finishes)
    # Then the retry sent only the failed shard, and both count as finished here
    assert done == [True, True]
    assert sends == {"demo": 1, "demo~b": 2}
    assert all(_drained(rconn, t) for t in ("demo", "demo~b"))


def test_the_answerers_stuck_flag_is_the_one_every_lanes_lease_keeper_reads(
    tmp_path: Path, rconn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a worker (not started) on two shards, the second joined later, and a clock to move
    url = rconn.connection_pool.connection_kwargs
    config = write_config(
        tmp_path,
        MODEL,
        f"redis://{url['host']}:{url['port']}/0",
        extra="[delivery]\nmax_run_s = 5",
    )
    worker = Worker(prepare(load_config(config), "me"), rconn)
    worker.lanes.first.stream.ensure_group()
    worker.lanes.sync(["demo", "demo~b"])
    clock = [1000.0]
    monkeypatch.setattr(leases_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    keepers = [lane.keeper for lane in worker.lanes]
    assert len(keepers) == 2
    assert all(keeper.stuck is worker.answers.stuck is worker.stuck for keeper in keepers)
    # When the answerer's run has run past delivery.max_run_s
    worker.answers.stuck.run_started()
    clock[0] += 6
    # Then every keeper lets its leases lapse, and /healthz says so
    assert all(keeper._hung() for keeper in keepers)
    assert not worker.healthy()
    worker.answers.stuck.run_ended()
    assert not any(keeper._hung() for keeper in keepers)
    assert worker.healthy()
