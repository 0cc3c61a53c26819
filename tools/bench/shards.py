"""A model's shards in the bench: placed on distinct masters, listed, and their Redis CPU.

``--cluster --shards N`` places the served model's N shards on N distinct masters of a local
cluster (``place_shards``, a pure function of the slot map) and writes ``P:{M}:shards``
(``write_shards``); the producers then spread their requests over those tags. Every Redis server
a run uses (one, or every node of a cluster, replicas included: they apply the masters' writes
on the same cores) is sampled at the measured window's edges (``RedisNodes``), and
``per_master`` turns two samples and the requests each shard answered into Redis CPU per
request, per master and its replicas: on a machine whose cores every process shares, that cost,
not the throughput, is the figure that scales with masters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from producer.ops.shards import plan_placement
from producer.protocol import keys
from producer.redisio.shards import read_shards
from producer.redisio.topology import Node, Topology, tag_slot

__all__ = [
    "RedisNode",
    "RedisNodes",
    "live_shards",
    "per_master",
    "place_shards",
    "write_shards",
]

SLOTS = 16384  # a Redis Cluster's hash slots


def place_shards(
    model: str, count: int, owner: Callable[[int], Node | None] | None = None
) -> list[str]:
    """``count`` shard tags of ``model``, the model's own tag first, each on a master no other
    of them is on: ``owner(slot)`` names the master of a slot (None, or no ``owner``: a single
    Redis, where the tags are simply ``M``, ``M~1``, ``M~2``...). The tags are the ones
    ``redbatch shards place`` picks (``producer.ops.shards.plan_placement``).

    ValueError when there are fewer masters than shards (they cannot be distinct).
    """
    if count < 1:
        raise ValueError("a model has at least one shard")
    first = keys.shard_tag(model)
    if owner is None or owner(tag_slot(first)) is None:
        return [first, *(keys.shard_tag(model, str(k)) for k in range(1, count))]
    masters = list(dict.fromkeys(m for m in map(owner, range(SLOTS)) if m is not None))
    if len(masters) < count:
        raise ValueError(
            f"{count} shards of {model!r} need {count} masters; the cluster has {len(masters)}"
        )

    def node_of(tag: str) -> Node | None:
        return owner(tag_slot(tag))

    return [first, *plan_placement(model, [first], count, node_of, masters, set())]


def write_shards(topology: Topology, prefix: str, model: str, tags: Sequence[str]) -> None:
    """Make ``P:{M}:shards`` list exactly ``tags`` (none listed for one shard, the model's own,
    as the contract has it), and drop any ``P:{M}:retiring`` a previous run left: one
    transaction on the model tag's master. The workers read the list when they start."""
    pipe = topology.client(model).pipeline(transaction=True)
    pipe.delete(keys.shards_key(prefix, model), keys.retiring_key(prefix, model))
    if list(tags) != [model]:
        pipe.rpush(keys.shards_key(prefix, model), *tags)
    pipe.execute()


def live_shards(topology: Topology, prefix: str, model: str) -> tuple[str, ...]:
    """The tags live workers' producers send to now (``--no-start``)."""
    return read_shards(topology.client(model), prefix, model).send


@dataclass(frozen=True, slots=True)
class RedisNode:
    """One Redis server of a run: its address, role, and its master's address (replicas)."""

    address: str
    role: str  # master or replica
    master: str = ""
    client: Any = None  # a plain client of this server alone


