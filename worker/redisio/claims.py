"""Redis I/O for entries that changed hands: leases, claims and forgotten consumers.

Each operation that must not race another worker is one Lua script, checked against the
pending-entries list inside the script:

- ``renew``: re-claims, with idle 0 and ``JUSTID`` (which keeps the delivery count), only the
  entries still pending on this consumer, so a renewal never takes back an entry another worker
  has claimed.
- ``claim``: takes an entry pending on this consumer (after a restart under the same name), or
  idle at least ``min_idle_ms`` on any consumer, and returns its delivery count before the
  claim and its fields. An entry deleted while pending comes back without fields (``XCLAIM``
  drops it from the pending list).
- ``forget_consumers``: removes consumers with nothing pending, idle longer than a bound, so
  ``XINFO CONSUMERS`` stays bounded across restarts. Checking ``pending == 0`` in the same script
  as ``XGROUP DELCONSUMER`` matters: deleting a consumer drops its pending entries for good.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from producer.protocol.keys import CONSUMER_GROUP
from producer.protocol.lanes import Lane
from worker.redisio.stream import RawEntry, RequestStream

__all__ = ["Claimed", "Claims", "PendingEntry"]

_RENEW_LUA = """
local stream, group, me = KEYS[1], ARGV[1], ARGV[2]
local renewed = 0
for i = 3, #ARGV do
  local p = redis.pcall('XPENDING', stream, group, ARGV[i], ARGV[i], 1)
  if type(p) == 'table' and p[1] and p[1][2] == me then
    redis.call('XCLAIM', stream, group, me, 0, ARGV[i], 'JUSTID')
    renewed = renewed + 1
  end
end
return renewed
"""

_CLAIM_LUA = """
local stream, group, me = KEYS[1], ARGV[1], ARGV[2]
local min_idle, own = tonumber(ARGV[3]), ARGV[4] == '1'
local out = {}
for i = 5, #ARGV do
  local id = ARGV[i]
  local p = redis.pcall('XPENDING', stream, group, id, id, 1)
  if type(p) == 'table' and p[1] and ((own and p[1][2] == me) or (not own and p[1][3] >= min_idle))
  then
    local got = redis.call('XCLAIM', stream, group, me, 0, id)
    if got[1] and got[1][2] then
      table.insert(out, {id, p[1][4], got[1][2]})
    else
      table.insert(out, {id, p[1][4]})
    end
  end
end
return out
"""

_FORGET_LUA = """
local stream, group, me = KEYS[1], ARGV[1], ARGV[2]
local min_idle, only = tonumber(ARGV[3]), ARGV[4]
local ok, consumers = pcall(redis.call, 'XINFO', 'CONSUMERS', stream, group)
if not ok then return {} end
local gone = {}
for _, c in ipairs(consumers) do
  local info = {}
  for j = 1, #c, 2 do info[c[j]] = c[j + 1] end
  local mine = info['name'] == me
  local wanted = (only == '1' and mine) or (only ~= '1' and not mine)
  if wanted and info['pending'] == 0 and info['idle'] >= min_idle then
    redis.call('XGROUP', 'DELCONSUMER', stream, group, info['name'])
    table.insert(gone, info['name'])
  end
