"""Scenarios that fill Redis: ``maxmemory`` with ``noeviction``, producers refused at the memory
high watermark (``producer.RedisFull``), workers that must drain a full Redis all the same.

The requests go through ``producer.Client``, as a user's would, so the client picks each rid;
a request is registered with the oracle (its expected output) once Redis accepted it. Each
scenario takes its sizes, runs in its own Redis and workdir, and returns a Result.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import redis

from producer import Client, RedbatchError, RedisFull, WaitTimeout
from producer.client.results import Result as Reply
from producer.protocol.keys import reply_key
from producer.redisio.memory import DEFAULT_HIGH_WATERMARK

from .common import DEAD, MODEL, PREFIX, STREAM, ScenarioTimeout, wait_for
from .oracle import Result
from .processes import Settings, WorkerProcess
from .run import Run
from .workload import Expected

_MIB = 1 << 20


_NOEVICTION = ("--maxmemory-policy", "noeviction")


def _limit_memory(r: redis.Redis, mib: float) -> None:
    """Set ``maxmemory`` to ``mib`` above what Redis uses now, with its workers connected: the
    room is the same whatever the server's own baseline is on the machine at hand."""
    r.config_set("maxmemory", _memory(r)["used_memory"] + int(mib * _MIB))


def _memory(r: redis.Redis) -> dict[str, int]:
    info: dict[str, Any] = r.info("memory")  # type: ignore[assignment]
    return {k: int(info[k]) for k in ("used_memory", "maxmemory")}


def _mib(nbytes: float) -> float:
    return round(nbytes / _MIB, 2)


class Inputs:
    """Request inputs and their expected outputs (a direct onnxruntime run of the reference
    model), for requests that ``producer.Client`` sends; one per producer thread (its rng)."""

    def __init__(self, run: Run, session: ort.InferenceSession, seed: int) -> None:
        self.requests = run.requests
        self.session = session
        self.rng = np.random.default_rng(seed)

    def make(self, n: int) -> tuple[list[dict[str, np.ndarray]], list[np.ndarray]]:
        """``n`` requests of 1 to 3 rows and their expected ``y``, in order."""
        rows = self.rng.integers(1, 4, n)
        x = self.rng.standard_normal((int(rows.sum()), 8)).astype(np.float32)
        y = self.session.run(["y"], {"x": x})[0]
        cuts = np.cumsum(rows)[:-1]
        return [{"x": part} for part in np.split(x, cuts)], np.split(y, cuts)

    def accepted(self, rids: Sequence[str], ys: Sequence[np.ndarray]) -> None:
        """Register requests Redis accepted with the oracle. The client encoded the bodies; the
        oracle only needs each rid known (its duplicate count looks rids up in ``bodies``)."""
        for rid, y in zip(rids, ys, strict=True):
            self.requests.expected[rid] = Expected(y=y)
            self.requests.bodies[rid] = b""


def _session(run: Run) -> ort.InferenceSession:
    return ort.InferenceSession(
        str(run.workdir / "reference.onnx"), providers=["CPUExecutionProvider"]
    )


@dataclass
class Tally:
    """One producer's outcome: what Redis accepted, what the client refused, anything else."""

    accepted: list[str] = field(default_factory=list)
    refused_calls: int = 0
    refused_requests: int = 0
    refused_by: Counter[str] = field(default_factory=Counter)  # watermark / oom
    other: list[str] = field(default_factory=list)  # any error but RedisFull: must stay empty
    longest_submit_s: float = 0.0

    def refused(self, exc: RedisFull, n: int) -> None:
        self.refused_calls += 1
        self.refused_requests += n
        self.refused_by["oom" if exc.refused is not None else "watermark"] += 1

    @staticmethod
    def merge(tallies: Sequence[Tally]) -> Tally:
        out = Tally()
        for t in tallies:
            out.accepted += t.accepted
            out.refused_calls += t.refused_calls
            out.refused_requests += t.refused_requests
            out.refused_by.update(t.refused_by)
            out.other += t.other
            out.longest_submit_s = max(out.longest_submit_s, t.longest_submit_s)
        return out