class RedisNodes:
    """Every Redis server a run uses: the one, or every node of a cluster (``CLUSTER NODES``,
    read once: the bench's cluster does not fail over), and where each shard tag lives."""

    def __init__(self, seed: redis.Redis) -> None:
        self.seed = seed
        self.topology = Topology(seed)
        self.cluster = self.topology.refresh()
        kwargs = seed.connection_pool.connection_kwargs
        here = f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
        if not self.cluster:
            self.nodes = [RedisNode(here, "master", "", seed)]
            return
        listed = seed.execute_command("CLUSTER", "NODES")
        text = listed.decode() if isinstance(listed, bytes) else str(listed)
        self.nodes = _parse_nodes(text, str(kwargs.get("host", "")), seed)

    def close(self) -> None:
        for node in self.nodes:
            if node.client is not self.seed:
                node.client.connection_pool.disconnect()
        self.topology.close()

    def master_of(self, tag: str) -> str:
        """The address of the master serving shard ``tag``."""
        node = self.topology.node_of(tag)
        return node.address if node is not None else self.nodes[0].address

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds (user + system) each server has used so far, by address (INFO cpu)."""
        found = {}
        for node in self.nodes:
            info = node.client.info("cpu")
            found[node.address] = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        return found

    def commands(self) -> dict[str, tuple[int, int]]:
        """``INFO commandstats`` summed over the masters: calls and microseconds by command.
        (A replica counts the writes it applies too; they would count each request twice.)"""
        total: dict[str, tuple[int, int]] = {}
        for node in self.nodes:
            if node.role != "master":
                continue
            for name, v in node.client.info("commandstats").items():
                if isinstance(v, dict):
                    calls, usec = total.get(name.removeprefix("cmdstat_"), (0, 0))
                    total[name.removeprefix("cmdstat_")] = (
                        calls + int(v["calls"]),
                        usec + int(v["usec"]),
                    )
        return total

    def describe(self) -> list[dict[str, str]]:
        return [{"address": n.address, "role": n.role, "master": n.master} for n in self.nodes]


def _parse_nodes(text: str, seed_host: str, seed: redis.Redis) -> list[RedisNode]:
    """``CLUSTER NODES`` lines (``id host:port@bus flags master ...``) as nodes, masters first,
    failed and handshaking ones left out; each with a client of its own (the seed's settings)."""
    rows = []
    for line in text.strip().splitlines():
        fields = line.split()
        if len(fields) < 8 or "fail" in fields[2] or "handshake" in fields[2]:
            continue
        host, _, port = fields[1].split("@")[0].rpartition(":")
        rows.append((fields[0], f"{host or seed_host}:{port}", fields[2], fields[3]))
    address_of = {node_id: address for node_id, address, _, _ in rows}
    pool = seed.connection_pool
    nodes = []
    for _node_id, address, flags, master_id in rows:
        host, _, port = address.rpartition(":")
        role = "master" if "master" in flags.split(",") else "replica"
        kwargs = {**pool.connection_kwargs, "host": host, "port": int(port)}
        own = redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
        client = redis.Redis(connection_pool=own)
        nodes.append(RedisNode(address, role, address_of.get(master_id, ""), client))
    return sorted(nodes, key=lambda n: (n.role != "master", n.master, n.address))


def per_master(
    nodes: Sequence[dict[str, str]],
    tags_at: Mapping[str, str],
    before: Mapping[str, float],
    after: Mapping[str, float],
    seconds: float,
    answered: Mapping[str, int],
) -> dict[str, Any]:
    """Redis CPU per request by master, from two ``RedisNodes.cpu_s`` samples ``seconds``
    apart, the shard tags on each master (``tags_at``: tag -> master address) and the requests
    each tag answered in between. A master's requests are those of its shards; its replicas'
    CPU is set against the same requests. Masters without a shard show their idle cost (the
    cluster's bus and cron). ``total``: every server's CPU over every request."""
    used = {a: after[a] - before.get(a, after[a]) for a in after}
    rows = []
    for node in nodes:
        if node["role"] != "master":
            continue
        address = node["address"]
        tags = sorted(t for t, at in tags_at.items() if at == address)
        requests = sum(answered.get(t, 0) for t in tags)
        replicas = [n["address"] for n in nodes if n["master"] == address]
        master_s, replica_s = used.get(address, 0.0), sum(used.get(r, 0.0) for r in replicas)
        rows.append(
            {
                "address": address,
                "shards": tags,
                "replicas": replicas,
                "requests": requests,
                "requests_per_s": requests / seconds if seconds > 0 else 0.0,
                "master_cores": master_s / seconds if seconds > 0 else 0.0,
                "replica_cores": replica_s / seconds if seconds > 0 else 0.0,
                "master_us_per_request": 1e6 * master_s / requests if requests else None,
                "replica_us_per_request": (
                    1e6 * replica_s / requests if requests and replicas else None
                ),
            }
        )
    requests = sum(answered.values())
    every_s = sum(used.values())
    return {
        "masters": rows,
        "total": {
            "requests": requests,
            "cores": every_s / seconds if seconds > 0 else 0.0,
            "us_per_request": 1e6 * every_s / requests if requests else None,
        },
    }
