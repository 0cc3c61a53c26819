"""Redis Cluster, for real: 3 masters and 3 replicas on loopback, started here (contract v2,
sections 1 and 4).

- Every script, transaction and multi-key command the worker sends touches one slot, as seen by
  ``MONITOR`` on every master while a worker serves three shards through every path: inline
  and staged replies, cancels, dead letters, claims, a poisoned entry.
- A master SIGKILLed while requests flow: its replica takes over, and every request is answered
  exactly once, acknowledged writes the failover lost included (sent again with the same rid).
- A shard's slot migrated to another master under load: the workers follow without a restart.
- The reliability suite's worker kills, on a cluster.

One cluster serves the module (each test flushes it first); the scenarios are those of
``tests/chaos`` (``scripts/reliability.py --cluster`` runs them at full size). Each test prints
its figures (``pytest -s`` shows them).
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import chaos
import numpy as np
import onnxruntime as ort
import pytest
import redis
from harness import PREFIX, running_worker, write_config
from redis.crc import key_slot

from producer.client.blocking import Client
from producer.client.results import Chunk
from producer.protocol.codec import Reply, decode_reply, encode_request
from producer.protocol.keys import CONSUMER_GROUP, cancel_key, dead_key, reply_key, request_stream
from producer.redisio.topology import Topology, tag_slot
from tools.localcluster import ClusterNode, LocalCluster

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(masters=3, replicas=1) as started:
        yield started


def _figures(res: chaos.Result, *names: str) -> None:
    print(f"\n{res.name}: " + ", ".join(f"{n} {res.notes.get(n)}" for n in names))


# -- MONITOR: every multi-key operation in one slot ------------------------------------------

_LINE = re.compile(rb"^\+?\d+\.\d+ \[\d+ ([^\]]+)\] (.*)$", re.DOTALL)
_ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"a": b"\a", b"b": b"\b"}
_SCRIPTS = {b"EVAL", b"EVALSHA", b"EVAL_RO", b"EVALSHA_RO", b"FCALL", b"FCALL_RO"}


def monitor_args(text: bytes) -> list[bytes]:
    """The arguments of one MONITOR line's command, unquoted (Redis writes each as a quoted
    string with ``\\xHH``, ``\\"``, ``\\\\`` and C escapes)."""
    args: list[bytes] = []
    i = 0
    while i < len(text):
        if text[i : i + 1] != b'"':
            i += 1
            continue
        i += 1
        arg = bytearray()
        while text[i : i + 1] != b'"':
            if text[i : i + 1] == b"\\":
                escaped = text[i + 1 : i + 2]
                if escaped == b"x":
                    arg.append(int(text[i + 2 : i + 4], 16))
                    i += 4
                    continue
                arg += _ESCAPES.get(escaped, escaped)
                i += 2
                continue
            arg += text[i : i + 1]
            i += 1
        args.append(bytes(arg))
        i += 1
    return args


@dataclass
class Unit:
    """What Redis runs as one: a command, a script with the commands it ran, or a MULTI block."""

    node: int
    client: str
    kind: str  # the command's name, or MULTI
    commands: list[list[bytes]] = field(default_factory=list)


def units(node: int, lines: Sequence[bytes]) -> list[Unit]:
    """Group one master's MONITOR lines: a script's own commands (client ``lua``) follow it at
    once (it runs atomically); a transaction's are those between its client's MULTI and EXEC."""
    out: list[Unit] = []
    script: Unit | None = None
    open_multi: dict[str, Unit] = {}
    for line in lines:
        found = _LINE.match(line)
        if found is None:
            continue
        client = found.group(1).decode()
        args = monitor_args(found.group(2))
        if not args:
            continue
        name = args[0].upper()
        if client == "lua":
            if script is None:
                raise AssertionError(f"a script's command with no script before it: {line!r}")
            script.commands.append(args)
            continue
        script = None
        if name in _SCRIPTS:
            script = Unit(node, client, name.decode(), [args])
            out.append(script)
        elif name == b"MULTI":
            open_multi[client] = Unit(node, client, "MULTI")
        elif name in (b"EXEC", b"DISCARD"):
            block = open_multi.pop(client, None)
            if block is not None and name == b"EXEC":
                out.append(block)
        elif client in open_multi:
            open_multi[client].commands.append(args)
        else:
            out.append(Unit(node, client, name.decode(), [args]))
    return out


def keys_of(client: redis.Redis, commands: Sequence[list[bytes]]) -> list[list[bytes]]:
    """Each command's keys, as Redis itself finds them (``COMMAND GETKEYS``, which knows
    ``numkeys`` of EVAL and EVALSHA); long values are shortened first (never a key here)."""
    pipe = client.pipeline(transaction=False)
    for args in commands:
        short = [a if len(a) <= 512 else b"v" for a in args]
        pipe.execute_command("COMMAND GETKEYS", *short)
    found = pipe.execute(raise_on_error=False)
    return [
        []
        if isinstance(keys, Exception)
        else [k.encode() if isinstance(k, str) else k for k in keys]
        for keys in found
    ]


