"""Scenarios that move a Redis Cluster under the workers: a master SIGKILLed while requests flow
(its replica promoted), and a shard's slot migrated to another master under load. Each runs the
chaos model on ``shards`` shards (one per master), worker subprocesses pointed at a node that
does not own the model's slot, and returns a Result with the cluster's figures in its notes.

Replication is asynchronous: a write a master acknowledged may die with it before its replica
has it. ``master_failover`` measures that with a tight XADD loop (one XADD a round trip, each
acknowledgement recorded with the node that gave it) on the doomed master's shard, counts what
the promoted replica lacks (no entry, no reply, no dead letter), and then does what a client
does for a request whose reply never comes: sends it again with the same rid. The oracle then
requires every request answered exactly once.
"""

from __future__ import annotations

import re
import signal
import time
from collections import Counter
from pathlib import Path

from producer.protocol.lanes import lanes_key
from producer.redisio.topology import tag_slot
from tools.localcluster import ClusterNode, LocalCluster

from .common import MODEL, PREFIX, ScenarioTimeout, wait_for
from .lanes import MIX
from .oracle import Result
from .processes import Settings
from .run import Run


def _lanes_served(run: Run, rids: list[str]) -> bool:
    """Each lane of ``MIX`` has an answered request among ``rids`` (those sent so far)."""
    sent = [rid for rid in rids if rid in run.confirmed]
    answered = [rid for rid, n in zip(sent, run.reply_counts(sent), strict=True) if n]
    return {run.lane(rid) for rid in answered} == set(MIX)


def master_failover(
    workdir: Path,
    *,
    requests: int = 600,
    probe: int = 3000,
    probe_s: float = 1.5,
    workers: int = 2,
    shards: int = 3,
    duration_s: float = 6.0,
    cut_link_s: float = 0.0,
    restart_killed: bool = False,
    drain_s: float = 60.0,
    seed: int = 21,
    cluster: bool | LocalCluster = True,
    lanes: bool = False,
    victim_shard: int = 0,
) -> Result:
    """SIGKILL the master of the model's first shard (its registry and shard list too; with
    ``victim_shard``, that shard's master instead) while paced requests flow to every shard
    and a tight XADD loop (``probe`` XADDs, one a round trip, over at least ``probe_s``) runs
    against that one; its replica takes over. With ``lanes`` every request, the tight loop's
    too, goes to a lane drawn from ``lanes.MIX`` on its shard (raw version 2 XADDs among them),
    so lanes of every shard are in use, and each reply must name its lane.
    ``cut_link_s`` > 0 first cuts the replication link for that long (the replica stopped, its
    link dropped), so that the master acknowledges writes its replica never sees. The killed
    node stays down (a machine lost) until every request is answered, or with
    ``restart_killed`` is started again once its replica took over (a process crash its
    supervisor restarts); it rejoins as its successor's replica. ``drain_s`` bounds the wait for
    the answers. Notes: ``failover_s`` (kill to ``cluster_state:ok`` everywhere),
    ``acked_by_killed``, ``acked_lost`` (acknowledged by the killed master, missing on its
    successor), ``resent_unanswered`` (sent again with the same rid once the streams drained)
    and ``lost_covered`` (lost ones answered once after that)."""
    s = Settings(claim_idle_ms=1000, max_wait_ms=10, work_depth=2)
    name = "failover" + ("-cut" if cut_link_s else "") + ("-restarted" if restart_killed else "")
    name += "-lanes" if lanes else ""
    with Run(name, workdir, seed, s, cluster=cluster, shards=shards) as run:
        lc = _cluster(run)
        target = run.tags[victim_shard]
        rids = run.spread(run.requests.make(requests, "fo", bad_fraction=0.02))
        burst = run.spread(run.requests.make(probe, "probe"), [target])
        if lanes:
            rids, burst = run.laned(rids), run.laned(burst)
        everything = rids + burst
        for i in range(workers):
            run.pool.start(f"w{i}")
        run.pool.wait_ready()
        victim = lc.node_for_slot(tag_slot(target))
        sender = run.send_in_background(rids, rate_per_s=requests / duration_s)
        time.sleep(duration_s / 3)  # the kill schedule: a third of the way into the load
        if lanes:  # and not before the workers serve every lane of the victim's shard
            on_target = [rid for rid in rids if run.shard_of(rid) == target]
            wait_for(lambda: _lanes_served(run, on_target), 30, "every lane of the shard served")
        # One XADD a round trip, spread over at least probe_s so that it spans the kill
        prober = run.send_in_background(burst, chunk=1, rate_per_s=probe / probe_s)
        wait_for(
            lambda: sum(1 for rid in burst if rid in run.confirmed) >= probe // 10,
            30,
            "the tight XADD loop to run",
        )
        failover_s = kill_master(run, lc, victim, cut_link_s)
        acked_by = dict(run.acked_by)
        acked = [rid for rid in everything if acked_by.get(rid) == victim.port]
        lost = run.missing(acked)
        if restart_killed:
            _rejoin(lc, victim)
        try:
            run.join_sender(sender)
            run.join_sender(prober)
            unanswered, drained = _resend_unanswered(run, everything, drain_s)
            res = run.check(everything, timeout_s=drain_s if drained else 5)
        finally:
            if not victim.alive:
                _rejoin(lc, victim)
        covered = [rid for rid, n in zip(lost, run.reply_counts(lost), strict=True) if n == 1]
        res.notes.update(
            failover_s=round(failover_s, 2),
            acked_by_killed=len(acked),
            acked_lost=len(lost),
            resent_unanswered=len(unanswered),
            lost_covered=len(covered),
            producer_redirects=dict(run.redirects),
        )
        if victim_shard:
            res.notes["victim_shard"] = target
        if lanes:
            res.notes["lane_set_sizes"] = _lane_set_sizes(run)
        stray = sorted(set(unanswered) - set(lost))
        if stray:
            res.problems.append(
                f"{len(stray)} requests the new master held at the failover went unanswered "
                f"until re-sent, e.g. {stray[:5]}"
            )
        _explain(run, res)
        return res