end
return gone
"""


@dataclass(frozen=True, slots=True)
class PendingEntry:
    """One line of ``XPENDING``: who holds an entry, for how long, how often it was delivered."""

    entry_id: bytes
    consumer: str
    idle_ms: int
    deliveries: int


@dataclass(frozen=True, slots=True)
class Claimed:
    """An entry now pending on this consumer; ``entry`` is None when it had been deleted."""

    entry_id: bytes
    deliveries_before: int
    entry: RawEntry | None


def _is_nogroup(exc: redis.ResponseError) -> bool:
    return str(exc).startswith(("NOGROUP", "ERR no such key"))


class Claims:
    """Leases, claims and consumer clean-up for one consumer of one request stream."""

    def __init__(self, stream: RequestStream) -> None:
        self.client = stream.client
        self.key = stream.key
        self.consumer = stream.consumer
        self.tag = stream.tag
        self.shard = stream.shard  # what its entries name their stream by (``RawEntry.shard``)
        self.lane = stream.lane
        self._renew = self.client.register_script(_RENEW_LUA)
        self._claim = self.client.register_script(_CLAIM_LUA)
        self._forget = self.client.register_script(_FORGET_LUA)

    def renew(self, entry_ids: list[bytes]) -> int:
        """Reset the idle time of the entries still ours; returns how many were."""
        if not entry_ids:
            return 0
        return int(self._renew(keys=[self.key], args=[CONSUMER_GROUP, self.consumer, *entry_ids]))

    def idle(self, min_idle_ms: int, count: int, own: bool = False) -> list[PendingEntry]:
        """Pending entries idle at least ``min_idle_ms`` (``own``: this consumer's, any idle)."""
        rows: Any
        try:
            if own:
                rows = self.client.xpending_range(
                    self.key, CONSUMER_GROUP, "-", "+", count, consumername=self.consumer
                )
            else:
                rows = self.client.xpending_range(
                    self.key, CONSUMER_GROUP, "-", "+", count, idle=min_idle_ms
                )
        except redis.ResponseError as exc:
            if _is_nogroup(exc):
                return []  # the reader recreates the group
            raise
        return [
            PendingEntry(
                bytes(row["message_id"]),
                _text(row["consumer"]),
                int(row["time_since_delivered"]),
                int(row["times_delivered"]),
            )
            for row in rows
        ]

    def pending_unheld(self, held: int) -> int:
        """How many entries are pending in the group but not in this worker's hands: those of
        other consumers, and its own beyond the ``held`` it is working on (one whose staged
        reply was evicted stays pending here, for its reclaim). One ``XPENDING`` summary
        (O(consumers)); 0 when the group is gone."""
        try:
            summary: Any = self.client.xpending(self.key, CONSUMER_GROUP)
        except redis.ResponseError as exc:
            if _is_nogroup(exc):
                return 0  # the reader recreates the group
            raise
        counts = {_text(c["name"]): int(c["pending"]) for c in summary.get("consumers") or ()}
        own = counts.pop(self.consumer, 0)
        return sum(counts.values()) + max(0, own - held)

    def claim(self, entry_ids: list[bytes], min_idle_ms: int, own: bool = False) -> list[Claimed]:
        """Take entries idle at least ``min_idle_ms`` (``own``: any pending on this consumer,
        left by an earlier process with the same name); the rest are skipped.

        The caller skips entries it holds, so an idle entry of this consumer's is an orphan
        (a finish step that never reached Redis) and is taken like any other."""
        if not entry_ids:
            return []
        args = [CONSUMER_GROUP, self.consumer, min_idle_ms, "1" if own else "0", *entry_ids]
        reply: Any = self._claim(keys=[self.key], args=args)
        return [_claimed(row, self.shard, self.lane) for row in reply]

    def forget_consumers(self, min_idle_ms: int) -> list[str]:
        """Remove other consumers with nothing pending, idle at least ``min_idle_ms``."""
        gone = self._forget(keys=[self.key], args=[CONSUMER_GROUP, self.consumer, min_idle_ms, "0"])
        return [_text(name) for name in gone]

    def forget_self(self) -> bool:
        """Remove this consumer from the group if nothing is pending on it (a clean exit)."""
        gone = self._forget(keys=[self.key], args=[CONSUMER_GROUP, self.consumer, 0, "1"])
        return bool(gone)


def _claimed(row: list[Any], shard: str, lane: Lane | None) -> Claimed:
    entry_id, deliveries = row[0], int(row[1])
    if len(row) < 3:
        return Claimed(entry_id, deliveries, None)
    flat = row[2]
    fields = {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}
    return Claimed(entry_id, deliveries, RawEntry(entry_id, fields, shard, lane))


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
