"""The cluster half of the harness: placing a model's shards on distinct masters, flushing a
shared cluster between scenarios, and the oracle over every shard.

``Oracle`` judges the requests of the model's first shard (its reply keys are ``P:{M}:reply:R``);
with more shards a request's keys carry its shard's tag (contract section 1), so ``ShardedOracle``
asks each shard's master for its own requests, and also requires every other shard's
dead-letter stream to be empty (the cluster scenarios send no poison).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import redis

from producer.ops.shards import plan_placement
from producer.protocol.codec import WireFormatError, decode_reply
from producer.protocol.keys import (
    dead_key,
    reply_key,
    shards_key,
)
from producer.redisio.topology import Topology
from tools.localcluster import LocalCluster

from .common import PREFIX
from .oracle import Oracle, Result

__all__ = ["ShardedOracle", "flush_cluster", "place_shards"]


def place_shards(
    cluster: LocalCluster, home: redis.Redis, model: str, count: int, prefix: str = PREFIX
) -> list[str]:
    """``count`` shard tags of ``model``, first the model's own, placed as ``redbatch shards
    place`` places them (one per master, then round-robin); with more than one,
    ``P:{M}:shards`` lists them (on ``home``, the client of the model's own master)."""
    topology = Topology(redis.Redis.from_url(cluster.url))
    try:
        topology.refresh()
        masters = topology.slots.masters()
        tags = [model, *plan_placement(model, [model], count, topology.node_of, masters, set())]
    finally:
        topology.close()
        topology.seed.close()
    if count > 1:
        pipe = home.pipeline(transaction=True)
        pipe.delete(shards_key(prefix, model))
        pipe.rpush(shards_key(prefix, model), *tags)
        pipe.execute()
    return tags


def flush_cluster(cluster: LocalCluster) -> None:
    """FLUSHALL on every master (their replicas follow): a shared cluster's next scenario
    starts without the last one's keys."""
    for node in cluster.masters():
        node.client().flushall()


class ShardedOracle(Oracle):
    """``Oracle`` over every shard of the model; with one shard, ``Oracle`` itself."""

    tags: list[str]
    topology: Topology
    shard_of: Callable[[str], str]

    @property
    def sharded(self) -> bool:
        return len(self.tags) > 1

    def _each(self, rids: Sequence[str], command: Callable[[Any, str, str], object]) -> list[Any]:
        """``command(pipe, tag, rid)`` for each rid on its shard's master, one pipeline per
        shard; the answers in the order of ``rids``."""
        by_tag: dict[str, list[int]] = {}
        for i, rid in enumerate(rids):
            by_tag.setdefault(self.shard_of(rid), []).append(i)
        out: list[Any] = [None] * len(rids)
        for tag, indexes in by_tag.items():
            pipe = self.topology.client(tag).pipeline(transaction=False)
            for i in indexes:
                command(pipe, tag, rids[i])
            for i, answer in zip(indexes, pipe.execute(), strict=True):
                out[i] = answer
        return out

    def reply_counts(self, rids: Sequence[str]) -> list[int]:
        if not self.sharded:
            return super().reply_counts(rids)
        return [
            int(n)
            for n in self._each(rids, lambda p, tag, rid: p.llen(reply_key(PREFIX, tag, rid)))
        ]

    def streams(self) -> list[tuple[redis.Redis, str]]:
        """Every shard's streams sent to, each with the client of its shard's master."""
        if not self.sharded:
            return super().streams()
        return [
            (self.topology.client(tag), key) for tag in self.tags for key in self.lane_streams(tag)
        ]

    def describe_replies(self, rid: str) -> str:
        if not self.sharded:
            return super().describe_replies(rid)
        raws = self.topology.client(self.shard_of(rid)).lrange(
            reply_key(PREFIX, self.shard_of(rid), rid), 0, -1
        )
        seen = []
        for raw in raws:  # type: ignore[union-attr]
            reply = decode_reply(raw)
            seen.append(f"{reply.worker}:{reply.error.code if reply.error else 'OK'}")
        return f"shard {self.shard_of(rid)}: replies {seen}, executions {self.executions()[rid]}"

    def _judge_replies(self, rids: Sequence[str]) -> tuple[list[str], list[str]]:
        """As ``Oracle._judge_replies``, each reply read from its own shard."""
        if not self.sharded:
            return super()._judge_replies(rids)
        raws = self._each(rids, lambda p, tag, rid: p.lindex(reply_key(PREFIX, tag, rid), 0))
        wrong: list[str] = []
        ok: list[str] = []
        for rid, raw in zip(rids, raws, strict=True):
            want = self.requests.expected[rid]
            try:
                reply = decode_reply(raw)
            except WireFormatError as exc:
                wrong.append(f"{rid}: undecodable reply ({exc})")
                continue
            got = reply.error.code if reply.error else "OK"
            if reply.rid != rid:
                wrong.append(f"{rid}: reply names rid {reply.rid}")
            elif (lane := self.lane_problem(rid, reply)) is not None:
                wrong.append(lane)
            elif want.code is not None and got != want.code:
                wrong.append(f"{rid}: expected {want.code}, got {got}")
            elif want.code is None and (not reply.ok or reply.outputs is None):
                wrong.append(f"{rid}: expected outputs, got {reply.error}")
            elif want.code is None and (
                want.y is None or not np.allclose(reply.outputs["y"], want.y, 1e-5, 1e-6)
            ):
                wrong.append(f"{rid}: outputs differ from the direct onnxruntime run")
            elif want.code is None:
                ok.append(rid)
        return ([f"{len(wrong)} wrong replies: {wrong[:5]}"] if wrong else []), ok

    def check(
        self,
        rids: Sequence[str],
        *,
        poison: Sequence[str] = (),
        timeout_s: float = 60.0,
        consumer_slack: int = 1,
    ) -> Result:
        res = super().check(rids, poison=poison, timeout_s=timeout_s, consumer_slack=consumer_slack)
        for tag in self.tags[1:]:
            letters = self.topology.client(tag).xlen(dead_key(PREFIX, tag))
            if letters:
                res.problems.append(f"shard {tag}'s dead-letter stream holds {letters} entries")
        if self.sharded:
            res.notes["shards"] = len(self.tags)
        return res

    def missing(self, rids: Sequence[str]) -> list[str]:
        """The rids the cluster holds nothing of now: no entry in their shard's stream, no reply
        and no dead letter (the stream is read first: an entry finished meanwhile has its reply
        by the time the replies are read)."""
        held: set[str] = set()
        for tag in {self.shard_of(rid) for rid in rids}:
            client = self.topology.client(tag)
            for key in (*self.lane_streams(tag), dead_key(PREFIX, tag)):
                entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(key)  # type: ignore[assignment]
                held |= {f[b"rid"].decode() for _, f in entries if b"rid" in f}
        answered = self._each(rids, lambda p, tag, rid: p.exists(reply_key(PREFIX, tag, rid)))
        return [rid for rid, n in zip(rids, answered, strict=True) if not n and rid not in held]
