"""One producer's side of the protocol, made cheap: request bodies, pipelined sends, reply sweeps.

A load generator shares the cores with the worker and Redis it measures, so it does less than
``Client``: bodies are encoded once and reused under fresh rids, submits go out pipelined, and
replies are swept up many keys per round trip (``LPOP``s packed by hand) and read for two
fields only (``outcome``). What each reply says is counted in a ``ProducerTally``;
``tools.bench.load`` drives these pieces in the closed and open loops.

A model with several shards (``P:{M}:shards``) gets its requests spread over them: the sender
deals its requests to the shards in turn, and each round sends every shard's share as that
shard's own transaction, on the client of the master that serves it, all shards' written before
any reply is read. Replies are awaited per shard, since a multi-key ``BLPOP`` must stay in one
slot: the blocking pop waits on the shard of the oldest request, then every shard is swept.
With one shard (a single Redis, or a model never sharded) both take the path they always took.
"""

from __future__ import annotations

import itertools
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import numpy as np
import redis

from producer.client import steps, submission
from producer.client.results import as_bytes
from producer.protocol import keys
from producer.protocol.errors import WaitTimeout
from producer.redisio import connection, resp

__all__ = [
    "BODIES",
    "Outcome",
    "ProducerTally",
    "Replies",
    "Sender",
    "Sent",
    "input_rows",
    "outcome",
    "row_bytes",
]

BODIES = 64  # distinct request bodies a producer cycles through, at most
_BODIES_BYTES = 8 << 20  # and at most this many bytes of them (fewer bodies for big rows)
_MAX_WAIT_KEYS = 1024  # reply keys per BLPOP or sweep; replies come back roughly oldest first
# With shards, the BLPOP on the oldest request's shard blocks at most this long before every
# shard is swept anyway: replies of another shard, if that one is slow, wait no longer.
_SHARD_BLOCK_S = 0.02

#: What a sender hands out per request: its shard tag and its rid.
Sent = tuple[str, str]


def input_rows(specs: Sequence[dict[str, Any]], rows: int, seed: int) -> dict[str, np.ndarray]:
    """Arrays of ``rows`` rows for inputs described as in a worker record (name, dtype, shape).

    Free non-batch dimensions are 1; floats are standard normal clipped to the input's min/max,
    integers and booleans are zero (or the input's min). Floats are drawn in float32 (or
    float64) directly, so an image-sized input (resnet18: 150,528 values a row) costs no more
    than the draw itself.
    """
    rng = np.random.default_rng(seed)
    arrays = {}
    for spec in specs:
        shape = [rows, *_row_shape(spec)]
        dtype = np.dtype(spec["dtype"])
        low, high = spec.get("min"), spec.get("max")
        if dtype.kind == "f":
            draw = dtype if dtype in (np.float32, np.float64) else np.dtype(np.float32)
            values = rng.standard_normal(shape, dtype=draw)
            if low is not None or high is not None:
                values = np.clip(values, low, high)
            arrays[spec["name"]] = values.astype(dtype, copy=False)
        else:
            arrays[spec["name"]] = np.full(shape, low or 0, dtype=dtype)
    return arrays


def _row_shape(spec: dict[str, Any]) -> list[int]:
    return [d if isinstance(d, int) and d > 0 else 1 for d in spec["shape"][1:]]


def row_bytes(specs: Sequence[dict[str, Any]]) -> int:
    """Bytes of one row of every input, as ``input_rows`` makes it."""
    return sum(
        int(np.prod(_row_shape(s), dtype=np.int64)) * np.dtype(s["dtype"]).itemsize for s in specs
    )


@dataclass(slots=True)
class ProducerTally:
    """What one producer process measured. Requests count when sent in the measured window."""

    latencies_ms: list[float] = field(default_factory=list)
    # per latency: (queued, inference) ms from the reply's timings_ms (NaN when it had none)
    worker_ms: list[tuple[float, float]] = field(default_factory=list)
    batch_rows: list[int] = field(default_factory=list)  # per successful request
    codes: Counter[str] = field(default_factory=Counter)
    completed_in_window: int = 0  # replies that arrived in the window, whenever sent
    shard_completed: Counter[str] = field(default_factory=Counter)  # the same, by shard tag
    sent: int = 0  # every request sent, warmup included
    lost: int = 0  # no reply within timeout_s
    cpu_s: float = 0.0
    max_send_lag_ms: float = 0.0  # how far an open-loop sender fell behind its schedule


