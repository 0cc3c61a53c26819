"""Redis I/O for one model's request stream: the group, reads, and the per-batch finish step.

The finish step is one round trip per batch (commands packed by ``producer.resp``). Each reply is
first pushed, with its TTL, to a staging key of its own (``P:{M}:staging:NAME:TOKEN.N``, the
token random per process); then one Lua script, atomic and fenced,
takes the entries still pending on this consumer (one ``XPENDING`` over the batch's id range),
copies dead letters (their first 64 fields plus ``reason``), moves each staged reply onto its
reply key with ``RENAMENX`` (so a reply already there stands), drops the staged replies of
entries it does not finish, and acknowledges and deletes with one ``XACK`` and one ``XDEL``. An
entry that another consumer has claimed is left to that consumer, so a request never gets two
different replies.

Why stage: every byte handed to a Lua script costs Redis about 1.2 us per KiB to take in (4 KiB:
5 us; 1 MiB: 1.2 ms, against 4 us for a plain SET), on the one thread every worker shares. A
staged reply never enters Lua, and the script only renames it. A staging key left by a finish
that never ran its script (a dropped connection) expires with the reply's TTL.
(On Redis 8.2, XACKDEL could replace XACK + XDEL.)
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from producer import resp
from producer.keys import (
    CONSUMER_GROUP,
    cancel_key,
    dead_key,
    reply_key,
    request_stream,
    staging_key,
)
from worker.errors import WorkerError

__all__ = ["Finish", "RawEntry", "RequestStream", "StreamStats"]

log = logging.getLogger(__name__)

_FINISH_LUA = """
local stream, dead, group, me = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local n, lo, hi, span = tonumber(ARGV[3]), ARGV[4], ARGV[5], tonumber(ARGV[6])
-- After FLUSHALL, or a restart without persistence, the group is gone (NOGROUP): nothing is
-- ours to finish. Any other error stops the script and reaches the worker.
local function pending(from, to, count)
  local page = redis.pcall('XPENDING', stream, group, from, to, count, me)
  if type(page) == 'table' and page.err then
    if string.sub(page.err, 1, 7) == 'NOGROUP' then return {}, nil end
    return nil, page
  end
  return page, nil
