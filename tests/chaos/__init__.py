"""Fault injection, black box: real worker processes, a real Redis, a model built here, an oracle.

The fast tier (``tests/test_faults.py``) and the full tier (``scripts/reliability.py``) run the
same scenario functions at different sizes. Each scenario starts its own ``redis-server`` and
worker subprocesses (``python -m worker``), drives load and faults, then asks the oracle:

- every request has exactly one reply (the reply list has length 1: a second ``RPUSH`` would
  show as 2), equal to its expected output or its expected error code;
- the stream is empty, nothing is pending, the dead-letter stream holds exactly the injected
  poison, and the consumer list is bounded by the live workers;
- duplicate executions are counted from ``REDBATCH_EXEC_LOG`` (``worker/ops/faults.py``): at-least-
  once allows them after a kill, and the report shows how many.

The model (``y = tanh(x @ W + b)``, ``[N, 8] -> [N, 4]``, optionally with a fixed-cost side
chain that adds exactly zero) is built here with ``onnx.helper``; it is not in the repository
and the worker knows nothing about it. Expected outputs come from a direct onnxruntime run.

The package, one module a job: ``common`` (names, fault points, the polling wait), ``model``
(the ONNX model), ``workload`` (requests and their expected answers), ``processes`` (worker
subprocesses and the restarting pool), ``load`` (the load driver), ``oracle`` (state and
verdict), ``run`` (one scenario's world), ``worker_scenarios``, ``redis_scenarios`` and
``overload_scenarios`` (a Redis at ``maxmemory``: producers refused, workers draining);
``lanes`` (which lane each request goes to: raw version 2 XADDs, classes, tenants, and the
per-lane figures);
``cluster`` (shards placed on a Redis Cluster's masters, the oracle over every shard) and
``cluster_scenarios`` (a master killed and failed over, a slot migrated, under load).
"""

from __future__ import annotations

from collections.abc import Callable

from .cluster import flush_cluster, place_shards
from .cluster_scenarios import kill_master, master_failover, slot_migration, worker_outages
from .common import (
    CRASH_VALUE,
    DEAD,
    MODEL,
    POINTS,
    PREFIX,
    ROOT,
    STREAM,
    ScenarioTimeout,
    wait_for,
)
from .lanes import MIX, label
from .model import build_model, slow_depth
from .oracle import Result, describe
from .overload_scenarios import full_speed_small_maxmemory, stopped_workers_fill
from .processes import Pool, Settings, WorkerProcess, write_config
from .redis_scenarios import client_kills, flushall, redis_restart
from .run import Run
from .worker_scenarios import (
    crash_pill,
    fault_storm,
    phase_kills,
    random_kills,
    sigterm_mid_batch,
    slow_batch,
)
from .workload import Expected, Requests

__all__ = [
    "CRASH_VALUE",
    "DEAD",
    "MIX",
    "MODEL",
    "POINTS",
    "PREFIX",
    "ROOT",
    "SCENARIOS",
    "STREAM",
    "Expected",
    "Pool",
    "Requests",
    "Result",
    "Run",
    "ScenarioTimeout",
    "Settings",
    "WorkerProcess",
    "build_model",
    "client_kills",
    "crash_pill",
    "describe",
    "fault_storm",
    "flush_cluster",
    "flushall",
    "full_speed_small_maxmemory",
    "kill_master",
    "label",
    "master_failover",
    "phase_kills",
    "place_shards",
    "random_kills",
    "redis_restart",
    "sigterm_mid_batch",
    "slot_migration",
    "slow_batch",
    "slow_depth",
    "stopped_workers_fill",
    "wait_for",
    "worker_outages",
    "write_config",
]

SCENARIOS: dict[str, Callable[..., Result]] = {
    "random_kills": random_kills,
    "phase_kills": phase_kills,
    "fault_storm": fault_storm,
    "redis_restart": redis_restart,
    "client_kills": client_kills,
    "flushall": flushall,
    "crash_pill": crash_pill,
    "slow_batch": slow_batch,
    "sigterm_mid_batch": sigterm_mid_batch,
    "stopped_workers_fill": stopped_workers_fill,
    "full_speed_small_maxmemory": full_speed_small_maxmemory,
    "master_failover": master_failover,
    "slot_migration": slot_migration,
}
