"""One scenario's world: its Redis, model, worker config, requests and worker pool."""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import redis

from tools.localredis import LocalRedis

from .load import LoadDriver
from .model import build_model
from .oracle import Oracle, Result
from .processes import Pool, Settings, write_config
from .workload import Requests

DEFAULT_SETTINGS = Settings()  # frozen, so one shared default is safe


class Run(LoadDriver, Oracle):
    """A scenario's Redis, model, config, requests and worker pool; a context manager."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        seed: int,
        settings: Settings = DEFAULT_SETTINGS,
        redis_args: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.seed = seed
        self.settings = settings
        self.workdir = workdir / name
        self.logdir = self.workdir / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.exec_log = self.workdir / "exec.log"
        self.redis = LocalRedis(*redis_args)
        reference = build_model(self.workdir / "reference.onnx")
        model = build_model(
            self.workdir / "chaos.onnx",
            work_width=settings.work_width,
            work_depth=settings.work_depth,
        )
        self.config = write_config(self.workdir, self.redis.url, model, settings)
        self.requests = Requests(reference, seed)
        self.rng = random.Random(seed)
        self.result = Result(name)
        self.confirmed: set[str] = set()
        self.resent: Counter[str] = Counter()
        self._t0 = time.monotonic()
        self.r: redis.Redis
        self.pool: Pool

    def __enter__(self) -> Run:
        self.redis.start()
        self.r = redis.Redis.from_url(self.redis.url, socket_timeout=30)
        self.pool = Pool(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.pool.stop(timeout_s=10)
        self.r.close()
        self.redis.close()

    def worker_logs(self) -> str:
        """Every worker log's tail, for a failure message."""
        parts = []
        for path in sorted(self.logdir.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-8:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)