def _lane_set_sizes(run: Run) -> dict[str, int]:
    """Each shard's lane set size now (the lanes producers registered there)."""
    return {tag: int(run.topology.client(tag).scard(lanes_key(PREFIX, tag))) for tag in run.tags}


def kill_master(run: Run, lc: LocalCluster, victim: ClusterNode, cut_link_s: float) -> float:
    """SIGKILL ``victim`` (its replication cut first for ``cut_link_s``, if any) and return the
    seconds until the cluster is ok again, its replica promoted; ``run.r`` then follows."""
    stopped = _cut_replication(lc, victim, cut_link_s) if cut_link_s else None
    t0 = time.monotonic()
    lc.kill(victim)
    if stopped is not None and stopped.process is not None:
        stopped.process.send_signal(signal.SIGCONT)
        run.result.notes["replication_cut_s"] = cut_link_s
    lc.wait_ok(timeout_s=60)
    failover_s = time.monotonic() - t0
    if victim.url == run.url:  # the seed is gone: producers started from now on (a resend)
        run.url = lc.node_for_slot(tag_slot(MODEL)).url  # are given a live node to start from
    run.refresh_r()
    return failover_s


def _resend_unanswered(run: Run, rids: list[str], drain_s: float) -> tuple[list[str], bool]:
    """Once the streams are drained (or ``drain_s`` passed), send the requests that have no
    reply again with the same rid, as a client does; returns them, and whether it drained."""
    drained = True
    try:
        wait_for(run.drained, drain_s, "the streams to drain before re-sending", 0.2)
    except ScenarioTimeout:
        drained = False
    counts = run.reply_counts(rids)
    unanswered = [rid for rid, n in zip(rids, counts, strict=True) if not n]
    run.resent.update(unanswered)
    run.send(unanswered)
    return unanswered, drained


