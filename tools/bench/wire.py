"""One producer's side of the protocol, made cheap: request bodies, pipelined sends, reply sweeps.

A load generator shares the cores with the worker and Redis it measures, so it does less than
``Client``: bodies are encoded once and reused under fresh rids, submits go out pipelined, and
replies are swept up many keys per round trip (``LPOP``s packed by hand) and read for two
fields only (``outcome``). What each reply says is counted in a ``ProducerTally``;
``tools.bench.load`` drives these pieces in the closed and open loops.
"""

from __future__ import annotations

import itertools
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import numpy as np
import redis

from producer import core, keys, resp
from producer.errors import WaitTimeout

__all__ = [
    "BODIES",
    "Outcome",
    "ProducerTally",
    "Replies",
    "Sender",
    "input_rows",
    "outcome",
    "row_bytes",
]

BODIES = 64  # distinct request bodies a producer cycles through, at most
_BODIES_BYTES = 8 << 20  # and at most this many bytes of them (fewer bodies for big rows)
_MAX_WAIT_KEYS = 1024  # reply keys per BLPOP or sweep; replies come back roughly oldest first


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
    sent: int = 0  # every request sent, warmup included
    lost: int = 0  # no reply within timeout_s
    cpu_s: float = 0.0
    max_send_lag_ms: float = 0.0  # how far an open-loop sender fell behind its schedule


class Sender:
    """Pipelined XADDs of bodies encoded once, under fresh rids (a random tag and a count);
    ``bodies`` given (an encoded image, say) are sent instead of rows drawn for ``inputs``."""

    def __init__(
        self,
        conn: redis.Redis,
        prefix: str,
        model: str,
        inputs: Sequence[dict[str, Any]],
        seed: int,
        bodies: Sequence[bytes] = (),
    ) -> None:
        self.conn = conn
        self.stream = keys.request_stream(prefix, model)
        count = max(1, min(BODIES, _BODIES_BYTES // max(row_bytes(inputs), 1)))
        self.bodies = list(bodies) or [
            core.build_submission(input_rows(inputs, 1, seed + i), now_s=0.0).body
            for i in range(count)
        ]
        self._tag = uuid.uuid4().hex[:12]
        self._next = 0
        self._queued: list[core.Submission] = []

    def rids(self, n: int) -> list[str]:
        """Queue ``n`` requests for the next ``send()``; returns their rids."""
        rids = []
        for _ in range(n):
            rid = f"{self._tag}-{self._next}"
            body = self.bodies[self._next % len(self.bodies)]
            self._next += 1
            self._queued.append(core.Submission(rid, body))
            rids.append(rid)
        return rids

    def send(self) -> None:
        """Send the queued requests in one round trip (packed by hand, as ``Client`` does)."""
        subs, self._queued = self._queued, []
        if subs:
            xadds = core.pack_xadds(self.stream, subs)
            core.check_xadds(xadds, resp.round_trip(self.conn, xadds.packer))


class Replies:
    """The replies one producer awaits, oldest first, each with its reference time.

    A load generator needs only each reply's outcome and batch rows, so it reads those two
    fields (``outcome``) instead of decoding the outputs as ``Client`` does: every CPU
    millisecond it spends is one the worker and Redis do not get on the same cores.
    """

    def __init__(
        self,
        conn: redis.Redis,
        prefix: str,
        timeout_s: float,
        tally: ProducerTally,
        window: tuple[float, float],
    ) -> None:
        self.conn = conn
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.tally = tally
        self.w0, self.w1 = window
        # reply key -> (reference time, send time); dicts keep insertion (send) order
        self._awaited: dict[bytes, tuple[float, float]] = {}

    @property
    def in_flight(self) -> int:
        return len(self._awaited)

    def add(self, rid: str, t_ref: float, sent: float) -> None:
        self._awaited[keys.reply_key(self.prefix, rid).encode()] = (t_ref, sent)

    def round(self, take_new: Callable[[], None] | None = None) -> None:
        """Block for one reply, then sweep up every other reply ready; ``take_new()`` adds the
        requests sent meanwhile first, so replies written in the same batch are swept too.

        WaitTimeout when the oldest request has waited ``timeout_s``.
        """
        oldest_sent = next(iter(self._awaited.values()))[1]
        left_s = oldest_sent + self.timeout_s - time.monotonic()
        if left_s <= 0:
            raise WaitTimeout(f"no reply within {self.timeout_s:g} s")
        keys_ = list(itertools.islice(self._awaited, _MAX_WAIT_KEYS))
        block_s = max(round(min(left_s, core.MAX_BLOCK_S), 3), 0.001)
        item = self.conn.blpop(keys_, block_s)
        if item is None:
            return
        self._record([(core.as_bytes(item[0]), core.as_bytes(item[1]))], time.monotonic())
        if take_new is not None:
            take_new()
        if self._awaited:
            keys_ = list(itertools.islice(self._awaited, _MAX_WAIT_KEYS))
            packed = core.pack_lpops(keys_)
            raws = resp.raise_first_error(resp.round_trip(self.conn, packed))
            now = time.monotonic()
            self._record([(k, r) for k, r in zip(keys_, raws, strict=True) if r is not None], now)

    def _record(self, popped: Sequence[tuple[bytes, bytes]], now: float) -> None:
        tally = self.tally
        if self.w0 <= now < self.w1:
            tally.completed_in_window += len(popped)
        for key, raw in popped:
            t_ref, _ = self._awaited.pop(key)
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
        self._awaited.clear()


class Outcome(NamedTuple):
    """What the load reads of a reply."""

    code: str  # OK, or the error's code
    batch_rows: int | None  # when ok
    queued_ms: float  # timings_ms: enqueue to its batch's start, on the worker (NaN: none)
    inference_ms: float  # timings_ms: its batch's run


def outcome(raw: bytes) -> Outcome:
    """A reply's code, batch rows and worker timings (protocol section 3).

    Not ``core.parse_reply``: that decodes every output tensor, which the load does not need.
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
