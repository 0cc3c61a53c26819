"""Driver (b): fuzzed entries through a real worker via Redis, every reply read back and checked."""

from __future__ import annotations

import os
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from producer.protocol.codec import Reply, decode_reply, encode_request
from producer.protocol.errors import WireFormatError
from producer.protocol.keys import CONSUMER_GROUP, dead_key, reply_key, request_stream, workers_key
from worker.intake.admit import admit
from worker.items import Admitted, DeadLetter, Item
from worker.model.schema import Schema

from .bodies import MIN_TTL_S
from .mutator import Mutator, fuzz_entry
from .oracle import WORKER_CODES, expected_codes, raw_entry
from .rss import Rss
from .target import FuzzTarget, schema_for


@dataclass(slots=True)
class _Sent:
    """What is known about one input sent: its rid, how it was made and the codes allowed."""

    rid: str
    mutation: str
    expected: frozenset[str]
    healthy: dict[str, np.ndarray] | None = None
    rows: int = 0
    outputs: tuple[str, ...] = ()
    may_expire: bool = False


def wait_for_worker(redis_url: str, target: FuzzTarget, timeout_s: float = 120.0) -> None:
    """Block until a worker has registered for ``target.model`` (it registers once warmed up)."""
    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + timeout_s
        while not client.scard(workers_key(target.prefix, target.model)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no worker registered for {target.model} in {timeout_s}s")
            time.sleep(0.1)
    finally:
        client.close()


def fuzz_worker(
    redis_url: str,
    n: int,
    seed: int,
    *,
    target: FuzzTarget | None = None,
    worker_pid: int | None = None,
    healthy_every: int = 50,
    reference: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
    chunk: int = 500,
    window: int = 5000,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Send ``n`` fuzzed entries (plus a healthy request every ``healthy_every``) to a running
    worker and check every answer; returns a plain summary dict (see ``_summary`` for keys).

    XADDs go out pipelined in chunks, keeping at most ``window`` entries unanswered; replies are
    read back in bulk once the stream is drained. ``worker_pid`` (a subprocess worker) is
    watched for death and its VmRSS sampled; without it this process's RSS is sampled, which
    suits a worker running in a thread here. ``reference`` maps a healthy request's inputs to
    the outputs a bare runtime gives, to check healthy answers by value.
    """
    target = target or FuzzTarget()
    client = redis.Redis.from_url(redis_url, socket_timeout=60)
    stream = request_stream(target.prefix, target.model)
    dead = dead_key(target.prefix, target.model)
    schema = schema_for(target)
    mutator = Mutator(target, seed)
    tag = secrets.token_hex(3)
    rss = Rss(worker_pid or os.getpid())
    dead_before = client.xlen(dead)
    sent: list[_Sent] = []
    bad_rids = 0
    alive = True
    started = time.perf_counter()
    try:
        for first in range(0, n, chunk):
            alive = _wait_backlog(client, stream, window, rss, worker_pid, timeout_s)
            if not alive:
                break
            pipe = client.pipeline(transaction=False)
            now_ms = int(time.time() * 1000)
            for index in range(first, min(first + chunk, n)):
                if healthy_every and index % healthy_every == 0:
                    sent.append(_healthy(mutator, f"fz{tag}-h{index}", pipe, stream))
                rid, body, mutation = fuzz_entry(mutator, index)
                fields = {b"rid": rid} if body is None else {b"rid": rid, b"body": body}
                pipe.xadd(stream, fields)  # type: ignore[arg-type]
                item = admit(raw_entry(rid, body), schema, target.max_request_bytes)
                if isinstance(item, DeadLetter):
                    bad_rids += 1
                    continue
                sent.append(_predicted(rid.decode(), item, mutation, schema, now_ms))
            pipe.execute()
            if (first + chunk) * 10 // n > first * 10 // n:
                rss.timeline_kb.append(rss.end_kb)
        alive = alive and _wait_backlog(client, stream, 0, rss, worker_pid, timeout_s)
        rss.sample()
        drained_s = time.perf_counter() - started
        result = _collect(client, target, sent, reference)
        result["dead_lettered"] = client.xlen(dead) - dead_before
    finally:
        client.close()
    return _summary(target, seed, n, sent, bad_rids, result, alive, rss, drained_s)


def _healthy(mutator: Mutator, rid: str, pipe: Any, stream: str) -> _Sent:
    inputs = mutator.valid_inputs()
    pipe.xadd(stream, {"rid": rid, "body": encode_request(inputs)})
    rows = next(iter(inputs.values())).shape[0]
    outputs = tuple(mutator.spec.outputs)
    return _Sent(rid, "healthy", frozenset({"OK"}), inputs, rows, outputs)


def _predicted(rid: str, item: Item, mutation: str, schema: Schema, now_ms: int) -> _Sent:
    entry = _Sent(rid, mutation, expected_codes(item, schema, now_ms))
    ttl = None if isinstance(item, DeadLetter) else item.reply_ttl_s
    entry.may_expire = ttl is not None and ttl < MIN_TTL_S
    if isinstance(item, Admitted):
        entry.rows = item.request.rows
        entry.outputs = item.request.outputs
    return entry


def _wait_backlog(
    client: redis.Redis,
    stream: str,
    limit: int,
    rss: Rss,
    worker_pid: int | None,
    timeout_s: float,
) -> bool:
    """Wait until at most ``limit`` entries are unanswered; False if the worker died."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not rss.sample() and worker_pid is not None:
            return False
        pipe = client.pipeline(transaction=False)
        pipe.xlen(stream)
        pipe.xpending(stream, CONSUMER_GROUP)
        try:
            backlog, pending = pipe.execute()
        except redis.ResponseError:  # no group yet: the worker has not started
            backlog, pending = client.xlen(stream), {"pending": 0}
        if backlog <= limit and (limit or not pending["pending"]):
            return True
        if time.monotonic() > deadline:
            raise TimeoutError(f"{backlog} entries still unanswered after {timeout_s}s")
        time.sleep(0.02 if limit else 0.05)


def _collect(
    client: redis.Redis,
    target: FuzzTarget,
    sent: list[_Sent],
    reference: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None,
) -> dict[str, Any]:
    """Read every reply key (LLEN and LINDEX, pipelined), check it, then delete it."""
    codes: Counter[str] = Counter()
    counts = Counter[str]()
    examples: list[dict[str, Any]] = []

    def fail(kind: str, s: _Sent, detail: str) -> None:
        counts[kind] += 1
        if len(examples) < 10:
            examples.append({"kind": kind, "rid": s.rid, "mutation": s.mutation, "detail": detail})

    for first in range(0, len(sent), 1000):
        part = sent[first : first + 1000]
        pipe = client.pipeline(transaction=False)
        for s in part:
            key = reply_key(target.prefix, target.model, s.rid)
            pipe.llen(key)
            pipe.lindex(key, 0)
            pipe.delete(key)
        answers = pipe.execute()
        for offset, s in enumerate(part):
            length, raw = answers[3 * offset], answers[3 * offset + 1]
            if not length:
                if s.may_expire:
                    counts["expired_unchecked"] += 1  # asked for a short reply_ttl_s
                else:
                    fail("missing_replies", s, "no reply")
                continue
            if length > 1:
                fail("duplicate_replies", s, f"{length} replies")
            try:
                reply = decode_reply(raw)
            except WireFormatError as exc:
                fail("undecodable_replies", s, str(exc)[:200])
                continue
            code = "OK" if reply.ok else reply.error.code if reply.error else "?"
            codes[code] += 1
            if code not in WORKER_CODES:
                fail("unexpected_codes", s, _detail(reply))
            elif code not in s.expected:
                fail("wrong_codes", s, f"expected {sorted(s.expected)}: {_detail(reply)}")
            elif reply.ok and not _outputs_fit(reply, s, reference):
                fail("wrong_outputs", s, _detail(reply))
    return {
        "replies_by_code": dict(sorted(codes.items())),
        "failures": counts,
        "examples": examples,
    }


def _detail(reply: Reply) -> str:
    if reply.ok:
        shapes = {n: list(a.shape) for n, a in (reply.outputs or {}).items()}
        return f"OK {shapes}"
    assert reply.error is not None
    return f"{reply.error.code}: {reply.error.message[:200]}"


def _outputs_fit(
    reply: Reply,
    s: _Sent,
    reference: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None,
) -> bool:
    """The asked-for outputs, each with the request's rows; healthy ones by value if we can."""
    outputs = reply.outputs or {}
    if set(outputs) != set(s.outputs) or any(a.shape[:1] != (s.rows,) for a in outputs.values()):
        return False
    if s.healthy is None or reference is None:
        return True
    expected = reference(s.healthy)
    return all(np.allclose(outputs[name], expected[name], rtol=1e-4, atol=1e-5) for name in outputs)


def _summary(
    target: FuzzTarget,
    seed: int,
    n: int,
    sent: list[_Sent],
    bad_rids: int,
    result: dict[str, Any],
    alive: bool,
    rss: Rss,
    drained_s: float,
) -> dict[str, Any]:
    failures: Counter[str] = result["failures"]
    healthy = sum(1 for s in sent if s.healthy is not None)
    dead_ok = result["dead_lettered"] == bad_rids
    keys = ("missing_replies", "duplicate_replies", "undecodable_replies", "unexpected_codes")
    counts = {k: failures.get(k, 0) for k in (*keys, "wrong_codes", "wrong_outputs")}
    expired = failures.get("expired_unchecked", 0)
    return {
        "seed": seed,
        "model": target.model,
        "max_request_bytes": target.max_request_bytes,
        "max_batch_size": target.max_batch_size,
        "inputs": n,
        "healthy_requests": healthy,
        "bad_rid_entries": bad_rids,
        "dead_lettered": result["dead_lettered"],
        "replies_by_code": result["replies_by_code"],
        **counts,
        "expired_unchecked": expired,
        "crashes": 0 if alive else 1,
        "worker_alive": alive,
        "worker_rss_mb": rss.summary(),
        "elapsed_s": round(drained_s, 1),
        "inputs_per_s": round(n / drained_s) if drained_s else 0,
        "failure_examples": result["examples"],
        "ok": alive and dead_ok and not any(counts.values()),
    }
