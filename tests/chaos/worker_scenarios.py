"""Scenarios that fault the workers: SIGKILLs at random moments and at fault points, a crash pill,
batches slower than ``claim_idle_ms``, SIGTERM mid-batch. Each takes its sizes, runs in its own
Redis and workdir, and returns a Result. The kill scenarios take ``cluster`` (``Run``'s): True or a
started ``LocalCluster`` runs them on a Redis Cluster, the workers pointed at a node that does not
own the model's slot."""

from __future__ import annotations

import contextlib
import random
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from producer.protocol.codec import decode_reply
from producer.protocol.keys import reply_key

from .common import CRASH_VALUE, MODEL, POINTS, PREFIX, ScenarioTimeout, wait_for
from .model import slow_depth
from .oracle import Result
from .processes import Settings, WorkerProcess
from .run import Run

if TYPE_CHECKING:
    from tools.localcluster import LocalCluster


def random_kills(
    workdir: Path,
    *,
    requests: int = 1000,
    workers: int = 2,
    kills: int = 3,
    duration_s: float = 10.0,
    seed: int = 1,
    cluster: bool | LocalCluster = False,
    lanes: bool = False,
) -> Result:
    """SIGKILL a serving worker at random moments under paced load (one holding entries when
    there is one); each is restarted, half the time under its old name (it takes back its own
    pending entries), half under a new one (another worker must claim them, and the dead
    consumer must be removed). With ``lanes`` each request goes to a lane drawn from
    ``lanes.MIX`` (raw version 2 XADDs among them), and each reply must name its lane; batches
    then hold 4 rows, so that lower-class requests of 2 or 3 rows are often split across two
    batches behind higher-class ones (worker/answer/parts.py), and killed between the parts.

    A restarted worker takes back its own pending entries first, each alone, and a kill that
    falls on it again meanwhile finds the same entries in hand: with ``kills`` of 3 a healthy
    request can be held at every death and be poisoned, as max_deliveries 3 says it must (seen
    once in the fast tier across lanes). As in ``fault_storm`` the oracle wants every healthy
    request answered, so deliveries are allowed past the kills; the crash pill tests poisoning."""
    s = Settings(
        claim_idle_ms=1000,
        max_wait_ms=50,
        work_width=512,
        work_depth=4,
        max_batch_size=4 if lanes else 32,
        max_deliveries=kills + 2,
    )
    name = "random-kills" + ("-lanes" if lanes else "")
    with Run(name, workdir, seed, s, cluster=cluster) as run:
        generation = Counter[str]()
        names = random.Random(seed + 1)  # used on the pool's watcher threads

        def restart(w: WorkerProcess) -> tuple[str, str]:
            base = w.name.split("-r")[0]
            if names.random() < 0.5:
                return w.name, ""
            generation[base] += 1
            return f"{base}-r{generation[base]}", ""

        run.pool.restart = restart
        rids = run.requests.make(requests, "rk", bad_fraction=0.03)
        if lanes:
            rids = run.laned(rids)
        for i in range(workers):
            run.pool.start(f"w{i}")
        run.pool.wait_ready()
        sender = run.send_in_background(rids, rate_per_s=requests / duration_s, chunk=4)
        start = time.monotonic()
        times = sorted(run.rng.uniform(0.3, duration_s) for _ in range(kills))
        holding = 0
        for t in times:
            time.sleep(max(0.0, start + t - time.monotonic()))  # the kill schedule
            ready = run.pool.wait_ready(count=1)
            pending = {c["name"].decode(): int(c["pending"]) for c in run.consumers()}
            busy = [w for w in ready if pending.get(w.name)]
            victim = run.rng.choice(busy or ready)
            holding += bool(busy)
            victim.kill()
        run.join_sender(sender)
        run.pool.wait_ready(count=workers)
        run.result.notes["kills_with_entries_in_hand"] = holding
        res = run.check(rids, timeout_s=60)
        if res.kills < kills:
            res.problems.append(f"only {res.kills} of {kills} kills happened")
        return res


