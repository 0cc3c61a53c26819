"""The fake worker and the small helpers the client tests share (``tests/shells.py`` has the
fixtures that run each test against both clients).

The fake worker (``FakeReplier``) reads the request streams of the shards it is given as the
worker would (group ``workers``, one reader per shard), answers ``y = x * 2``, and answers
INVALID_INPUT for any request holding a negative value. It finds each shard's node as the
clients do (``producer.redisio.topology``), so it serves a Redis Cluster too.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

import numpy as np
import redis

from producer.protocol import codec, keys
from producer.protocol.codec import ErrorInfo, ModelRef, Reply
from producer.redisio.topology import Topology

MODEL = "demo"
PREFIX = keys.DEFAULT_PREFIX
STREAM = keys.request_stream(PREFIX, MODEL)
FAKE_MODEL = ModelRef(MODEL, "1", "0" * 64)


def answer(entry_fields: dict[bytes, bytes]) -> tuple[str, bytes]:
    """The fake worker's reply to one stream entry: y = x * 2, or INVALID_INPUT for x < 0."""
    rid = entry_fields[b"rid"].decode()
    body = codec.decode_request(entry_fields[b"body"], max_bytes=1 << 24)
    x = body.inputs["x"]
    common = {"rid": rid, "model": FAKE_MODEL, "worker": "fake-1", "meta_raw": body.meta_raw}
    timings = {"queued": 0.1, "inference": 0.2}
    if (x < 0).any():
        error = ErrorInfo("INVALID_INPUT", "input 'x' holds a negative value.", False)
        reply = Reply(ok=False, error=error, timings_ms=timings, **common)
    else:
        outputs = {"y": x * 2}
        reply = Reply(ok=True, outputs=outputs, batch_rows=len(x), timings_ms=timings, **common)
    return rid, codec.encode_reply(reply)


def ensure_group(conn: redis.Redis, tag: str = MODEL) -> None:
    try:
        stream = keys.request_stream(PREFIX, tag)
        conn.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def reply_to_entries(
    conn: redis.Redis, entries: list[tuple[bytes, dict[bytes, bytes]]], tag: str = MODEL
) -> None:
    """Write replies the way the worker does, in shard ``tag``: reply (if absent) + EXPIRE,
    XACK, XDEL (a pipeline, not a transaction: one shard's keys, one slot, either way)."""
    stream = keys.request_stream(PREFIX, tag)
    pipe = conn.pipeline(transaction=False)
    for entry_id, fields in entries:
        rid, reply = answer(fields)
        key = keys.reply_key(PREFIX, tag, rid)
        pipe.rpush(key, reply)
        pipe.expire(key, 60)
        pipe.xack(stream, keys.CONSUMER_GROUP, entry_id)
        pipe.xdel(stream, entry_id)
    pipe.execute()


class FakeReplier:
    """Threads that answer requests like a worker would, one per shard tag, until stopped
    (a blocking read watches one stream: on a cluster each shard is on its own master)."""

    def __init__(self, url: str, tags: Sequence[str] = (MODEL,)) -> None:
        self._seed = redis.Redis.from_url(url, socket_timeout=30)
        self._topology = Topology(self._seed)
        self._topology.refresh()
        self._tags = list(tags)
        for tag in self._tags:
            ensure_group(self._topology.client(tag), tag)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(tag,), name=f"fake-{tag}", daemon=True)
            for tag in self._tags
        ]
        self.error: BaseException | None = None
        self.answered: dict[str, int] = dict.fromkeys(self._tags, 0)  # requests, per shard

    def start(self) -> FakeReplier:
        for thread in self._threads:
            thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._threads[0].ident is not None

    def _run(self, tag: str) -> None:
        conn, stream = self._topology.client(tag), keys.request_stream(PREFIX, tag)
        try:
            while not self._stop.is_set():
                got = conn.xreadgroup(
                    keys.CONSUMER_GROUP, "fake-1", {stream: ">"}, count=256, block=1000
                )
                for _stream, entries in got or []:
                    work = [(eid, f) for eid, f in entries if b"stop" not in f]
                    reply_to_entries(conn, work, tag)
                    self.answered[tag] += len(work)
        except BaseException as exc:  # reported by stop(), so a test fails loudly
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        for tag, thread in zip(self._tags, self._threads, strict=True):
            if thread.is_alive():  # a stop entry wakes the blocked read at once
                self._topology.client(tag).xadd(keys.request_stream(PREFIX, tag), {"stop": "1"})
                thread.join(timeout=10)
        self._topology.close()
        self._seed.close()
        if self.error is not None:
            raise self.error


def register_worker(conn: redis.Redis, name: str, max_batch_size: int) -> None:
    """Register a worker record by hand, as a worker's heartbeat would."""
    record = {"name": name, "state": "ready", "batching": {"max_batch_size": max_batch_size}}
    conn.set(keys.worker_key(PREFIX, MODEL, name), json.dumps(record), ex=15)
    conn.sadd(keys.workers_key(PREFIX, MODEL), name)


def xs(rows: int, cols: int = 3) -> np.ndarray:
    return np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