def slot_migration(
    workdir: Path,
    *,
    requests: int = 900,
    workers: int = 2,
    shards: int = 3,
    duration_s: float = 6.0,
    batch: int = 20,
    step_requests: int = 8,
    seed: int = 22,
    cluster: bool | LocalCluster = True,
) -> Result:
    """Move the slot of the model's first shard (its stream, group, replies, registry and
    shard list) to another master, ``batch`` keys per MIGRATE, while paced requests flow to
    every shard and ``step_requests`` more are sent to the moving shard between batches (they
    meet ASK once its stream has moved). The workers must follow without a restart. Notes:
    ``migration_s``, ``keys_moved``, ``producer_redirects`` and ``worker_outages`` (the
    workers' one log line per outage, by cause: ASK, TRYAGAIN, ...)."""
    s = Settings(claim_idle_ms=1000, max_wait_ms=10, work_depth=2)
    with Run("migration", workdir, seed, s, cluster=cluster, shards=shards) as run:
        lc = _cluster(run)
        rids = run.spread(run.requests.make(requests, "mg", bad_fraction=0.02))
        extra = run.spread(run.requests.make(requests // 2, "step"), [MODEL])
        for i in range(workers):
            run.pool.start(f"w{i}")
        run.pool.wait_ready()
        sender = run.send_in_background(rids, rate_per_s=requests / duration_s)
        wait_for(lambda: len(run.confirmed) >= requests // 3, 60, "a third of the requests")
        slot = tag_slot(MODEL)
        source = lc.node_for_slot(slot)
        dest = next(node for node in lc.masters() if node is not source)
        steps = [extra[i : i + step_requests] for i in range(0, len(extra), step_requests)]
        sent_in_steps: list[str] = []

        def on_step() -> None:
            if len(sent_in_steps) < len(extra):
                part = steps[len(sent_in_steps) // step_requests]
                run.send(part)
                sent_in_steps.extend(part)

        t0 = time.monotonic()
        moved = lc.migrate_slot(slot, dest, batch=batch, on_step=on_step)
        migration_s = time.monotonic() - t0
        run.refresh_r()
        run.send(extra[len(sent_in_steps) :])
        run.join_sender(sender)
        res = run.check(rids + extra, timeout_s=90)
        res.notes.update(
            migration_s=round(migration_s, 2),
            keys_moved=moved,
            sent_mid_migration=len(sent_in_steps),
            producer_redirects=dict(run.redirects),
            worker_outages=dict(worker_outages(run)),
        )
        if lc.node_for_slot(slot) is not dest:
            res.problems.append(f"slot {slot} is not on {dest} after the migration")
        if res.worker_restarts or res.kills:
            res.problems.append("a worker had to be restarted to follow the migration")
        _explain(run, res)
        return res


def _cluster(run: Run) -> LocalCluster:
    if not isinstance(run.redis, LocalCluster):
        raise TypeError("a cluster scenario needs Run(cluster=...)")
    return run.redis


def _rejoin(lc: LocalCluster, node: ClusterNode) -> None:
    """Start a killed node again and wait until it is a replica in sync with its successor."""
    lc.restart(node)
    lc.wait_ok(timeout_s=60, replicas_up=True)


def _replica_of(lc: LocalCluster, master: ClusterNode) -> ClusterNode:
    return next(
        node
        for node in lc.replicas()
        if int(node.client().info("replication")["master_port"]) == master.port
    )


def _cut_replication(lc: LocalCluster, master: ClusterNode, seconds: float) -> ClusterNode:
    """Cut ``master``'s replication for ``seconds``, as a network fault would: its replica is
    stopped (SIGSTOP) and its link dropped (``CLIENT KILL TYPE replica``), so it cannot resync,
    and what the master acknowledges meanwhile never reaches it. Returns the replica, to be
    continued (SIGCONT) once the master is gone; ``seconds`` stays well below the cluster's node
    timeout, so that nobody takes the stopped replica for failed."""
    replica = _replica_of(lc, master)
    assert replica.process is not None
    replica.process.send_signal(signal.SIGSTOP)
    master.client().execute_command("CLIENT", "KILL", "TYPE", "replica")
    time.sleep(seconds)  # the fault's length, not a synchronisation
    return replica


_REDIRECT = re.compile(r"\(\d+ [\w.-]+:\d+\)")  # "(slot host:port)": a redirect's text


def worker_outages(run: Run) -> Counter[str]:
    """The workers' outage log lines (one per outage) by cause. A ``MOVED`` is followed at once
    and logs nothing, so a redirect that was logged is an ``ASK`` retried until its slot
    finished moving."""
    kinds: Counter[str] = Counter()
    for path in run.logdir.glob("*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if "unreachable during" not in line and "cannot update Redis" not in line:
                continue
            if "rehashing" in line or "TRYAGAIN" in line:
                kinds["TRYAGAIN"] += 1
            elif "cluster is down" in line.lower() or "CLUSTERDOWN" in line:
                kinds["CLUSTERDOWN"] += 1
            elif _REDIRECT.search(line):
                kinds["ASK"] += 1
            else:
                kinds["connection"] += 1
    return kinds


def _explain(run: Run, res: Result) -> None:
    """A failed scenario keeps the workers' log tails in its problems."""
    if res.problems:
        res.problems.append("worker logs:\n" + run.worker_logs())