class Sender:
    """Pipelined XADDs of bodies encoded once, under fresh rids (a random tag and a count);
    ``bodies`` given (an encoded image, say) are sent instead of rows drawn for ``inputs``.

    ``shards`` maps each shard tag to the client of its master (default: the model's own tag
    on ``conn``); requests are dealt to them in turn, starting at a shard the seed picks.
    """

    def __init__(
        self,
        conn: redis.Redis,
        prefix: str,
        model: str,
        inputs: Sequence[dict[str, Any]],
        seed: int,
        bodies: Sequence[bytes] = (),
        shards: Mapping[str, redis.Redis] | None = None,
    ) -> None:
        self.shards = dict(shards) if shards else {model: conn}
        self.tags = list(self.shards)
        self.conn = self.shards[self.tags[0]]
        self.streams = {tag: keys.request_stream(prefix, tag) for tag in self.tags}
        self.stream = self.streams[self.tags[0]]
        count = max(1, min(BODIES, _BODIES_BYTES // max(row_bytes(inputs), 1)))
        self.bodies = list(bodies) or [
            submission.build_submission(input_rows(inputs, 1, seed + i), now_s=0.0).body
            for i in range(count)
        ]
        self._tag = uuid.uuid4().hex[:12]
        self._next = 0
        self._turn = seed % len(self.tags)
        self._queued: dict[str, list[submission.Submission]] = {tag: [] for tag in self.tags}

    def rids(self, n: int) -> list[Sent]:
        """Queue ``n`` requests for the next ``send()``; returns their shard tags and rids."""
        sent: list[Sent] = []
        tags, shards = self.tags, len(self.tags)
        for _ in range(n):
            rid = f"{self._tag}-{self._next}"
            body = self.bodies[self._next % len(self.bodies)]
            self._next += 1
            tag = tags[self._turn]
            self._turn = self._turn + 1 if self._turn + 1 < shards else 0
            self._queued[tag].append(submission.Submission(rid, body))
            sent.append((tag, rid))
        return sent

    def send(self) -> None:
        """Send the queued requests: one round trip per shard (packed by hand, as ``Client``
        does), every shard's written before any shard's replies are read."""
        if len(self.tags) == 1:
            [tag] = self.tags
            subs, self._queued[tag] = self._queued[tag], []
            if subs:
                xadds = submission.pack_xadds(self.stream, subs)
                submission.check_xadds(xadds, resp.round_trip(self.conn, xadds.packer))
            return
        flights = []
        for tag, subs in self._queued.items():
            if subs:
                xadds = submission.pack_xadds(self.streams[tag], subs)
                flights.append((xadds, resp.send(self.shards[tag], xadds.packer)))
                self._queued[tag] = []
        try:
            for xadds, flight in flights:
                submission.check_xadds(xadds, flight.receive())
        finally:
            for _, flight in flights:
                flight.abandon()  # only those an error left unread: their connection goes


class Replies:
    """The replies one producer awaits, oldest first, each with its reference time.

    A load generator needs only each reply's outcome and batch rows, so it reads those two
    fields (``outcome``) instead of decoding the outputs as ``Client`` does: every CPU
    millisecond it spends is one the worker and Redis do not get on the same cores.

    ``shards`` maps each shard tag to the client of its master, as ``Sender``'s does.
    """

    def __init__(
        self,
        conn: redis.Redis,
        prefix: str,
        model: str,
        timeout_s: float,
        tally: ProducerTally,
        window: tuple[float, float],
        shards: Mapping[str, redis.Redis] | None = None,
    ) -> None:
        self.shards = dict(shards) if shards else {model: conn}
        self.conn = next(iter(self.shards.values()))
        self.prefix = prefix
        self.model = model
        self.timeout_s = timeout_s
        self.tally = tally
        self.w0, self.w1 = window
        # per shard tag: reply key -> (reference time, send time); dicts keep send order
        self._by_tag: dict[str, dict[bytes, tuple[float, float]]] = {t: {} for t in self.shards}
        self._single = len(self.shards) == 1
        self._awaited = next(iter(self._by_tag.values()))  # the only shard's, with one

    @property
    def in_flight(self) -> int:
        if self._single:
            return len(self._awaited)
        return sum(len(awaited) for awaited in self._by_tag.values())

    def add(self, sent_as: Sent, t_ref: float, sent: float) -> None:
        """Await the reply of a request ``Sender.rids`` handed out, as ``(tag, rid)``."""
        tag, rid = sent_as
        self._by_tag[tag][keys.reply_key(self.prefix, tag, rid).encode()] = (t_ref, sent)

    def round(self, take_new: Callable[[], None] | None = None) -> None:
        """Block for one reply, then sweep up every other reply ready; ``take_new()`` adds the
        requests sent meanwhile first, so replies written in the same batch are swept too.

        WaitTimeout when the oldest request has waited ``timeout_s``.
        """
        if not self._single:
            self._round_shards(take_new)
            return
        tag = next(iter(self._by_tag))
        oldest_sent = next(iter(self._awaited.values()))[1]
        left_s = oldest_sent + self.timeout_s - time.monotonic()
        if left_s <= 0:
            raise WaitTimeout(f"no reply within {self.timeout_s:g} s")
        keys_ = list(itertools.islice(self._awaited, _MAX_WAIT_KEYS))
        block_s = max(round(min(left_s, connection.MAX_BLOCK_S), 3), 0.001)
        item = self.conn.blpop(keys_, block_s)
        if item is None:
            return
        self._record(tag, [(as_bytes(item[0]), as_bytes(item[1]))], time.monotonic())
        if take_new is not None:
            take_new()
        if self._awaited:
            keys_ = list(itertools.islice(self._awaited, _MAX_WAIT_KEYS))
            packed = steps.pack_lpops(keys_)
            raws = resp.raise_first_error(resp.round_trip(self.conn, packed))
            now = time.monotonic()
            popped = [(k, r) for k, r in zip(keys_, raws, strict=True) if r is not None]
            self._record(tag, popped, now)

    def _round_shards(self, take_new: Callable[[], None] | None) -> None:
        """``round`` over several shards: block (briefly) on the shard of the oldest request,
        whose reply a worker answering in order writes first, then sweep every shard."""
        oldest: tuple[float, str] | None = None
        for tag, awaited in self._by_tag.items():
            if awaited:
                sent = next(iter(awaited.values()))[1]
                if oldest is None or sent < oldest[0]:
                    oldest = (sent, tag)
        if oldest is None:
            return
        oldest_sent, tag = oldest
        left_s = oldest_sent + self.timeout_s - time.monotonic()
        if left_s <= 0:
            raise WaitTimeout(f"no reply within {self.timeout_s:g} s")
        keys_ = list(itertools.islice(self._by_tag[tag], _MAX_WAIT_KEYS))
        block_s = max(round(min(left_s, _SHARD_BLOCK_S), 3), 0.001)
        item = self.shards[tag].blpop(keys_, block_s)
        if item is not None:
            popped = [(as_bytes(item[0]), as_bytes(item[1]))]
            self._record(tag, popped, time.monotonic())
        if take_new is not None:
            take_new()
        self._sweep()

    def _sweep(self) -> None:
        """One packed round of ``LPOP``s on every shard awaiting replies, all written first."""
        flights = []
        for tag, awaited in self._by_tag.items():
            if awaited:
                keys_ = list(itertools.islice(awaited, _MAX_WAIT_KEYS))
                flights.append((tag, keys_, resp.send(self.shards[tag], steps.pack_lpops(keys_))))
        try:
            for tag, keys_, flight in flights:
                raws = resp.raise_first_error(flight.receive())
                popped = [(k, r) for k, r in zip(keys_, raws, strict=True) if r is not None]
                self._record(tag, popped, time.monotonic())
        finally:
            for _, _, flight in flights:
                flight.abandon()  # only those an error left unread: their connection goes

    def _record(self, tag: str, popped: Sequence[tuple[bytes, bytes]], now: float) -> None:
        tally = self.tally
        if self.w0 <= now < self.w1:
            tally.completed_in_window += len(popped)
            tally.shard_completed[tag] += len(popped)
        awaited = self._by_tag[tag]
        for key, raw in popped:
            t_ref, _ = awaited.pop(key)
            if not self.w0 <= t_ref < self.w1:
                continue
            got = outcome(raw)
            tally.latencies_ms.append((now - t_ref) * 1000.0)
            tally.worker_ms.append((got.queued_ms, got.inference_ms))
            tally.codes[got.code] += 1
            if got.batch_rows is not None:
                tally.batch_rows.append(got.batch_rows)

    def give_up(self) -> None:
        """Count what is still awaited as lost."""
        self.tally.lost += self.in_flight
        for awaited in self._by_tag.values():
            awaited.clear()


class Outcome(NamedTuple):
    """What the load reads of a reply."""

    code: str  # OK, or the error's code
    batch_rows: int | None  # when ok
    queued_ms: float  # timings_ms: enqueue to its batch's start, on the worker (NaN: none)
    inference_ms: float  # timings_ms: its batch's run


def outcome(raw: bytes) -> Outcome:
    """A reply's code, batch rows and worker timings (protocol section 3).

    Not ``results.parse_reply``: that decodes every output tensor, which the load does not need.
    """
    try:
        doc = msgpack.unpackb(raw, raw=False)
        timings = doc["timings_ms"]
        queued, inference = float(timings["queued"]), float(timings["inference"])
        if doc["ok"]:
            return Outcome("OK", int(doc["batch_rows"]), queued, inference)
        return Outcome(str(doc["error"]["code"]), None, queued, inference)
    except (ValueError, TypeError, KeyError, msgpack.UnpackException):
        return Outcome("BAD_REPLY", None, math.nan, math.nan)