def cross_slot(client: redis.Redis, found: Sequence[Unit]) -> tuple[list[str], Counter]:
    """Units whose keys span slots (described), and how many of each kind touched 2+ keys."""
    flat = [args for unit in found for args in unit.commands]
    keys = iter(keys_of(client, flat))
    bad: list[str] = []
    multi: Counter = Counter()
    for unit in found:
        touched = [k for _ in unit.commands for k in next(keys)]
        if len(touched) < 2:
            continue
        kind = unit.kind
        multi[kind] += 1
        slots = {key_slot(k) for k in touched}
        if len(slots) > 1:
            names = [c[0].decode() for c in unit.commands]
            bad.append(f"{kind} on {unit.node} ({unit.client}): {names} keys {touched[:6]}")
    return bad, multi


class Monitor:
    """``MONITOR`` on one node, read by a thread into lines until ``stop``."""

    def __init__(self, node: ClusterNode) -> None:
        self.node = node
        self.sock = socket.create_connection(("127.0.0.1", node.port))
        self.sock.sendall(b"MONITOR\r\n")
        self.data = bytearray()
        while not self.data.startswith(b"+OK\r\n"):  # it watches from its answer on
            self.data += self.sock.recv(64)
        del self.data[:5]
        self.marker = f"monitor-end-{node.port}".encode()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while self.marker not in self.data[-200:]:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                return
            self.data += chunk

    def stop(self) -> list[bytes]:
        """Every line up to an ``ECHO`` sent now (so none of the traffic before it is missed)."""
        self.node.client().echo(self.marker)
        self._thread.join(30)
        self.sock.close()
        return [line for line in bytes(self.data).split(b"\r\n") if line]


def test_the_monitor_check_catches_cross_slot_work(cluster: LocalCluster) -> None:
    # Given MONITOR lines with a cross-slot MGET, script and transaction, and single-slot ones
    lines = [
        b'+1.1 [0 127.0.0.1:1] "MGET" "p:{a}:cancel:1" "p:{b}:cancel:2"',
        b'+1.2 [0 127.0.0.1:1] "MGET" "p:{a}:cancel:1" "p:{a}:cancel:2"',
        b'+1.3 [0 127.0.0.1:1] "EVALSHA" "abc" "1" "p:{a}:requests" "x\\x00\\"y"',
        b'+1.4 [0 lua] "RPUSH" "p:{b}:reply:1" "v"',
        b'+1.5 [0 127.0.0.1:2] "MULTI"',
        b'+1.6 [0 127.0.0.1:1] "GET" "p:{c}:x"',
        b'+1.7 [0 127.0.0.1:2] "SET" "p:{a}:x" "1"',
        b'+1.8 [0 127.0.0.1:2] "SET" "p:{c}:y" "1"',
        b'+1.9 [0 127.0.0.1:2] "EXEC"',
    ]
    # When they are grouped and their keys found
    bad, multi = cross_slot(cluster.nodes[0].client(), units(1, lines))
    # Then the three cross-slot units are named, and the single-slot MGET is not
    assert [b.split(" ")[0] for b in bad] == ["MGET", "EVALSHA", "MULTI"]
    assert multi == {"MGET": 2, "EVALSHA": 1, "MULTI": 1}
    assert monitor_args(b'"x\\x00\\"y" "a\\\\b"') == [b'x\x00"y', b"a\\b"]


def _shards(cluster: LocalCluster, topology: Topology, model: str) -> list[str]:
    tags = chaos.place_shards(cluster, topology.client(model), model, 3, PREFIX)
    owners = {cluster.node_for_slot(tag_slot(tag)).port for tag in tags}
    assert len(owners) == 3, "three shards on three masters"
    return tags


