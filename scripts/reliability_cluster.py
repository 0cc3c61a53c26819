"""The Redis Cluster tier of ``scripts/reliability.py``: its scenarios at full size, and its
section of docs/reliability.md ("Redis Cluster"), which ``--cluster`` rewrites in place and a
run without it keeps."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import chaos

__all__ = ["HEADING", "figures", "keep_section", "render", "section_of", "splice", "steps"]

HEADING = "## Redis Cluster"

Scenario = Callable[[Path, int], chaos.Result]


def steps() -> list[tuple[str, str, Scenario]]:
    """(key, title, run) of each scenario; each starts its own private cluster."""
    out: list[tuple[str, str, Scenario]] = [
        (
            "cluster_random_kills",
            "SIGKILL at random moments: 6 kills among 3 workers, 2,000 requests",
            lambda d, seed: chaos.random_kills(
                d, requests=2000, workers=3, kills=6, duration_s=20.0, seed=seed, cluster=True
            ),
        ),
        (
            "cluster_random_kills_lanes",
            "The same across lanes: raw v2 XADDs, classes high and low, 3 classes for "
            "2 tenants (MULTI; SADD; XADD)",
            lambda d, seed: chaos.random_kills(
                d,
                requests=2000,
                workers=3,
                kills=6,
                duration_s=20.0,
                seed=seed,
                cluster=True,
                lanes=True,
            ),
        ),
        (
            "cluster_fault_storm",
            "SIGKILL at random fault points (p = 0.01 each): 6 kills among 3 workers",
            lambda d, seed: chaos.fault_storm(
                d,
                requests=1500,
                workers=3,
                kills=6,
                probability=0.01,
                duration_s=12.0,
                seed=seed,
                cluster=True,
            ),
        ),
    ]
    out += [
        (
            f"cluster_kill_{point}",
            f"SIGKILL at `{point}`, twice, 2 workers",
            functools.partial(_phase, point=point),
        )
        for point in chaos.POINTS
    ]
    failover = functools.partial(
        chaos.master_failover, requests=1500, probe=5000, probe_s=2.5, workers=2, duration_s=9.0
    )
    out += [
        (
            "failover",
            "The master of the model's first shard SIGKILLed and lost for good, 3 shards: "
            "1,500 paced requests over all, 5,000 more to its shard one XADD a round trip "
            "(at most 2,000 a second)",
            lambda d, seed: failover(d, seed=seed),
        ),
        (
            "failover_cut_replication",
            "The same, its replication cut for 0.5 s before the kill (it acknowledges "
            "writes its replica never gets)",
            lambda d, seed: failover(d, cut_link_s=0.5, seed=seed),
        ),
        (
            "failover_restarted",
            "The same (replication cut 0.5 s), the killed master restarted once its replica "
            "took over (a supervisor)",
            lambda d, seed: failover(d, cut_link_s=0.5, restart_killed=True, seed=seed),
        ),
        (
            "failover_lanes",
            "The same (replication cut 0.5 s) across lanes on all 3 shards, the master of the "
            "second shard killed instead (the workers' seed node when it is that one)",
            lambda d, seed: failover(d, cut_link_s=0.5, lanes=True, victim_shard=1, seed=seed),
        ),
        (
            "slot_migration",
            "The slot of the model's first shard migrated to another master, 10 keys a "
            "MIGRATE, under 3,000 paced requests to 3 shards and 8 more to it between MIGRATEs",
            lambda d, seed: chaos.slot_migration(
                d, requests=3000, workers=2, duration_s=12.0, batch=10, seed=seed
            ),
        ),
    ]
    return out


def _phase(workdir: Path, seed: int, *, point: str) -> chaos.Result:
    return chaos.phase_kills(
        workdir, point, requests=400, workers=2, kills=2, seed=seed, cluster=True
    )


_FIGURES = (
    ("failover_s", "failover s (kill to cluster ok)"),
    ("acked_by_killed", "XADDs acked by the killed master"),
    ("acked_lost", "acked XADDs its replica lacked"),
    ("lost_covered", "of those, answered once after a resend"),
    ("duplicates", "duplicate executions"),
    ("migration_s", "migration s"),
    ("keys_moved", "keys moved"),
    ("producer_redirects", "producer redirects"),
    ("worker_outages", "worker outage lines"),
)


def _value(res: chaos.Result, key: str) -> str:
    value: Any = res.duplicates if key == "duplicates" else res.notes.get(key)
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in sorted(value.items())) or "none"
    return f"{value:,}" if isinstance(value, int) else str(value)


def figures(results: Sequence[tuple[str, chaos.Result]]) -> list[str]:
    """The cluster figures of the failover and migration scenarios, one row each."""
    moved = [
        (title, r) for title, r in results if "failover_s" in r.notes or "keys_moved" in r.notes
    ]
    rows = [
        "| scenario | " + " | ".join(name for _, name in _FIGURES) + " |",
        "| --- |" + " ---: |" * len(_FIGURES),
    ]
    for title, r in moved:
        rows.append(f"| {title} | " + " | ".join(_value(r, k) for k, _ in _FIGURES) + " |")
    return rows


def lane_table(results: Sequence[tuple[str, chaos.Result]]) -> list[str]:
    """One row per lane of each laned scenario (as ``reliability.lane_table``)."""
    rows = [
        "| scenario | lane | sent | answered once | lost | more than one reply "
        "| duplicates executed |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for title, r in results:
        for lane, f in r.lanes.items():
            rows.append(
                f"| {title} | {lane} | {f['sent']:,} | {f['answered']:,} | {f['lost']} | "
                f"{f['doubled']} | {f['duplicates']} |"
            )
    return rows if len(rows) > 2 else []


def render(
    results: Sequence[tuple[str, chaos.Result]],
    table: Sequence[str],
    command: str,
    machine: str,
    seed: int,
) -> str:
    """The "Redis Cluster" section, from its heading to the end of its text."""
    total = [r for _, r in results]
    passed = sum(r.passed for r in total)
    lanes = lane_table(results)
    return f"""{HEADING}

