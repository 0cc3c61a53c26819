"""One scenario's world: its Redis (or Redis Cluster), model, worker config, requests and worker
pool."""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import redis

from producer.redisio.topology import Topology, tag_slot
from tools.localcluster import LocalCluster
from tools.localredis import LocalRedis

from .cluster import ShardedOracle, flush_cluster, place_shards
from .common import MODEL
from .load import LoadDriver
from .model import build_model
from .oracle import Result
from .processes import Pool, Settings, write_config
from .workload import Requests

DEFAULT_SETTINGS = Settings()  # frozen, so one shared default is safe


class Run(LoadDriver, ShardedOracle):
    """A scenario's Redis, model, config, requests and worker pool; a context manager.

    ``cluster``: True runs it on a private ``LocalCluster`` (3 masters, 1 replica each); a
    started ``LocalCluster`` runs it there (its masters flushed first, the cluster left running).
    On a cluster the model's shards (``shards`` of them, on distinct masters while there are
    enough) are listed in ``P:{M}:shards``; ``run.r`` is a plain client of the master that owns
    the model's own slot (``refresh_r`` follows it after a failover or a migration); the
    worker's config names a different node, so that the workers find the shards by themselves.
    """

    def __init__(
        self,
        name: str,
        workdir: Path,
        seed: int,
        settings: Settings = DEFAULT_SETTINGS,
        redis_args: Sequence[str] = (),
        *,
        cluster: bool | LocalCluster = False,
        shards: int = 1,
    ) -> None:
        self.name = name
        self.seed = seed
        self.settings = settings
        self.workdir = workdir / name
        self.logdir = self.workdir / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.exec_log = self.workdir / "exec.log"
        self.cluster = bool(cluster)
        self._owns_server = not isinstance(cluster, LocalCluster)
        self.redis: LocalRedis | LocalCluster
        if isinstance(cluster, LocalCluster):
            self.redis = cluster
        elif cluster:
            self.redis = LocalCluster()
        else:
            self.redis = LocalRedis(*redis_args)
        if shards > 1 and not cluster:
            raise ValueError("shards > 1 needs cluster=True: one Redis holds one shard")
        self.shard_count = shards
        self.tags: list[str] = [MODEL]
        self._shard_of: dict[str, str] = {}
        reference = build_model(self.workdir / "reference.onnx")
        self.model_path = build_model(
            self.workdir / "chaos.onnx",
            work_width=settings.work_width,
            work_depth=settings.work_depth,
        )
        self.url = self.redis.url
        if not self.cluster:
            self.config = write_config(self.workdir, self.url, self.model_path, settings)
        self.requests = Requests(reference, seed)
        self.rng = random.Random(seed)
        self.result = Result(name)
        self.confirmed: set[str] = set()
        self.resent: Counter[str] = Counter()
        self.acked_by: dict[str, int] = {}
        self.redirects: Counter[str] = Counter()
        self.lane_of: dict[str, tuple[str, str | None]] = {}
        self._t0 = time.monotonic()
        self.r: redis.Redis
        self.topology: Topology
        self.pool: Pool

    def __enter__(self) -> Run:
        if self._owns_server:
            self.redis.start()
        if isinstance(self.redis, LocalCluster):
            try:
                self._enter_cluster(self.redis)
            except BaseException:
                if self._owns_server:
                    self.redis.stop()
                raise
        else:
            self.r = redis.Redis.from_url(self.url, socket_timeout=30)
            self.topology = Topology(self.r)
        self.pool = Pool(self)
        return self

    def _enter_cluster(self, cluster: LocalCluster) -> None:
        if not self._owns_server:
            cluster.wait_ok(replicas_up=True)
            flush_cluster(cluster)
        home = cluster.node_for_slot(tag_slot(MODEL))
        # A node that does not own the model's slot: the workers must be redirected to it.
        seed = next(n for n in cluster.masters() if n is not home)
        self.url = seed.url
        self.config = write_config(self.workdir, self.url, self.model_path, self.settings)
        self.topology = Topology(redis.Redis.from_url(self.url, socket_timeout=30))
        self.topology.refresh()
        self.r = self.topology.client(MODEL)
        self.tags = place_shards(cluster, self.r, MODEL, self.shard_count)

    def refresh_r(self) -> None:
        """Read the slot map again: ``run.r`` (and every shard's client) then talks to the
        master that owns its slot now, after a failover or a migration."""
        self.topology.refresh()

    def spread(self, rids: Sequence[str], tags: Sequence[str] | None = None) -> list[str]:
        """Send ``rids`` round-robin over ``tags`` (default: every shard); returns them."""
        over = list(tags or self.tags)
        for i, rid in enumerate(rids):
            self._shard_of[rid] = over[i % len(over)]
        return list(rids)

    def shard_of(self, rid: str) -> str:
        return self._shard_of.get(rid, MODEL)

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.pool.stop(timeout_s=10)
        if self.cluster:
            self.topology.close()
            self.topology.seed.close()
        else:
            self.r.close()
        if isinstance(self.redis, LocalRedis):
            self.redis.close()
        elif self._owns_server:
            self.redis.stop()

    def worker_logs(self) -> str:
        """Every worker log's tail, for a failure message."""
        parts = []
        for path in sorted(self.logdir.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-8:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)