def phase_kills(
    workdir: Path,
    point: str,
    *,
    requests: int = 300,
    workers: int = 2,
    kills: int = 1,
    seed: int = 2,
    cluster: bool | LocalCluster = False,
) -> Result:
    """One worker armed to SIGKILL itself at ``point`` (each time it gets there) until ``kills``
    deaths; each replacement gets a new name, so its entries must be claimed by another worker.

    An armed replacement may claim its dead predecessor's entry itself and run it alone, dying
    on it again, so with ``kills`` of 3 one healthy request can be in hand at all three deaths
    and is poisoned, as max_deliveries 3 says it must be (half the full tier's runs of
    ``after_inference`` here, on the commit before pipelines too). As in ``fault_storm``, the
    oracle wants every healthy request answered, so deliveries are allowed past the kills; the
    crash pill scenario tests poisoning."""
    s = Settings(claim_idle_ms=800, max_wait_ms=10, work_depth=2, max_deliveries=kills + 2)
    with Run(f"kill-{point}", workdir, seed, s, cluster=cluster) as run:
        armed = f"{point}=kill"
        deaths = Counter[str]()

        def restart(w: WorkerProcess) -> tuple[str, str]:
            deaths["n"] += 1
            return f"a{deaths['n']}", armed if deaths["n"] < kills else ""

        run.pool.restart = restart
        rids = run.requests.make(requests, point, bad_fraction=0.02)
        run.pool.start("a0", armed)
        run.pool.wait_ready()
        sender = run.send_in_background(rids, rate_per_s=requests / 2.0)
        for i in range(1, workers):
            run.pool.start(f"w{i}")
        run.join_sender(sender)
        deadline = time.monotonic() + 60
        while run.pool.kills < kills and time.monotonic() < deadline:
            # The armed replacement came up after the load: give it work until it dies.
            run.pool.wait_ready(count=workers)
            extra = run.requests.make(2 * s.max_batch_size, point)
            rids += extra
            run.send(extra)
            with contextlib.suppress(ScenarioTimeout):
                run.pool.wait_exits(len(run.pool.exits) + 1, timeout_s=3)
        run.pool.wait_ready(count=workers)
        res = run.check(rids, timeout_s=60)
        if res.kills < kills:
            res.problems.append(f"only {res.kills} of {kills} kills at {point} happened")
        return res


def fault_storm(
    workdir: Path,
    *,
    requests: int = 1000,
    workers: int = 2,
    kills: int = 3,
    probability: float = 0.02,
    duration_s: float = 8.0,
    seed: int = 9,
    cluster: bool | LocalCluster = False,
) -> Result:
    """Every worker armed at all four fault points with ``probability`` per hit, restarted armed
    (under its old name) until ``kills`` deaths, then clean: kills at random points in the code.

    A healthy request that happens to be in hand at three of its workers' deaths is poisoned,
    as max_deliveries 3 says it must be. That is likelier than it looks: a worker restarted
    under its name claims its oldest pending entry first and runs it alone, so the deaths of an
    armed worker fall again and again on the same entry. The full tier saw one healthy request
    poisoned in five runs (its logs were not kept). The oracle wants every healthy request
    answered, so this storm allows five deliveries; the crash pill scenario tests poisoning."""
    s = Settings(claim_idle_ms=800, max_wait_ms=20, work_depth=4, max_deliveries=5)
    with Run("fault-storm", workdir, seed, s, cluster=cluster) as run:
        armed = ",".join(f"{p}=kill:{probability}" for p in POINTS)
        deaths = Counter[str]()

        def restart(w: WorkerProcess) -> tuple[str, str]:
            deaths["n"] += 1
            return w.name, armed if deaths["n"] < kills else ""

        run.pool.restart = restart
        rids = run.requests.make(requests, "fs", bad_fraction=0.02)
        for i in range(workers):
            run.pool.start(f"w{i}", armed)
        run.pool.wait_ready()
        run.send(rids, rate_per_s=requests / duration_s, chunk=4)
        deadline = time.monotonic() + 60
        while run.pool.kills < kills and time.monotonic() < deadline:
            # The dice can spare the armed workers through the whole load (bigger batches on a
            # slower machine mean fewer hits): give them more work until they have died.
            run.pool.wait_ready(count=workers)
            extra = run.requests.make(8 * s.max_batch_size, "fs")
            rids += extra
            run.send(extra, chunk=4)
            with contextlib.suppress(ScenarioTimeout):
                run.pool.wait_exits(len(run.pool.exits) + 1, timeout_s=3)
        run.pool.wait_ready(count=workers)
        res = run.check(rids, timeout_s=60)
        if res.kills < kills:
            res.problems.append(f"only {res.kills} of {kills} kills at fault points happened")
        return res