def test_every_multi_key_operation_touches_one_slot(cluster: LocalCluster, tmp_path: Path) -> None:
    # Given a model with three shards on three masters, a ghost consumer holding entries of
    # each (one of them delivered too often already), and MONITOR on every master
    chaos.flush_cluster(cluster)
    model = "tiny"
    home = cluster.node_for_slot(tag_slot(model))
    seed = next(node for node in cluster.masters() if node is not home)
    topology = Topology(redis.Redis.from_url(seed.url, socket_timeout=30))
    topology.refresh()
    tags = _shards(cluster, topology, model)
    monitors = [Monitor(node) for node in cluster.masters()]
    rng = np.random.default_rng(5)
    expected: dict[tuple[str, str], str] = {}  # (tag, rid) -> the reply's code

    def body(rows: int) -> bytes:
        return encode_request({"x": rng.standard_normal((rows, 128)).astype(np.float32)})

    for k, tag in enumerate(tags):
        client = topology.client(tag)
        stream = request_stream(PREFIX, tag)
        client.xgroup_create(stream, CONSUMER_GROUP, "0", mkstream=True)
        held = [client.xadd(stream, {"rid": f"ghost{k}-{i}", "body": body(1)}) for i in range(3)]
        client.xreadgroup(CONSUMER_GROUP, "ghost", {stream: ">"}, count=3)
        client.xclaim(stream, CONSUMER_GROUP, "ghost", 0, [held[0]], retrycount=5)
        expected[(tag, f"ghost{k}-0")] = "POISONED"
        expected.update({(tag, f"ghost{k}-{i}"): "OK" for i in (1, 2)})
    config = write_config(
        tmp_path,
        model,
        seed.url,
        batching="max_batch_size = 16\nmax_wait_ms = 20",
        extra="[delivery]\nclaim_idle_ms = 300\nmax_deliveries = 3",
    )
    # When a worker serves them: 1-row replies go inside the finish script, 8-row ones (2 KiB)
    # are staged; some requests are cancelled first, one per shard has a bad rid. They arrive
    # five at a time (a transaction each), so that one read holds several, and one cancel MGET
    # several keys.
    with running_worker(config, name="mon"):
        for n in range(0, 60, 5):
            tag = tags[n // 5 % 3]
            pipe = topology.client(tag).pipeline(transaction=True)
            for rid, rows in ((f"r{m}", 1 + 7 * (m % 2)) for m in range(n, n + 5)):
                cancelled = int(rid[1:]) % 10 == 3
                if cancelled:
                    pipe.set(cancel_key(PREFIX, tag, rid), 1, ex=60)
                pipe.xadd(request_stream(PREFIX, tag), {"rid": rid, "body": body(rows)})
                expected[(tag, rid)] = "CANCELLED" if cancelled else "OK"
            pipe.execute()
        for tag in tags:
            topology.client(tag).xadd(request_stream(PREFIX, tag), {"rid": "bad rid!", "body": b""})
        replies = _wait_replies(topology, list(expected))
        dead = {tag: _dead_rids(topology, tag) for tag in tags}
    lines = {m.node.port: m.stop() for m in monitors}

    # Then every request has its one reply and the dead letters are the bad rids and the pill
    got = {key: (r.error.code if r.error else "OK") for key, r in replies.items()}
    assert got == expected
    for k, tag in enumerate(tags):
        assert sorted(dead[tag]) == sorted(["bad rid!", f"ghost{k}-0"])
    # And no unit of work touched two slots, though each kind of multi-key work was seen
    found = [unit for port, node_lines in lines.items() for unit in units(port, node_lines)]
    bad, multi = cross_slot(cluster.nodes[0].client(), found)
    assert not bad, "cross-slot work:\n" + "\n".join(bad[:20])
    scripts = [u for u in found if u.kind in ("EVALSHA", "EVAL")]
    ran = {c[0].decode().upper() for u in scripts for c in u.commands[1:]}
    print(f"\nmulti-key units by kind: {dict(multi)}; commands run in scripts: {sorted(ran)}")
    assert multi["MGET"] > 0, "no cancel MGET of two or more keys was seen"
    assert multi["EVALSHA"] > 0
    assert {"RENAMENX", "RPUSH", "XADD", "XACK", "XDEL", "XCLAIM"} <= ran
    topology.close()


def _wait_replies(
    topology: Topology, wanted: Sequence[tuple[str, str]], timeout_s: float = 60.0
) -> dict[tuple[str, str], Reply]:
    """Each (tag, rid)'s one reply, read (not consumed) once all are there; a reply list with
    more than one element fails."""
    with contextlib.suppress(chaos.ScenarioTimeout):
        chaos.wait_for(lambda: min(_reply_counts(topology, wanted)) >= 1, timeout_s, "replies")
    counts = _reply_counts(topology, wanted)
    missing = [w for w, n in zip(wanted, counts, strict=True) if n == 0]
    assert not missing, f"no reply for {missing[:5]}"
    assert max(counts) == 1, "a reply list holds two replies"
    out = {}
    for tag, rid in wanted:
        raw = topology.client(tag).lindex(reply_key(PREFIX, tag, rid), 0)
        out[(tag, rid)] = decode_reply(raw)  # type: ignore[arg-type]
    return out


def _reply_counts(topology: Topology, wanted: Sequence[tuple[str, str]]) -> list[int]:
    return [int(topology.client(t).llen(reply_key(PREFIX, t, rid))) for t, rid in wanted]


def _dead_rids(topology: Topology, tag: str) -> list[str]:
    entries = topology.client(tag).xrange(dead_key(PREFIX, tag))
    return [f[b"rid"].decode() for _, f in entries]  # type: ignore[union-attr]


# -- a master lost, a slot moved, workers killed ---------------------------------------------


def test_a_master_killed_and_restarted_loses_no_request(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    # Given three shards and their workers, paced requests to each and a tight XADD loop to the
    # first, whose master's replication is cut for 0.3 s (so that it acknowledges writes its
    # replica never gets) and which is then SIGKILLed; restarted once its replica took over
    res = chaos.master_failover(
        tmp_path,
        requests=300,
        probe=2000,
        probe_s=1.0,
        duration_s=3.0,
        cut_link_s=0.3,
        restart_killed=True,
        cluster=cluster,
    )
    _figures(res, "failover_s", "acked_by_killed", "acked_lost", "lost_covered")
    # Then every request was answered exactly once, the lost ones after their resend
    assert res.passed, chaos.describe(res)
    assert res.notes["acked_lost"] > 0, "the cut replication lost no acknowledged write"
    assert res.notes["lost_covered"] == res.notes["acked_lost"]


def test_a_master_lost_for_good_loses_no_request(cluster: LocalCluster, tmp_path: Path) -> None:
    # Given the same, but the killed master stays down (a machine lost)
    res = chaos.master_failover(
        tmp_path,
        requests=200,
        probe=1000,
        probe_s=1.0,
        duration_s=2.0,
        drain_s=20,
        cluster=cluster,
    )
    _figures(res, "failover_s", "acked_by_killed", "acked_lost", "lost_covered")
    # Then the workers find its successor by themselves and answer everything once
    assert res.passed, chaos.describe(res)


def test_a_slot_migrated_under_load_loses_no_request(cluster: LocalCluster, tmp_path: Path) -> None:
    res = chaos.slot_migration(tmp_path, requests=600, duration_s=4.0, batch=10, cluster=cluster)
    _figures(res, "migration_s", "keys_moved", "producer_redirects", "worker_outages")
    assert res.passed, chaos.describe(res)
    assert res.notes["keys_moved"] > 10


def test_workers_killed_at_random_on_a_cluster_lose_nothing(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    res = chaos.random_kills(
        tmp_path, requests=500, workers=2, kills=2, duration_s=5.0, cluster=cluster
    )
    assert res.passed, chaos.describe(res)
    assert res.kills >= 2


def test_client_map_through_a_failover_returns_every_row_once(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    # Given three shards and their workers, and Client.map running over 40,000 rows in requests
    # of 4 through a node that owns none of the model's slots
    s = chaos.Settings(claim_idle_ms=1000, max_wait_ms=10)
    with chaos.Run("client-failover", tmp_path, 31, s, cluster=cluster, shards=3) as run:
        for i in range(2):
            run.pool.start(f"w{i}")
        run.pool.wait_ready()
        x = np.random.default_rng(31).standard_normal((40000, 8)).astype(np.float32)
        session = ort.InferenceSession(
            str(run.workdir / "reference.onnx"), providers=["CPUExecutionProvider"]
        )
        want = session.run(["y"], {"x": x})[0]
        chunks: list[Chunk] = []
        failure: list[BaseException] = []

        def rows() -> Iterator[np.ndarray]:
            for i, row in enumerate(x):
                if i % 16 == 0:
                    time.sleep(
                        0.002
                    )  # pacing (at most 8,000 rows a second): the map spans the kill
                yield row

        def consume() -> None:
            try:
                with Client(chaos.MODEL, run.url, prefix=PREFIX) as client:
                    chunks.extend(client.map({"x": rows()}, rows_per_request=4, timeout_s=30))
            except BaseException as exc:
                failure.append(exc)

        mapper = threading.Thread(target=consume, daemon=True)
        mapper.start()
        chaos.wait_for(lambda: len(chunks) >= 1000 or not mapper.is_alive(), 60, "map's replies")
        # When the master of the model's first shard loses its replication for 0.3 s (it
        # acknowledges writes its replica never gets) and is SIGKILLed mid-map
        victim = cluster.node_for_slot(tag_slot(chaos.MODEL))
        failover_s = chaos.kill_master(run, cluster, victim, 0.3)
        mapper.join(120)
        cluster.restart(victim)
        cluster.wait_ok(timeout_s=60, replicas_up=True)
    # Then map returned every row once, right, resending what the failover lost
    print(f"\nclient map through a failover: failover_s {failover_s:.2f}")
    assert not mapper.is_alive(), "map did not end"
    assert not failure, failure
    assert [(c.start, c.stop) for c in chunks] == [(i, i + 4) for i in range(0, 40000, 4)]
    failed = [(c.rid, c.error.code) for c in chunks if c.error is not None]
    assert not failed, f"{len(failed)} of {len(chunks)} requests failed: {failed[:5]}"
    got = np.concatenate([c.outputs["y"] for c in chunks])  # type: ignore[index]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