Generated by `scripts/reliability.py --cluster` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC;
reproduce with:

```sh
{command}
```

Machine: {machine}. Seed {seed}.

The same harness on a private Redis Cluster of 3 masters with one replica each
(`tools/localcluster.py`, `cluster-node-timeout` 2 s, no persistence), each scenario on a cluster
of its own. The workers' `redis.url` names a master that does not own the model's slot, so they
find their shards themselves. The worker kills run the chaos model on one shard; the failover and
migration scenarios (`tests/chaos/cluster_scenarios.py`) spread it over 3 shards, one per master
(`P:{{chaos}}:shards`), and the oracle reads each request's reply from its own shard.

{chr(10).join(table)}

**{passed} of {len(total)} scenarios passed**; {sum(r.requests for r in total):,} requests,
{sum(r.kills for r in total)} worker SIGKILLs, {sum(r.duplicates for r in total)} duplicate
executions, {sum(r.lost for r in total)} lost, {sum(r.crashes for r in total)} crashes.

{chr(10).join(figures(results))}

Per lane of the laned scenarios (the "Lanes" section above says what they send):

{chr(10).join(lanes) if lanes else "(no laned scenario in this run)"}

- **failover s**: from the master's SIGKILL until every live node says `cluster_state:ok` and all
  agree on who owns each slot (its replica promoted). Clients of the other masters see
  `CLUSTERDOWN` for part of it.
- **acked XADDs its replica lacked**: replication is asynchronous, so a write the master
  acknowledged can die with it. A tight loop (one XADD a round trip, at most 2,000 a second so
  that it spans the kill) runs against the doomed master's shard, recording which node
  acknowledged each; once the replica has taken over, the
  acknowledged rids of which it holds nothing (no entry, no reply, no dead letter) are counted.
  A SIGKILL on one machine loses few or none: the replica reads the stream within microseconds.
  Cutting the replication link first (the replica SIGSTOPped and its link dropped for 0.5 s,
  then continued once the master is dead) loses every write of that half second.
- **answered once after a resend**: the producer does what the client library does for a
  request whose reply never comes: once the streams are drained it sends the unanswered
  requests again with the same rid. The oracle then finds every request answered exactly once.
  The lost requests had often run on the dead master already, hence the duplicate executions:
  at-least-once, never two replies.
- **migration**: `CLUSTER SETSLOT IMPORTING/MIGRATING`, `MIGRATE` of 10 keys at a time (the
  stream with its group, replies, the worker registry, the shard list), then `SETSLOT NODE`,
  while requests flow. Producers meet `ASK` once the stream has moved and `MOVED` after;
  the workers ride out the half-moved slot (`ASK`, `TRYAGAIN` for a multi-key script whose keys
  are split) as a transient outage, one log line each (worker outage lines), then follow the
  `MOVED`, without a restart.
- On a cluster every script, transaction and multi-key command of the worker touches one slot:
  `tests/test_cluster.py` checks that with `MONITOR` on every master and `COMMAND GETKEYS`.

The fast tier runs these at small sizes in CI: `.venv/bin/python -m pytest
tests/test_cluster.py` (about a minute on 2 cores), and the failover across lanes with the
second shard's master killed: `tests/test_lanes_cluster.py` (about 20 s).
"""


def splice(doc: str, section: str) -> str:
    """``doc`` with its "Redis Cluster" section replaced by ``section`` (appended if none;
    ``section`` alone for an empty ``doc``)."""
    if not doc:
        return section
    start = doc.find("\n" + HEADING + "\n")
    if start < 0:
        return doc.rstrip("\n") + "\n\n" + section
    end = doc.find("\n## ", start + 1)
    rest = doc[end:] if end >= 0 else ""
    return doc[: start + 1] + section + rest


def keep_section(doc: str, old: str) -> str:
    """``doc`` with the "Redis Cluster" section of ``old``, if it had one."""
    kept = section_of(old)
    return doc if kept is None else splice(doc, kept)


def section_of(doc: str) -> str | None:
    """The "Redis Cluster" section of ``doc``, or None."""
    start = doc.find("\n" + HEADING + "\n")
    if start < 0:
        return None
    end = doc.find("\n## ", start + 1)
    return doc[start + 1 : end if end >= 0 else len(doc)].rstrip("\n") + "\n"
