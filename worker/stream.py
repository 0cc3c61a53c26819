"""Redis I/O for one model's request stream: the group, reads, and the per-batch finish step.

The finish step is one Lua script per batch: for each entry still pending on this consumer it
copies dead letters (their first 64 fields plus ``reason``), writes the reply (only if none
exists), acknowledges and deletes. One round trip, atomic, and fenced: an entry that another
consumer has claimed is left to that consumer, so a request never gets two different replies.
(On Redis 8.2, XACKDEL could replace XACK + XDEL.)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from producer.keys import CONSUMER_GROUP, cancel_key, dead_key, reply_key, request_stream

__all__ = ["Finish", "RawEntry", "RequestStream", "StreamStats"]

log = logging.getLogger(__name__)

_FINISH_LUA = """
local stream, dead, group, me = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local n = tonumber(ARGV[3])
local done = 0
for i = 0, n - 1 do
  local base = 4 + i * 5
  local id, ri, ttl, payload, reason =
    ARGV[base], tonumber(ARGV[base + 1]), ARGV[base + 2], ARGV[base + 3], ARGV[base + 4]
  -- pcall: after FLUSHALL or a restart without persistence the group is gone (NOGROUP).
  local pending = redis.pcall('XPENDING', stream, group, id, id, 1)
  if type(pending) == 'table' and pending[1] and pending[1][2] == me then
    if reason ~= '' then
      local entry = redis.call('XRANGE', stream, id, id)
      local copy = {}
      if entry[1] then
        local fields = entry[1][2]
        for j = 1, math.min(#fields, 128), 2 do
          if fields[j] ~= 'reason' then
            table.insert(copy, fields[j])
            table.insert(copy, fields[j + 1])
          end
        end
      end
      table.insert(copy, 'reason')
      table.insert(copy, reason)
      redis.call('XADD', dead, '*', unpack(copy))
    end
    if ri > 0 and redis.call('EXISTS', KEYS[2 + ri]) == 0 then
      redis.call('RPUSH', KEYS[2 + ri], payload)
      redis.call('EXPIRE', KEYS[2 + ri], ttl)
    end
    redis.call('XACK', stream, group, id)
    redis.call('XDEL', stream, id)
    done = done + 1
  end
end
return done
"""


@dataclass(frozen=True, slots=True)
class RawEntry:
    """One stream entry as read: its id and its fields, still bytes."""

    entry_id: bytes
    fields: dict[bytes, bytes]

    @property
    def id_ms(self) -> int:
        """The entry's enqueue time in epoch ms (the first half of its id)."""
        return int(self.entry_id.split(b"-", 1)[0])


@dataclass(frozen=True, slots=True)
class StreamStats:
    """The request stream as the group sees it."""

    backlog: int
    pending: int
    lag: int | None
    dead: int


@dataclass(frozen=True, slots=True)
class Finish:
    """What to do with one entry: reply (encoded) and/or dead-letter it, then ack and delete."""

    entry_id: bytes
    rid: str | None = None
    reply: bytes | None = None
    reply_ttl_s: int = 3600
    dead_reason: str | None = None
    code: str = "OK"  # the outcome, for metrics: OK, an error code, or DEAD_LETTER


class RequestStream:
    """The request stream of one model, seen by one consumer of the ``workers`` group."""

    def __init__(self, client: redis.Redis, prefix: str, model: str, consumer: str) -> None:
        self.client = client
        self.prefix = prefix
        self.key = request_stream(prefix, model)
        self.dead_key = dead_key(prefix, model)
        self.consumer = consumer
        self._finish = client.register_script(_FINISH_LUA)

    def ensure_group(self) -> None:
        """Create the group at 0 (so earlier requests are served) unless it exists."""
        try:
            self.client.xgroup_create(self.key, CONSUMER_GROUP, id="0", mkstream=True)
            log.info("created consumer group %s on %s", CONSUMER_GROUP, self.key)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, count: int, block_ms: int) -> list[RawEntry]:
        """Read up to ``count`` new entries, blocking up to ``block_ms`` for the first (0: not
        at all; Redis reads BLOCK 0 as forever)."""
        try:
            reply: Any = self.client.xreadgroup(
                CONSUMER_GROUP, self.consumer, {self.key: ">"}, count=count, block=block_ms or None
            )
        except redis.ResponseError as exc:
            # NOGROUP: the group is gone; UNBLOCKED: the stream was deleted under a blocked read.
            if not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
                raise
            log.warning(
                "stream or consumer group gone on %s (Redis restarted or flushed); recreating it",
                self.key,
            )
            self.ensure_group()
            return []
        if not reply:
            return []
        _, entries = reply[0]
        return [RawEntry(eid, fields) for eid, fields in entries if fields is not None]

    def stats(self) -> StreamStats:
        """Backlog, pending and lag of the group, and dead letters: one round trip."""
        pipe = self.client.pipeline(transaction=False)
        pipe.xlen(self.key)
        pipe.xinfo_groups(self.key)
        pipe.xlen(self.dead_key)
        backlog, groups, dead = pipe.execute(raise_on_error=False)
        group = (
            next(
                (g for g in groups if g.get("name") in (CONSUMER_GROUP, CONSUMER_GROUP.encode())),
                None,
            )
            if isinstance(groups, list)
            else None
        )
        backlog = int(backlog) if isinstance(backlog, int) else 0
        lag = group.get("lag") if group else None
        return StreamStats(
            backlog=backlog,
            pending=int(group["pending"]) if group else 0,
            # Entries not yet read are still in the stream, so lag <= XLEN. Redis 7.0 loses the
            # group's entries-read on an AOF reload and then reports a stale, larger lag.
            lag=None if lag is None else min(int(lag), backlog),
            dead=int(dead) if isinstance(dead, int) else 0,
        )

    def cancelled(self, rids: Sequence[str]) -> set[str]:
        """The request ids whose cancel key exists: one MGET for the whole batch."""
        if not rids:
            return set()
        values = self.client.mget([cancel_key(self.prefix, rid) for rid in rids])
        return {rid for rid, value in zip(rids, values, strict=True) if value is not None}

    def finish(self, items: Sequence[Finish]) -> int:
        """Reply, dead-letter, ack and delete in one script call; returns entries finished."""
        if not items:
            return 0
        keys = [self.key, self.dead_key]
        args: list[bytes | str | int] = [CONSUMER_GROUP, self.consumer, len(items)]
        for item in items:
            index = 0
            if item.reply is not None and item.rid is not None:
                keys.append(reply_key(self.prefix, item.rid))
                index = len(keys) - 2
            args += [
                item.entry_id,
                index,
                item.reply_ttl_s,
                item.reply or b"",
                item.dead_reason or "",
            ]
        done = int(self._finish(keys=keys, args=args))
        if done < len(items):
            log.warning(
                "%d of %d entries were no longer pending on %s (claimed by another worker, "
                "deleted, flushed, or finished by an earlier try whose answer was lost); this "
                "try wrote no reply for them",
                len(items) - done,
                len(items),
                self.consumer,
            )
        return done