def crash_pill(
    workdir: Path,
    *,
    healthy: int = 31,
    workers: int = 2,
    max_deliveries: int = 3,
    claim_idle_ms: int = 600,
    seed: int = 6,
) -> Result:
    """A request that kills its worker inside inference, in one batch with ``healthy`` others.
    Dead workers come back under the same name. The pill must end POISONED in the dead-letter
    stream after at most ``max_deliveries`` deliveries; the healthy ones must all succeed."""
    s = Settings(claim_idle_ms=claim_idle_ms, max_deliveries=max_deliveries, max_wait_ms=200)
    with Run("crash-pill", workdir, seed, s) as run:
        rids = run.requests.make(healthy, "cp")
        pill = run.requests.pill("cp")
        rids.insert(run.rng.randrange(len(rids) + 1), pill)
        run.send(rids, chunk=len(rids))  # all in the stream before any worker reads: one batch
        run.pool.restart = lambda w: (w.name, w.faults)
        for i in range(workers):
            run.pool.start(f"w{i}", f"crash_value={CRASH_VALUE}")
        res = run.check(rids, poison=[pill], timeout_s=60)
        execs = run.executions()
        res.notes["pill_executions"] = execs[pill]
        res.notes["healthy_max_executions"] = max(execs[r] for r in rids if r != pill)
        if res.kills > max_deliveries:
            res.problems.append(
                f"{res.kills} workers died for one pill (max_deliveries {max_deliveries})"
            )
        if res.duplicates:
            res.problems.append(f"{res.duplicates} duplicate executions: the crashed run counted?")
        if execs[pill] > max_deliveries:
            res.problems.append(f"the pill ran {execs[pill]} times")
        if res.kills == 0:
            res.problems.append("the pill never killed a worker: the scenario tested nothing")
        return res


def slow_batch(
    workdir: Path,
    *,
    requests: int = 128,
    workers: int = 2,
    claim_idle_ms: int = 300,
    seed: int = 7,
) -> Result:
    """Batches that run about 3 x ``claim_idle_ms``: lease renewal must keep other workers from
    claiming them, so nothing runs twice."""
    depth = slow_depth(3 * claim_idle_ms)
    s = Settings(claim_idle_ms=claim_idle_ms, max_wait_ms=50, work_width=1024, work_depth=depth)
    with Run("slow-batch", workdir, seed, s) as run:
        rids = run.requests.make(requests, "sb")
        for i in range(workers):
            run.pool.start(f"w{i}")
        run.pool.wait_ready()
        run.send(rids, rate_per_s=requests / 2.0)
        res = run.check(rids, timeout_s=120)
        slowest = _slowest_inference_ms(run, rids)
        res.notes["slowest_batch_ms"] = round(slowest)
        if slowest <= claim_idle_ms:
            res.problems.append(f"no batch ran longer than claim_idle_ms ({slowest:.0f} ms)")
        if res.duplicates:
            res.problems.append(f"{res.duplicates} requests ran twice despite lease renewal")
        return res


def _slowest_inference_ms(run: Run, rids: Sequence[str]) -> float:
    pipe = run.r.pipeline(transaction=False)
    for rid in rids:
        pipe.lindex(reply_key(PREFIX, MODEL, rid), 0)
    times = [decode_reply(raw).timings_ms.get("inference", 0.0) for raw in pipe.execute() if raw]
    return max(times, default=0.0)


def sigterm_mid_batch(
    workdir: Path,
    *,
    requests: int = 160,
    grace_s: float = 20.0,
    batch_ms: int = 800,
    seed: int = 8,
) -> Result:
    """SIGTERM while a slow batch (about ``batch_ms``) runs: exit 0 within ``grace_s``, nothing
    left pending on it, its consumer gone; a second worker then serves the rest, and nothing ran
    twice."""
    depth = slow_depth(batch_ms)
    s = Settings(claim_idle_ms=1000, max_wait_ms=50, work_width=1024, work_depth=depth)
    with Run("sigterm", workdir, seed, s) as run:
        rids = run.requests.make(requests, "st")
        first = run.pool.start("term")
        run.pool.wait_ready()
        run.send(rids, chunk=64)
        wait_for(lambda: run.pending_of("term") > 0, 30, "the worker to hold a batch")
        t0 = time.monotonic()
        first.terminate()
        try:
            rc = first.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - t0
        res = run.result
        res.notes["stop_s"] = round(took, 2)
        if rc != 0:
            res.problems.append(f"SIGTERM: exit {rc} after {took:.1f}s (grace {grace_s}s)")
        if run.pending_of("term"):
            res.problems.append("entries left pending on the stopped worker")
        if "term" in [c["name"].decode() for c in run.consumers()]:
            res.problems.append("the stopped worker's consumer is still in the group")
        run.pool.start("after")
        run.check(rids, timeout_s=120)
        if res.duplicates:
            res.problems.append(f"{res.duplicates} requests ran twice")
        return res