end
local page, failed = pending(lo, hi, span)
if failed then return failed end
local mine = {}
for _, p in ipairs(page) do mine[p[1]] = true end
local acked = {}
local flags = {}  -- per entry, in order: '1' finished here, '0' not this consumer's to finish
for i = 0, n - 1 do
  local base = 7 + i * 3
  local id, ri, reason = ARGV[base], tonumber(ARGV[base + 1]), ARGV[base + 2]
  local ours = mine[id]
  if ours == nil and #page >= span then  -- a full page may have cut it off: ask for it alone
    local one
    one, failed = pending(id, id, 1)
    if failed then return failed end
    ours = one[1] ~= nil
  end
  mine[id] = false  -- an id twice in one batch is finished once
  if ri > 0 then
    local staged, reply = KEYS[1 + 2 * ri], KEYS[2 + 2 * ri]
    if ours then
      -- 1: written; 0: a reply (or a key of another type) was there and stands; "no such
      -- key": the staged reply is gone (evicted), so the entry stays pending and is delivered
      -- again. Any other error (a missing ACL rule) stops the script and reaches the worker.
      local moved = redis.pcall('RENAMENX', staged, reply)
      if type(moved) == 'table' and moved.err then
        if not string.find(moved.err, 'no such key', 1, true) then
          return redis.error_reply(moved.err .. ' (the finish script, at RENAMENX ' .. staged
            .. ' ' .. reply .. ')')
        end
        ours = false
      elseif moved == 0 then
        redis.call('DEL', staged)
      end
    else
      redis.call('DEL', staged)
    end
  end
  if ours then
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
    acked[#acked + 1] = id
  end
  flags[i + 1] = ours and '1' or '0'
end
for first = 1, #acked, 1000 do
  local last = math.min(first + 999, #acked)
  redis.call('XACK', stream, group, unpack(acked, first, last))
  redis.call('XDEL', stream, unpack(acked, first, last))
end
return table.concat(flags)
"""


_PAGE_SLACK = 64  # more of this consumer's pending entries the id range may hold


def _stage(packer: resp.Packer, key: bytes, reply: bytes, ttl_s: int) -> None:
    """``RPUSH key reply`` and ``EXPIRE key ttl_s``; a small reply is packed with one format (a
    third of the Python time of packing the two commands apart), a large one is not copied."""
    ttl = b"%d" % ttl_s
    if len(reply) < resp.BIG:
        packer.add_packed(
            _STAGE % (len(key), key, len(reply), reply, len(key), key, len(ttl), ttl), 2
        )
    else:
        packer.add(b"RPUSH", key, reply)
        packer.add(b"EXPIRE", key, ttl)


_STAGE = (
    b"*3\r\n$5\r\nRPUSH\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"
    b"*3\r\n$6\r\nEXPIRE\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"
)


def _id_order(entry_id: bytes) -> tuple[int, int]:
    """A stream id as the pair Redis orders it by: (milliseconds, sequence)."""
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


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


class CancelQuery:
    """A cancel check on the wire (its MGET sent, its answer not yet read), and maybe the next
    read behind it."""

    def __init__(
        self, stream: RequestStream, rids: Sequence[str], in_flight: resp.InFlight
    ) -> None:
        self.stream = stream
        self.rids = rids
        self._in_flight = in_flight
        self._answered = False

    def read_behind(self, count: int, block_ms: int) -> None:
        """Send ``RequestStream.read``'s XREADGROUP on the check's connection, behind it: one
        round trip for both. ``entries()`` takes its reply."""
        self._in_flight.send(self.stream.read_command(count, block_ms))

    def receive(self) -> set[str]:
        """The request ids whose cancel key existed."""
        self._answered = True
        [values] = resp.raise_first_error(self._in_flight.receive(1))
        return {rid for rid, value in zip(self.rids, values, strict=True) if value is not None}

    def entries(self) -> list[RawEntry]:
        """The read sent behind the check, as ``RequestStream.read`` returns it; after
        ``receive()``, whose reply comes first."""
        if not self._answered:
            raise RuntimeError("receive() the check's answer before the read behind it")
        [reply] = self._in_flight.receive(1)
        return self.stream.read_reply(reply)

    @property
    def read_owed(self) -> bool:
        """True while the read sent behind the check is still to be taken."""
        return self._in_flight.owed > 0

    def abandon(self) -> None:
        """Drop the connection with whatever it still owes."""
        self._in_flight.abandon()


class RequestStream:
    """The request stream of one model, seen by one consumer of the ``workers`` group."""

    def __init__(self, client: redis.Redis, prefix: str, model: str, consumer: str) -> None:
        self.client = client
        self.prefix = prefix
        self.key = request_stream(prefix, model)
        self.dead_key = dead_key(prefix, model)
        self.consumer = consumer
        self.model = model
        self._finish = client.register_script(_FINISH_LUA)
        # Unique to this process: a worker restarted under the same name must never push onto a
        # staging key its previous life left behind.
        token = uuid.uuid4().hex[:12]
        self._staging = staging_key(prefix, model, consumer, token).encode()
        self._serial = itertools.count()
        # Key prefixes for rids that intake has checked already (keys.reply_key would again).
        self._reply = reply_key(prefix, "R")[:-1].encode()
        self._cancel = cancel_key(prefix, "R")[:-1].encode()
        self._head = [
            self.key.encode(),
            self.dead_key.encode(),
            CONSUMER_GROUP.encode(),
            consumer.encode(),
        ]

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
        [reply] = resp.round_trip(self.client, self.read_command(count, block_ms))
        return self.read_reply(reply)

    def read_command(self, count: int, block_ms: int) -> resp.Packer:
        """``read``'s XREADGROUP, packed."""
        block = (b"BLOCK", b"%d" % block_ms) if block_ms else ()
        packer = resp.Packer()
        packer.add(
            b"XREADGROUP",
            b"GROUP",
            CONSUMER_GROUP.encode(),
            self.consumer.encode(),
            b"COUNT",
            b"%d" % count,
            *block,
            b"STREAMS",
            self.key.encode(),
            b">",
        )
        return packer

    def read_reply(self, reply: Any) -> list[RawEntry]:
        """The entries of a raw XREADGROUP reply (RESP2 or RESP3), or of its error reply."""
        if isinstance(reply, redis.ResponseError):
            return self.group_gone(reply)
        if isinstance(reply, Exception):
            raise reply
        if not reply:
            return []
        # RESP2: [[stream, entries]]; RESP3 (protocol=3 in the URL): {stream: entries}
        entries = next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]
        return [
            RawEntry(eid, dict(zip(flat[::2], flat[1::2], strict=True)))
            for eid, flat in entries
            if flat is not None
        ]

    def group_gone(self, exc: redis.ResponseError) -> list[RawEntry]:
        """A read's error: recreate the group if it is gone (NOGROUP), or the stream was deleted
        under a blocked read (UNBLOCKED), and read nothing; raise any other."""
        if not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
            raise exc
        log.warning(
            "stream or consumer group gone on %s (Redis restarted or flushed); recreating it",
            self.key,
        )
        self.ensure_group()
        return []

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
        return self.ask_cancelled(rids).receive() if rids else set()

    def ask_cancelled(self, rids: Sequence[str]) -> CancelQuery:
        """Send ``cancelled``'s MGET now; the answer is read later from the returned query,
        which can also send a read behind it (``CancelQuery.read_behind``)."""
        packer = resp.Packer()
        packer.add_packed(resp.command(b"MGET", *[self._cancel + rid.encode() for rid in rids]))
        return CancelQuery(self, rids, resp.send(self.client, packer))

    def finish(self, items: Sequence[Finish]) -> int:
        """``finish_each``, counted: the entries finished here."""
        return sum(self.finish_each(items))

    def finish_each(self, items: Sequence[Finish]) -> list[bool]:
        """Stage the replies, then reply, dead-letter, ack and delete in one script: one round
        trip. Returns, per item, whether it was finished here; the others were not this
        consumer's to finish (claimed by another, flushed), so their replies were not written
        and must not be counted as served."""
        if not items:
            return []
        stream, dead, group, me = self._head
        orders = [_id_order(item.entry_id) for item in items]
        keys = [stream, dead]
        args = [group, me, b"%d" % len(items), b"%d-%d" % min(orders), b"%d-%d" % max(orders)]
        args.append(b"%d" % (_PAGE_SLACK + 2 * len(items)))
        staging = resp.Packer()  # RPUSH and EXPIRE of each staged reply
        for item in items:
            index = 0
            if item.reply is not None and item.rid is not None:
                staged = b"%s.%d" % (self._staging, next(self._serial))
                _stage(staging, staged, item.reply, item.reply_ttl_s)
                keys += [staged, self._reply + item.rid.encode()]
                index = len(keys) // 2 - 1
            args += [item.entry_id, b"%d" % index, (item.dead_reason or "").encode()]
        flags = self._run_finish(staging, keys, args)
        done = [flag == ord("1") for flag in flags]
        if len(done) != len(items):
            raise WorkerError(f"the finish script answered {flags!r} for {len(items)} entries")
        if not all(done):
            log.warning(
                "%d of %d entries were no longer pending on %s (claimed by another worker, "
                "deleted, flushed, or finished by an earlier try whose answer was lost) or "
                "their staged reply was gone; this try wrote no reply for them",
                len(items) - sum(done),
                len(items),
                self.consumer,
            )
        return done

    def _run_finish(self, staging: resp.Packer, keys: list[bytes], args: list[bytes]) -> bytes:
        """Send the staging commands and the script in one round trip; raise what failed.

        The script goes by EVALSHA behind the staging commands (redis-py's script helper would
        add a round trip per batch to check that it is loaded); when Redis lost it (a restart,
        SCRIPT FLUSH) it is loaded and run again on the replies already staged. A staging
        command that failed (OOM under noeviction) is raised after the script ran: the entries
        it held back stay pending, and the writer's retry finishes them.
        """
        staging.add_packed(
            resp.command(b"EVALSHA", self._finish.sha.encode(), b"%d" % len(keys), *keys, *args)
        )
        *staged, result = resp.round_trip(self.client, staging)
        if isinstance(result, redis.exceptions.NoScriptError):
            result = self._finish(keys=keys, args=args)
        if isinstance(result, Exception):
            raise result
        resp.raise_first_error(staged)
        return result.encode() if isinstance(result, str) else bytes(result)
