"""A throwaway Redis Cluster on loopback, for the tests, the benchmarks and the reliability scripts.

Every node is a ``redis-server`` with its own directory (config, ``nodes.conf``, log) under one
temporary directory, without persistence and with a short node timeout (2 s: a failover then takes
about 4 to 5 s). ``redis-cli --cluster create`` joins them, and since it returns before the cluster
settles, the class waits until every node says ``cluster_state:ok``, all agree on who owns each slot
and every replica's link is up. Roles are asked of the nodes each time, never remembered: a failover
changes them. Run ``python -m tools.localcluster`` for one to point other programs at.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tools.localredis import RedisNotInstalled

__all__ = ["ClusterNode", "LocalCluster", "cluster_ports"]

SLOTS = 16384
BUS_OFFSET = 10000  # a cluster node also listens on port + 10000 (its bus)
INSTALL_HINT = (
    "redis-server and redis-cli are needed for a local cluster: 'sudo apt-get install "
    "redis-server' (Debian/Ubuntu) or 'brew install redis' (macOS)."
)

NO_RETRY = Retry(NoBackoff(), 0)
SlotOwners = tuple[tuple[int, int, int], ...]  # (first slot, last slot, master port), sorted


def _free_pair(port: int) -> bool:
    """True when a node could listen on ``port`` and on its bus port (redis-server sets
    SO_REUSEADDR, so TIME_WAIT is no bar)."""
    for candidate in (port, port + BUS_OFFSET):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", candidate))
            except OSError:
                return False
    return True


def cluster_ports(count: int, base_port: int | None = None) -> list[int]:
    """``count`` node ports whose bus ports are free too (else ``create`` waits forever).

    Without ``base_port`` they are drawn below the kernel's ephemeral range, bus ports included,
    so that no outgoing connection takes a node's port while it is down for a restart.
    """
    if base_port is not None:
        ports = list(range(base_port, base_port + count))
        if ports[-1] + BUS_OFFSET > 65535 or not all(map(_free_pair, ports)):
            raise RuntimeError(f"ports {ports} or their bus ports (+10000) are taken or too high")
        return ports
    low = 32768  # Linux's default start of the ephemeral range
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    top = min(max(low, 30000), 65536) - BUS_OFFSET
    chosen: list[int] = []
    for port in random.sample(range(10000, top), k=min(2000, top - 10000)):
        taken = {q + d for q in chosen for d in (-BUS_OFFSET, 0, BUS_OFFSET)}
        if port not in taken and _free_pair(port):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise RuntimeError(f"found only {len(chosen)} of {count} free port pairs (port, port + 10000)")


class ClusterNode:
    """One ``redis-server`` of the cluster: its port, directory and process (None before start)."""

    def __init__(self, port: int, directory: Path) -> None:
        self.port = port
        self.dir = directory
        self.process: subprocess.Popen[bytes] | None = None
        self._client: redis.Redis | None = None
        self._id: str | None = None

    def __repr__(self) -> str:
        return f"ClusterNode(port={self.port})"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def client(self) -> redis.Redis:
        """A plain (not cluster-aware) client of this node alone, for admin commands; bytes out.

        It does not retry: the callers poll, and redis-py's default retries spend about 4.6 s on
        one refused connection."""
        if self._client is None:
            self._client = redis.Redis(
                port=self.port, socket_timeout=5, socket_connect_timeout=1, retry=NO_RETRY
            )
        return self._client

    def role(self) -> str:
        """'master' or 'slave', as the node says now."""
        return str(self.client().execute_command("ROLE")[0].decode())

    @property
    def node_id(self) -> str:
        """The cluster node id; it survives restarts (``nodes.conf`` keeps it)."""
        if self._id is None:
            self._id = self.client().execute_command("CLUSTER MYID").decode()
        return self._id

    def close(self) -> None:
        """Drop this class's connections to the node (a killed node's are dead anyway)."""
        if self._client is not None:
            self._client.close()

    def log_tail(self, lines: int = 5) -> str:
        """The last lines of its stderr and log: where a refused config or a crash is explained."""
        text = ""
        for name in ("stderr.log", "redis.log"):
            with contextlib.suppress(OSError):
                text += (self.dir / name).read_text(encoding="utf-8", errors="replace")
        return " | ".join(text.strip().splitlines()[-lines:])


class LocalCluster:
    """Start, break, reshape and stop a private Redis Cluster; use as a context manager.

    ``masters`` (3 or more: ``redis-cli --cluster create`` refuses fewer) each get ``replicas``
    replicas. ``extra_conf`` adds ``key value`` lines to every node's config (True/False: yes/no).
    """

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 2000,
        extra_conf: dict[str, Any] | None = None,
        base_port: int | None = None,
    ) -> None:
        self.server, self.cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if self.server is None or self.cli is None:
            raise RedisNotInstalled(INSTALL_HINT)
        if masters < 3 or replicas < 0:
            raise ValueError("a cluster needs at least 3 masters and 0 or more replicas each")
        self.masters_count, self.replicas_per_master = masters, replicas
        self.node_timeout_ms = node_timeout_ms
        self.extra_conf = dict(extra_conf or {})
        ports = cluster_ports(masters * (1 + replicas), base_port)
        self._dir = tempfile.TemporaryDirectory(prefix="redbatch-cluster-")
        self.nodes = [ClusterNode(port, Path(self._dir.name) / str(port)) for port in ports]
        self._by_port = {node.port: node for node in self.nodes}

    @property
    def url(self) -> str:
        """A seed URL (the first node's); cluster clients find the others from it."""
        return self.nodes[0].url

    def start(self, timeout_s: float = 60.0) -> LocalCluster:
        """Start every node, create the cluster, and return once it is ok and replicated."""
        deadline = time.monotonic() + timeout_s
        try:
            for node in self.nodes:
                node.dir.mkdir()
                self._write_conf(node)
                self._spawn(node, deadline)
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            replicas = ["--cluster-replicas", str(self.replicas_per_master), "--cluster-yes"]
            assert self.cli is not None
            create = [self.cli, "--cluster", "create", *addresses, *replicas]
            done = subprocess.run(
                create, capture_output=True, text=True, timeout=timeout_s, check=False
            )
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-2000:]}")
            self._wait(deadline, lambda: self._problem(replicas_up=True))
        except BaseException:
            self.stop()
            raise
        return self

    def _write_conf(self, node: ClusterNode) -> None:
        conf = {
            "port": node.port,
            "bind": "127.0.0.1",
            "dir": f'"{node.dir}"',
            "logfile": f'"{node.dir / "redis.log"}"',
            "cluster-enabled": True,
            "cluster-config-file": "nodes.conf",
            "cluster-node-timeout": self.node_timeout_ms,
            "save": '""',
            "appendonly": False,
            "repl-diskless-sync-delay": 0,  # not 5 s before each replica's first sync
            **self.extra_conf,
        }
        yes_no = {True: "yes", False: "no"}
        lines = [f"{k} {yes_no[v] if isinstance(v, bool) else v}" for k, v in conf.items()]
        (node.dir / "redis.conf").write_text("\n".join(lines) + "\n", encoding="utf-8")

    def _spawn(self, node: ClusterNode, deadline: float) -> None:
        """Start the node from its config and return once it answers PING."""
        assert self.server is not None
        with (node.dir / "stderr.log").open("ab") as err:
            node.process = subprocess.Popen(
                [self.server, str(node.dir / "redis.conf")], stdout=err, stderr=err
            )
        while True:
            if not node.alive:
                raise RuntimeError(f"redis-server {node.port} exited at start: {node.log_tail()}")
            with contextlib.suppress(redis.ConnectionError):
                if node.client().ping():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server {node.port} did not answer: {node.log_tail()}")
            time.sleep(0.02)  # polling a process that gives no readiness event

    def wait_ok(self, timeout_s: float = 30.0, replicas_up: bool = False) -> None:
        """Wait until every live node says ``cluster_state:ok`` and all agree on the slot owners,
        all live; with ``replicas_up`` also until every live replica's master link is up."""
        self._wait(time.monotonic() + timeout_s, lambda: self._problem(replicas_up))

    def _wait(self, deadline: float, problem_now: Callable[[], str | None]) -> None:
        """Poll until ``problem_now`` finds none; past the deadline, fail with it and the logs."""
        while (problem := problem_now()) is not None:
            if time.monotonic() > deadline:
                logs = "\n".join(f"  {n.port}: {n.log_tail()}" for n in self.nodes)
                raise TimeoutError(f"cluster not ok: {problem}\nnode logs:\n{logs}")
            time.sleep(0.05)  # gossip gives no event to wait on

    def _problem(self, replicas_up: bool) -> str | None:
        """What keeps the cluster from being ok now, or None."""
        live = [node for node in self.nodes if node.alive]
        views: dict[int, SlotOwners] = {}
        for node in live:
            try:
                state = node.client().execute_command("CLUSTER INFO")["cluster_state"]
                if state != "ok":
                    return f"node {node.port} says cluster_state:{state}"
                views[node.port] = self._slot_owners(node)
                if replicas_up:
                    link = node.client().info("replication").get("master_link_status", "up")
                    if link != "up":
                        return f"replica {node.port} has master_link_status:{link}"
            except redis.RedisError as exc:
                return f"node {node.port}: {exc!r}"
        if len(set(views.values())) > 1:
            return f"nodes disagree on slot owners: {views}"
        owners = next(iter(views.values()), ())
        if sum(last - first + 1 for first, last, _ in owners) != SLOTS:
            return f"slots not all covered: {owners}"
        dead = {port for _, _, port in owners} - {node.port for node in live}
        return f"slots still owned by dead nodes {sorted(dead)}" if dead else None

    @staticmethod
    def _slot_owners(node: ClusterNode) -> SlotOwners:
        reply = node.client().execute_command("CLUSTER SLOTS")
        return tuple(sorted((int(r[0]), int(r[1]), int(r[2][1])) for r in reply))

    def masters(self) -> list[ClusterNode]:
        """The live nodes that say they are masters now."""
        return [node for node in self.nodes if node.alive and node.role() == "master"]

    def replicas(self) -> list[ClusterNode]:
        """The live nodes that say they are replicas now."""
        return [node for node in self.nodes if node.alive and node.role() == "slave"]

    def node_for_slot(self, slot: int) -> ClusterNode:
        """The master that owns ``slot`` now, as the first live node sees it."""
        seed = next(node for node in self.nodes if node.alive)
        return self._by_port[self._owner(seed, slot)]

    def _owner(self, node: ClusterNode, slot: int) -> int:
        """The port of ``slot``'s master in ``node``'s view."""
        return next(p for first, last, p in self._slot_owners(node) if first <= slot <= last)

    def kill(self, node: ClusterNode) -> None:
        """SIGKILL the node (a crash, not a shutdown) and wait until it is gone."""
        assert node.process is not None
        node.process.kill()
        node.process.wait()
        node.close()

    def restart(self, node: ClusterNode, timeout_s: float = 10.0) -> None:
        """Start a killed node again from its config and ``nodes.conf``: it rejoins (as a replica
        when its replica took over). Without persistence it comes back empty."""
        if node.alive:
            raise RuntimeError(f"node {node.port} is still running")
        self._spawn(node, time.monotonic() + timeout_s)

    def migrate_slot(
        self,
        slot: int,
        dest: ClusterNode,
        batch: int = 100,
        on_step: Callable[[], object] | None = None,
    ) -> int:
        """Move ``slot`` and its keys to master ``dest`` as ``redis-cli --cluster reshard`` does;
        ``on_step`` runs after each batch of keys, while the slot is half moved. Returns how many
        keys moved, once every live node names ``dest`` as the owner."""
        source = self.node_for_slot(slot)
        if source is dest:
            return 0
        src, dst = source.client(), dest.client()
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source.node_id)
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dest.node_id)
        moved = 0
        while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, batch):
            src.execute_command("MIGRATE", "127.0.0.1", dest.port, "", 0, 10000, "KEYS", *keys)
            moved += len(keys)
            if on_step is not None:
                on_step()
        dst.execute_command("CLUSTER SETSLOT", slot, "NODE", dest.node_id)
        src.execute_command("CLUSTER SETSLOT", slot, "NODE", dest.node_id)
        for node in self.masters():
            if node not in (source, dest):
                node.client().execute_command("CLUSTER SETSLOT", slot, "NODE", dest.node_id)
        self._wait(time.monotonic() + 10, lambda: self._owner_problem(slot, dest))
        return moved

    def _owner_problem(self, slot: int, owner: ClusterNode) -> str | None:
        """Which nodes do not name ``owner`` for ``slot`` yet (replicas learn it by gossip); a
        node that does not answer (stopped) is not waited for."""
        views = {}
        for node in self.nodes:
            with contextlib.suppress(redis.RedisError):
                views[node.port] = self._owner(node, slot) if node.alive else owner.port
        wrong = {port: view for port, view in views.items() if view != owner.port}
        return f"slot {slot} owner by node: {wrong}, not {owner.port}" if wrong else None

    def redis_cpu_seconds(self) -> dict[int, float]:
        """CPU seconds (user + system) each live server has used, by port, for benchmarks."""
        cpu = {node.port: node.client().info("cpu") for node in self.nodes if node.alive}
        return {port: info["used_cpu_sys"] + info["used_cpu_user"] for port, info in cpu.items()}

    def stop(self) -> None:
        """SIGKILL every node still running (nothing here is worth a clean shutdown), remove the
        directory."""
        for node in self.nodes:
            if node.alive:
                self.kill(node)
            node.close()
        self._dir.cleanup()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.localcluster",
        description="Run a throwaway Redis Cluster on loopback until Ctrl-C.",
    )
    parser.add_argument("--masters", type=int, default=3, help="masters (at least 3)")
    parser.add_argument("--replicas", type=int, default=1, help="replicas per master")
    parser.add_argument("--base-port", type=int, help="first node port (default: free ports)")
    parser.add_argument("--node-timeout-ms", type=int, default=2000, help="cluster-node-timeout")
    args = parser.parse_args(argv)
    # SystemExit and KeyboardInterrupt both run __exit__; SIGINT is set again because a shell
    # starts a background job with it ignored.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cluster = LocalCluster(args.masters, args.replicas, args.node_timeout_ms, None, args.base_port)
    with cluster:
        print(f"seed: {cluster.url}")
        for node in cluster.nodes:
            print(f"{node.role():6} {node.url}  id {node.node_id}  dir {node.dir}")
        print("Ctrl-C stops the cluster.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
