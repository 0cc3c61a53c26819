"""The processes the bench starts: a private redis-server, ``python -m worker``, and benchkit.

The producer never imports the worker or onnxruntime, so everything that needs them runs in a
child process: workers from a generated config with the metrics port on (``WorkerProcess``),
and ``python -m tools.benchkit``, which builds the synthetic models, measures the ceilings and
prints each result as one JSON line (``benchkit``), or runs a redis-server on a free loopback
port for as long as its stdin stays open (``private_redis``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools import child_env
from tools.bench.errors import BenchError
from tools.localredis import free_port

__all__ = [
    "BENCHKIT",
    "POLL_S",
    "PREFIX",
    "WorkerProcess",
    "WorkerSetup",
    "benchkit",
    "flags",
    "private_cluster",
    "private_redis",
    "request_inputs",
    "run_json",
    "worker_records",
]

#: The key prefix of the workers the bench starts.
PREFIX = "rbbench"
#: The module that builds the synthetic models and measures the ceilings.
BENCHKIT = "tools.benchkit"
POLL_S = 0.02  # readiness and drain polls: a started process gives no event to wait on
_WORKER_START_S = 180.0


def flags(**options: object) -> list[str]:
    """Command-line flags from keyword arguments: ``model_file=p`` is ``--model-file p``."""
    return [a for k, v in options.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def benchkit(*args: str, timeout_s: float, redis_url: str | None = None) -> dict[str, Any]:
    """Run ``python -m tools.benchkit ARGS`` and return the JSON it prints."""
    return run_json(BENCHKIT, *args, timeout_s=timeout_s, redis_url=redis_url)


def run_json(
    module: str, *args: str, timeout_s: float, redis_url: str | None = None
) -> dict[str, Any]:
    """Run ``python -m MODULE ARGS`` (a measuring child: ``tools.benchkit``,
    ``tools.bench.hooks``) and return the JSON it prints last; ``redis_url`` goes in the
    environment, where no process listing shows its password."""
    command = [sys.executable, "-m", module, *args]
    env = child_env(REDIS_URL=redis_url) if redis_url else child_env()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False, env=env
        )
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"{shlex.join(command)} ran over {timeout_s:g} s") from exc
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise BenchError(f"{shlex.join(command)} failed (exit {done.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A redis-server on a free loopback port, via ``benchkit redis``; stopped on exit."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.benchkit", "redis"],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    assert proc.stderr is not None
    try:
        line = proc.stdout.readline()
        if not line:
            raise BenchError(f"could not start redis-server: {proc.stderr.read().strip()}")
        yield str(json.loads(line)["url"])
    finally:
        proc.stdin.close()  # benchkit stops the server when its stdin closes
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(timeout=10)


@contextlib.contextmanager
def private_cluster(masters: int = 3, replicas: int = 1) -> Iterator[str]:
    """A Redis Cluster on loopback (``tools.localcluster``), each master with ``replicas``
    replicas; yields a seed URL (the workers and producers find the rest); stopped on exit."""
    from tools.localcluster import LocalCluster
    from tools.localredis import RedisNotInstalled

    try:
        cluster = LocalCluster(masters, replicas).start()
    except RedisNotInstalled as exc:
        raise BenchError(str(exc)) from None
    try:
        yield cluster.url
    finally:
        cluster.stop()


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    """What a started worker serves: a synthetic model (or ``model_path``) under a name, its
    batching, and any further config tables (``extra``: a pipeline, limits), its handler's
    module found on ``pythonpath``."""

    model: str
    max_batch_size: int = 32
    max_wait_ms: float = 5.0
    name: str = ""  # the served model name; the synthetic model's name when empty
    model_path: Path | None = None  # a model file of its own instead of the synthetic one
    extra: str = ""  # TOML tables appended to the generated config
    pythonpath: str = ""  # a directory the worker imports the pipeline's handler from

    @property
    def served(self) -> str:
        return self.name or self.model


def _binding_table(binding: str) -> str:
    """``[model.cuda]`` turning on I/O binding or CUDA graphs (``off``: nothing)."""
    return "" if binding == "off" else f"[model.cuda]\n{binding} = true\n"


class WorkerProcess:
    """One ``python -m worker`` process with a generated config, its metrics port on;
    ``providers`` are the config's ``model.providers`` (``cpu``, ``cuda``, ``tensorrt``)."""

    def __init__(
        self,
        setup: WorkerSetup,
        model_file: Path,
        url: str,
        workdir: Path,
        providers: Sequence[str] = ("cpu",),
        binding: str = "off",
        threads: int = 0,
    ) -> None:
        self.setup = setup
        self.url = url
        self.port = free_port()
        self.name = f"bench-{setup.served}-{setup.max_batch_size}-{uuid.uuid4().hex[:6]}"
        self.config = workdir / f"{self.name}.toml"
        self.log = workdir / f"{self.name}.log"
        self.config.write_text(
            f"""[redis]
url = "{url}"
prefix = "{PREFIX}"

[model]
name = "{setup.served}"
path = "{model_file}"
version = "bench"
providers = {json.dumps(list(providers))}
intra_op_threads = {threads}
{_binding_table(binding)}
[batching]
max_batch_size = {setup.max_batch_size}
max_wait_ms = {setup.max_wait_ms}

[delivery]
reply_ttl_s = 600

[metrics]
port = {self.port}
{setup.extra}""",
            encoding="utf-8",
        )
        self._proc: subprocess.Popen[bytes] | None = None
        self.record: dict[str, Any] = {}

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self) -> WorkerProcess:
        """Start the worker and return once /readyz says it reads the stream."""
        command = [sys.executable, "-m", "worker", "--config", str(self.config)]
        # REDIS_URL overrides the config's redis.url: set it, so that a REDIS_URL in the
        # caller's environment cannot point the bench's workers at another Redis. The
        # checkout goes on PYTHONPATH (a pipeline's handler may live in tools.bench), and so
        # does the setup's own directory of handlers.
        env = child_env(REDIS_URL=self.url)
        if self.setup.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join((self.setup.pythonpath, env["PYTHONPATH"]))
        with self.log.open("wb") as log:
            self._proc = subprocess.Popen(
                [*command, "--name", self.name, "--log-level", "WARNING"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        try:
            deadline = time.monotonic() + _WORKER_START_S
            while not self._ready():
                if self._proc.poll() is not None:
                    raise BenchError(f"worker exited at start:\n{self._log_tail()}")
                if time.monotonic() > deadline:
                    raise BenchError(f"worker not ready within {_WORKER_START_S:g} s")
                time.sleep(POLL_S)
            self.record = worker_records(self.url, PREFIX, self.setup.served, self.name)[0]
        except BaseException:
            self.stop()  # nobody else holds it yet: a failed start must not leave it running
            raise
        return self

    def _ready(self) -> bool:
        url = f"http://127.0.0.1:{self.port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def _log_tail(self) -> str:
        lines = self.log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        return "\n".join(lines[-15:])

    def stop(self) -> None:
        """SIGTERM (the worker answers what it holds), then wait; SIGKILL after 30 s."""
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None


def request_inputs(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The inputs a request sends, from a worker record: its pipeline's raw inputs when it
    has one, else the model's."""
    pipeline = record.get("pipeline") or {}
    return list(pipeline.get("inputs") or record["inputs"])


def worker_records(
    url: str, prefix: str, model: str, name: str | None = None
) -> list[dict[str, Any]]:
    """The live workers' validation records for ``model`` (only ``name``'s when given)."""
    import redis

    from producer.client.blocking import Client
    from producer.redisio.topology import Topology

    # Seeded with the model's own master, where its worker records live (on a cluster too)
    seed = redis.Redis.from_url(url, socket_timeout=30)
    topology = Topology(seed)
    try:
        topology.refresh()
        with Client(model, prefix=prefix, redis_client=topology.client(model)) as client:
            records = [r for r in client.workers() if name is None or r.get("name") == name]
    finally:
        topology.close()
        seed.close()
    if not records:
        raise BenchError(f"no live worker record for model {model!r}")
    return records
