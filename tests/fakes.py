"""The fake worker and the small helpers the client tests share (``tests/shells.py`` has the
fixtures that run each test against both clients).

The fake worker (``FakeReplier``) reads the request stream as the worker would (group
``workers``), answers ``y = x * 2``, and answers INVALID_INPUT for any request holding a
negative value.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import redis

from producer import codec, keys
from producer.codec import ErrorInfo, ModelRef, Reply

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


def ensure_group(conn: redis.Redis) -> None:
    try:
        conn.xgroup_create(STREAM, keys.CONSUMER_GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def reply_to_entries(conn: redis.Redis, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
    """Write replies the way the worker does: reply (if absent) + EXPIRE, XACK, XDEL."""
    pipe = conn.pipeline(transaction=False)
    for entry_id, fields in entries:
        rid, reply = answer(fields)
        key = keys.reply_key(PREFIX, MODEL, rid)
        pipe.rpush(key, reply)
        pipe.expire(key, 60)
        pipe.xack(STREAM, keys.CONSUMER_GROUP, entry_id)
        pipe.xdel(STREAM, entry_id)
    pipe.execute()


class FakeReplier:
    """A thread that answers requests like a worker would, until stopped."""

    def __init__(self, url: str) -> None:
        self._conn = redis.Redis.from_url(url)
        ensure_group(self._conn)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-replier", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> FakeReplier:
        self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                got = self._conn.xreadgroup(
                    keys.CONSUMER_GROUP, "fake-1", {STREAM: ">"}, count=256, block=1000
                )
                for _stream, entries in got or []:
                    work = [(eid, f) for eid, f in entries if b"stop" not in f]
                    reply_to_entries(self._conn, work)
        except BaseException as exc:  # reported by stop(), so a test fails loudly
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._conn.xadd(STREAM, {"stop": "1"})  # wakes the blocked read at once
            self._thread.join(timeout=10)
        self._conn.close()
        if self.error is not None:
            raise self.error


def register_worker(conn: redis.Redis, name: str, max_batch_size: int) -> None:
    """Register a worker record by hand, as a worker's heartbeat would."""
    record = {"name": name, "state": "ready", "batching": {"max_batch_size": max_batch_size}}
    conn.set(keys.worker_key(PREFIX, MODEL, name), json.dumps(record), ex=15)
    conn.sadd(keys.workers_key(PREFIX, MODEL), name)


def xs(rows: int, cols: int = 3) -> np.ndarray:
    return np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