class MemorySampler(threading.Thread):
    """``INFO memory`` every ``period_s``: the largest ``used_memory`` seen."""

    def __init__(self, url: str, period_s: float = 0.02) -> None:
        super().__init__(name="memory-sampler", daemon=True)
        self.r = redis.Redis.from_url(url, socket_timeout=10)
        self.period_s = period_s
        self.max_used = 0
        self._done = threading.Event()

    def run(self) -> None:
        try:
            while True:
                with contextlib.suppress(redis.RedisError):
                    self.max_used = max(self.max_used, _memory(self.r)["used_memory"])
                if self._done.wait(self.period_s):  # a sampling period, not synchronisation
                    return
        finally:
            self.r.close()

    def stop(self) -> int:
        self._done.set()
        self.join(10)
        return self.max_used


def _judge(
    run: Run, replies: dict[str, Reply], rids: Sequence[str], doubled: Sequence[str] = ()
) -> list[str]:
    """The oracle for replies the producers read (and so consumed): every rid read exactly once,
    its outputs those of the direct onnxruntime run."""
    problems = []
    missing = [rid for rid in rids if rid not in replies]
    if missing:
        problems.append(f"{len(missing)} accepted requests got no reply, e.g. {missing[:5]}")
    if doubled:
        problems.append(f"{len(doubled)} requests were read twice: {list(doubled)[:5]}")
    wrong = []
    for rid in rids:
        got = replies.get(rid)
        if got is None:
            continue
        want = run.requests.expected[rid].y
        if got.rid != rid:
            wrong.append(f"{rid}: reply names rid {got.rid}")
        elif not got.ok or got.outputs is None:
            wrong.append(f"{rid}: expected outputs, got {got.error}")
        elif want is None or not np.allclose(got.outputs["y"], want, 1e-5, 1e-6):
            wrong.append(f"{rid}: outputs differ from the direct onnxruntime run")
    if wrong:
        problems.append(f"{len(wrong)} wrong replies: {wrong[:5]}")
    return problems


def _leftover_replies(r: redis.Redis) -> list[str]:
    """Reply lists still in Redis once every producer read its replies: a second reply written
    after the first was read, or a reply to a request no producer knows it sent."""
    pattern = reply_key(PREFIX, MODEL, "x")[:-1] + "*"
    return [k.decode() for k in r.scan_iter(match=pattern, count=1000)]


def _read_all(client: Client, rids: Sequence[str], timeout_s: float) -> dict[str, Reply]:
    """Read (and so consume) the replies of ``rids``, as their producer would."""
    out: dict[str, Reply] = {}
    for i in range(0, len(rids), 1000):
        with contextlib.suppress(WaitTimeout):
            for reply in client.wait_many(rids[i : i + 1000], timeout_s):
                out[reply.rid] = reply
    return out


# Scenario 1 ------------------------------------------------------------------------------------


def _fill_until_refused(client: Client, inputs: Inputs, tally: Tally, chunk: int) -> None:
    """``submit_many`` in chunks until the client refuses with RedisFull."""
    while True:
        batch, ys = inputs.make(chunk)
        try:
            rids = client.submit_many(batch)
        except RedisFull as exc:
            tally.refused(exc, len(batch))
            return
        except Exception as exc:  # anything else is a failure of the feature under test
            tally.other.append(repr(exc))
            return
        inputs.accepted(rids, ys)
        tally.accepted += rids


def _raw_fill(run: Run, chunk: int = 256) -> tuple[list[str], Exception | None]:
    """XADD requests with redis-py, past the producers' watermark, until Redis refuses one (for
    memory, it must be): the room the watermark left. Returns the accepted rids and the error."""
    accepted: list[str] = []
    for _ in range(10_000):
        rids = run.requests.make(chunk, "raw")
        pipe = run.r.pipeline(transaction=False)
        for rid in rids:
            pipe.xadd(STREAM, {"rid": rid, "body": run.requests.bodies[rid]})
        answers = pipe.execute(raise_on_error=False)
        # Every XADD of the pipeline ran: one after a refusal may still be accepted, when
        # used_memory dropped in between (a client's buffers freed), and is then queued too.
        accepted += [r for r, a in zip(rids, answers, strict=True) if not isinstance(a, Exception)]
        refusals = [a for a in answers if isinstance(a, Exception)]
        if refusals:
            return accepted, refusals[0]
    return accepted, None


def _signal_all(workers: Sequence[WorkerProcess], sig: signal.Signals) -> None:
    for w in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.pid, sig)


class _Producers:
    """Scenario 1's producers: one ``Client`` (default watermark) and its inputs each."""

    def __init__(self, run: Run, count: int, seed: int) -> None:
        self.run = run
        session = _session(run)
        self.clients = [Client(MODEL, run.redis.url, prefix=PREFIX) for _ in range(count)]
        self.inputs = [Inputs(run, session, seed * 100 + i) for i in range(count)]
        self.tallies = [Tally() for _ in range(count)]

    def fill(self, chunk: int, timeout_s: float) -> None:
        """Every producer at once, each until it is refused."""
        threads = [
            threading.Thread(target=_fill_until_refused, args=(*p, chunk), name=f"producer{i}")
            for i, p in enumerate(zip(self.clients, self.inputs, self.tallies, strict=True))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        if any(t.is_alive() for t in threads):
            raise ScenarioTimeout("the producers were never refused")

    def refused_again(self, chunk: int) -> None:
        """One more submit each (they must be refused), and one from a client with its
        watermark off, which must be refused by Redis itself (RedisFull, never
        ConnectionFailed)."""
        for p in zip(self.clients, self.inputs, self.tallies, strict=True):
            _fill_until_refused(*p, chunk)
        blind = Tally()
        with Client(MODEL, self.run.redis.url, prefix=PREFIX, memory_high_watermark=None) as c:
            _fill_until_refused(c, self.inputs[0], blind, chunk)
        self.tallies.append(blind)
        if blind.accepted or blind.refused_by["oom"] != 1:
            self.run.result.problems.append(
                f"a client with no watermark on a full Redis: {len(blind.accepted)} accepted, "
                f"refusals {dict(blind.refused_by)}, {blind.other}"
            )

    def submit_again(self, n: int) -> list[str]:
        """``n`` more requests each, which Redis must accept now."""
        again: list[str] = []
        for c, inp in zip(self.clients, self.inputs, strict=True):
            batch, ys = inp.make(n)
            try:
                rids = c.submit_many(batch)
            except RedbatchError as exc:
                self.run.result.problems.append(f"no submit after the drain: {exc!r}")
                continue
            inp.accepted(rids, ys)
            again += rids
        return again

    def close(self) -> None:
        for c in self.clients:
            c.close()


def _fill(run: Run, producers: _Producers, chunk: int, timeout_s: float) -> list[str]:
    """Producers until refused, then raw XADDs until Redis refuses for memory, then the
    producers refused again there. Returns the raw XADDs' rids."""
    notes = run.result.notes
    t0 = time.monotonic()
    producers.fill(chunk, timeout_s)
    notes["fill_s"] = round(time.monotonic() - t0, 1)
    at_refusal = _memory(run.r)
    notes["used_at_refusal_mib"] = _mib(at_refusal["used_memory"])
    notes["maxmemory_mib"] = _mib(at_refusal["maxmemory"])
    raw, refusal = _raw_fill(run)
    notes["raw_xadds_past_watermark"] = len(raw)
    notes["used_at_oom_mib"] = _mib(_memory(run.r)["used_memory"])
    if not isinstance(refusal, redis.exceptions.OutOfMemoryError):
        run.result.problems.append(f"raw XADDs past the watermark ended with {refusal!r}")
    producers.refused_again(chunk)
    return raw


def _start_fresh(run: Run, timeout_s: float) -> float:
    """A fresh worker on the full Redis, alone (the others are stopped), must become ready.
    Returns when it was started (monotonic)."""
    started = time.monotonic()
    fresh = run.pool.start("fresh")
    try:
        wait_for(lambda: fresh.is_ready(run.r), timeout_s, "a fresh worker on the full Redis")
        run.result.notes["fresh_ready_s"] = round(time.monotonic() - started, 1)
    except ScenarioTimeout as exc:
        run.result.problems.append(f"{exc}; its log:\n{fresh.log_tail()}")
    return started


def stopped_workers_fill(
    workdir: Path,
    *,
    workers: int = 2,
    producers: int = 2,
    maxmemory_mib: float = 12,
    chunk: int = 64,
    resubmit: int = 64,
    timeout_s: float = 120.0,
    seed: int = 12,
) -> Result:
    """Workers ready, then SIGSTOPped; producers (``Client``, default watermark) submit until
    each is refused with RedisFull; raw XADDs fill the room the watermark left until Redis
    refuses for memory (OOM), and a client with its watermark off must get RedisFull there too.
    Then a fresh worker started on that full Redis must become ready, the stopped workers are
    SIGCONTed, and the stream must drain: every accepted request answered once, right, nothing
    pending. Once the producers read their replies they must be able to submit again."""
    s = Settings(claim_idle_ms=1000, max_wait_ms=5)
    args = _NOEVICTION
    with Run("stopped-workers-fill", workdir, seed, s, redis_args=args) as run:
        res = run.result
        notes = res.notes
        for i in range(workers):
            run.pool.start(f"w{i}")
        stopped = run.pool.wait_ready()
        _limit_memory(run.r, maxmemory_mib)
        clients = _Producers(run, producers, seed)
        sampler = MemorySampler(run.redis.url)
        sampler.start()
        _signal_all(stopped, signal.SIGSTOP)
        try:
            raw = _fill(run, clients, chunk, timeout_s)
            started = _start_fresh(run, min(60.0, timeout_s))
        finally:
            _signal_all(stopped, signal.SIGCONT)
        tally = Tally.merge(clients.tallies)
        rids = tally.accepted + raw
        with contextlib.suppress(ScenarioTimeout):  # the oracle says what is left
            wait_for(run.drained, timeout_s, "the full Redis to drain", 0.05)
        notes["drain_s"] = round(time.monotonic() - started, 1)
        notes["peak_used_mib"] = _mib(sampler.stop())  # before the oracle's large pipelines
        notes["used_drained_mib"] = _mib(_memory(run.r)["used_memory"])
        run.check(rids, timeout_s=timeout_s)  # fills the figures (run.finish) once
        checked = time.monotonic()
        _tally_notes(res, tally, len(tally.accepted))
        if not res.passed:  # not drained: reading and submitting again would only wait
            clients.close()
            return res

        # The producers read their replies (the raw ones too), as users would ...
        replies = _read_all(clients.clients[0], rids, timeout_s=10)
        notes["answered"] = len(replies)
        notes["answered_by_fresh"] = sum(1 for r in replies.values() if r.worker == "fresh")
        notes["used_after_reading_mib"] = _mib(_memory(run.r)["used_memory"])
        if not notes["answered_by_fresh"]:
            res.problems.append("the fresh worker answered nothing")
        # ... and can submit again.
        again = clients.submit_again(resubmit)
        after = _read_all(clients.clients[0], again, timeout_s=30)
        res.problems += _judge(run, after, again)
        notes["resubmitted_and_answered"] = len(after)
        clients.close()
        left = _leftover_replies(run.r)
        if left:
            res.problems.append(f"{len(left)} reply lists left after all were read: {left[:5]}")
        res.requests = len(rids) + len(again)
        res.seconds = round(res.seconds + time.monotonic() - checked, 1)
        return res


def _tally_notes(res: Result, tally: Tally, accepted: int) -> None:
    res.notes.update(
        accepted=accepted,
        refused_calls=tally.refused_calls,
        refused_requests=tally.refused_requests,
        refused_by=dict(tally.refused_by),
        other_errors=len(tally.other),
    )
    if tally.other:
        res.problems.append(f"{len(tally.other)} errors other than RedisFull: {tally.other[:3]}")


# Scenario 2 ------------------------------------------------------------------------------------


def _produce(
    client: Client,
    inputs: Inputs,
    chunk: int,
    tally: Tally,
    sent: queue.Queue[tuple[list[str], list[np.ndarray]] | None],
    stop: threading.Event,
    backoff_s: float,
) -> None:
    """Submit at full speed until ``stop``. A refusal (RedisFull) is met by backing off and
    sending the same rows again as new requests; a client with ``wait_for_backlog`` waits in
    ``submit_many`` instead. Accepted requests go to this producer's reader."""
    try:
        while not stop.is_set():
            batch, ys = inputs.make(chunk)
            while True:
                t0 = time.monotonic()
                try:
                    rids = client.submit_many(batch)
                except RedisFull as exc:
                    tally.refused(exc, len(batch))
                    if stop.wait(backoff_s):  # a producer's backoff, not synchronisation
                        return
                    continue
                except Exception as exc:  # anything else is a failure of the feature under test
                    tally.other.append(repr(exc))
                    return
                tally.longest_submit_s = max(tally.longest_submit_s, time.monotonic() - t0)
                inputs.accepted(rids, ys)
                tally.accepted += rids
                sent.put((rids, ys))
                break
    finally:
        sent.put(None)


def _read(
    client: Client,
    sent: queue.Queue[tuple[list[str], list[np.ndarray]] | None],
    replies: dict[str, Reply],
    doubled: list[str],
    tally: Tally,
    timeout_s: float,
) -> None:
    """Read the replies of what the producer sent, chunk by chunk, as it sends (``wait_many``
    consumes them, so the memory they hold is freed as they are read)."""
    while (item := sent.get()) is not None:
        try:
            for reply in client.wait_many(item[0], timeout_s):
                if reply.rid in replies:
                    doubled.append(reply.rid)
                replies[reply.rid] = reply
        except WaitTimeout:
            pass  # the judge counts what is missing
        except Exception as exc:
            tally.other.append(f"reading: {exc!r}")


@dataclass
class _Lane:
    """One producer of scenario 2 (a Client that refuses or one that waits) and its reader."""

    kind: str
    producer: Client
    reader: Client
    inputs: Inputs
    tally: Tally = field(default_factory=Tally)
    sent: queue.Queue[tuple[list[str], list[np.ndarray]] | None] = field(
        default_factory=queue.Queue
    )


class _FullSpeed:
    """Scenario 2's load: its lanes, their threads, and every reply they read."""

    def __init__(self, run: Run, refusing: int, waiting: int, seed: int) -> None:
        url = run.redis.url
        session = _session(run)
        kinds = ["refusing"] * refusing + ["waiting"] * waiting
        self.lanes = [
            _Lane(
                kind,
                Client(MODEL, url, prefix=PREFIX, wait_for_backlog=kind == "waiting"),
                Client(MODEL, url, prefix=PREFIX),
                Inputs(run, session, seed * 100 + i),
            )
            for i, kind in enumerate(kinds)
        ]
        self.stop = threading.Event()
        self.replies: dict[str, Reply] = {}
        self.doubled: list[str] = []
        self.producers: list[threading.Thread] = []
        self.readers: list[threading.Thread] = []

    def start(self, chunk: int, backoff_s: float, timeout_s: float) -> None:
        for i, lane in enumerate(self.lanes):
            produce = (
                lane.producer,
                lane.inputs,
                chunk,
                lane.tally,
                lane.sent,
                self.stop,
                backoff_s,
            )
            read = (lane.reader, lane.sent, self.replies, self.doubled, lane.tally, timeout_s)
            self.producers.append(
                threading.Thread(target=_produce, args=produce, name=f"{lane.kind}{i}")
            )
            self.readers.append(threading.Thread(target=_read, args=read, name=f"reader{i}"))
        for t in self.producers + self.readers:
            t.start()

    def join(self, threads: Sequence[threading.Thread], timeout_s: float) -> list[str]:
        """Join ``threads``; the names of those still running after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in threads if t.is_alive()]

    def close(self) -> None:
        for lane in self.lanes:
            lane.producer.close()
            lane.reader.close()

    def notes(self) -> dict[str, Any]:
        waits = [lane.tally.longest_submit_s for lane in self.lanes if lane.kind == "waiting"]
        return {
            "refused_by_producer": {
                f"{lane.kind}{i}": lane.tally.refused_calls for i, lane in enumerate(self.lanes)
            },
            "longest_waiting_submit_s": round(max(waits, default=0.0), 2),
        }


def full_speed_small_maxmemory(
    workdir: Path,
    *,
    duration_s: float = 15.0,
    workers: int = 2,
    refusing: int = 2,
    waiting: int = 1,
    maxmemory_mib: float = 8,
    chunk: int = 64,
    work_depth: int = 8,
    backoff_s: float = 0.05,
    timeout_s: float = 120.0,
    seed: int = 13,
) -> Result:
    """Producers at full speed against a small ``maxmemory`` for ``duration_s``, so that they
    outrun the workers and reach the watermark again and again: ``refusing`` of them back off
    on RedisFull and send the same rows again as new requests, ``waiting`` use
    ``wait_for_backlog=True``. Each producer reads its replies as it goes (a reader thread,
    ``wait_many``), as a user would; the workers keep the default reply TTL (3600 s). Every
    accepted request must be read exactly once with the right output, no error but RedisFull
    may reach a producer, and the stream must end empty with nothing pending."""
    s = Settings(claim_idle_ms=1000, max_wait_ms=5, work_depth=work_depth)
    args = _NOEVICTION
    with Run("full-speed-small-maxmemory", workdir, seed, s, redis_args=args) as run:
        res = run.result
        for i in range(workers):
            run.pool.start(f"w{i}")
        run.pool.wait_ready()
        _limit_memory(run.r, maxmemory_mib)
        load = _FullSpeed(run, refusing, waiting, seed)
        sampler = MemorySampler(run.redis.url)
        sampler.start()
        load.start(chunk, backoff_s, timeout_s)
        load.stop.wait(duration_s)  # the load's length
        load.stop.set()
        stopped = time.monotonic()
        stuck = load.join(load.producers, timeout_s)
        drained_at = None
        with contextlib.suppress(ScenarioTimeout):  # judged below
            wait_for(run.drained, timeout_s, "the stream to drain", 0.05)
            drained_at = time.monotonic()
        stuck += load.join(load.readers, timeout_s)
        all_read = time.monotonic()
        peak = sampler.stop()
        load.close()
        if stuck:
            res.problems.append(f"threads still running: {stuck}")

        tally = Tally.merge([lane.tally for lane in load.lanes])
        rids = tally.accepted
        mem = _memory(run.r)
        res.problems += _judge(run, load.replies, rids, load.doubled)
        if drained_at is None:
            res.problems.append(f"the stream did not drain: XLEN {run.r.xlen(STREAM)}")
        left = _leftover_replies(run.r)
        if left:
            res.problems.append(f"{len(left)} reply lists left after all were read: {left[:5]}")
        if not tally.refused_calls and peak < mem["maxmemory"] * DEFAULT_HIGH_WATERMARK:
            res.problems.append(
                "the producers never reached the watermark: the scenario tested nothing "
                "(slower workers, more producers or a smaller maxmemory)"
            )
        if run.r.xlen(DEAD):
            res.problems.append(f"{run.r.xlen(DEAD)} dead letters")
        res.duplicates = sum(n - 1 for n in run.executions().values() if n > 1)
        res.requests = len(rids)
        res.lost = sum(1 for rid in rids if rid not in load.replies)
        _tally_notes(res, tally, len(rids))
        res.notes.update(
            load.notes(),
            answered=len(load.replies),
            accepted_per_s=round(len(rids) / duration_s),
            drain_s=None if drained_at is None else round(drained_at - stopped, 1),
            all_read_s=round(all_read - stopped, 1),
            peak_used_mib=_mib(peak),
            maxmemory_mib=_mib(mem["maxmemory"]),
            peak_used_of_max=f"{peak / mem['maxmemory']:.0%}",
        )
        return run.finish()
