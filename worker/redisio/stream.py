"""Redis I/O for one model's request stream: the group, reads, and the per-batch finish step.

The finish step is one round trip per batch: one Lua script, atomic, fenced, and flagged
``allow-oom`` so that it runs on a full Redis (``maxmemory`` with ``noeviction``). It takes the
entries still pending on this consumer (one ``XPENDING`` over the batch's id range), writes each
reply with its TTL unless a reply is already there, copies dead letters (their ``rid`` and
``body``, each at most ``max_request_bytes``, plus ``reason``), and acknowledges and deletes with
one ``XACK`` and one ``XDEL`` (the script: ``worker/redisio/finish_script.py``). An entry that
another consumer has claimed is left to that consumer, so a request never gets two different
replies. Each run deletes the requests it answers, which is why it may write past
``maxmemory``: a full Redis still drains (contract section 4). Their replies stay until read or
expired, and may be larger than the requests were (docs/operations.md, "A full Redis").

How a reply reaches its key depends on its size. Redis copies a script's arguments into Lua on
the one thread every worker shares, at a cost that grows with their size (docs/design.md, "The
finish step on a full Redis"). A small reply goes into the script itself (``RPUSH``, and
``LTRIM`` of ours when a reply stood). A larger one is first pushed, with its TTL, to a staging
key of its own (``P:{M}:staging:NAME:TOKEN.N``, the token random per process) in the same round
trip, and the script moves it onto its reply key with ``RENAMENX``. On a full Redis that plain
push is refused (``OOM``); the script then reports the reply missing and leaves its entry
pending, and the same call runs the script again at once with that reply inside it. A staging
key whose script never ran (a dropped connection) expires with the reply's TTL. (On Redis 8.2,
XACKDEL could replace XACK + XDEL.)

A write Redis refuses for good (a reply key or the dead-letter key holding another type) fails
neither the script nor the batch: the request is dead-lettered instead of answered, or its dead
letter is lost, and either way acknowledged and logged here; ``refusals`` lists the requests
whose reply was refused, for the writer's metrics.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from producer.protocol.keys import (
    CONSUMER_GROUP,
    cancel_key,
    dead_key,
    reply_key,
    staging_key,
)
from producer.protocol.lanes import Lane
from producer.protocol.replies import Relabel
from producer.redisio import resp
from producer.redisio.retry import is_oom
from worker.errors import WorkerError
from worker.events import NO_EVENTS, Events
from worker.redisio.finish_script import FINISH_LUA, FLAGS, Refused, read_answer
from worker.redisio.group import StreamGroup, StreamStats

__all__ = ["Finish", "RawEntry", "RequestStream", "StreamStats"]

log = logging.getLogger(__name__)

#: Replies this long or longer are staged with a plain RPUSH (cheap for Redis) rather than
#: handed to the script (whose arguments cost Redis's thread by the KiB); shorter ones cost the
#: worker less inside the script than as two more commands.
INLINE_MAX_BYTES = 1024

_PAGE_SLACK = 64  # more of this consumer's pending entries the id range may hold
#: The worker's default ``limits.max_request_bytes``: no dead letter copies a longer value.
DEAD_LETTER_BOUND = 16 * 1024 * 1024


def _stage(packer: resp.Packer, key: bytes, reply: bytes, ttl: bytes) -> None:
    """``RPUSH key reply`` and ``EXPIRE key ttl``; a small reply is packed with one format (a
    third of the Python time of packing the two commands apart), a large one is not copied."""
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


#: The field a read adds to an entry that named a field twice, which a dict would hide: the
#: entry is then MALFORMED (contract section 2, v3: exactly ``rid`` and ``body``).
REPEATED_FIELD = b"(a field name repeated)"


def _entry(entry_id: bytes, flat: list[bytes], shard: str, lane: Lane | None) -> RawEntry:
    """An entry from its flat field list; one that repeats a name is marked for admission."""
    fields = dict(zip(flat[::2], flat[1::2], strict=True))
    if 2 * len(fields) != len(flat):
        fields[REPEATED_FIELD] = b""
    return RawEntry(entry_id, fields, shard, lane)


def _id_order(entry_id: bytes) -> tuple[int, int]:
    """A stream id as the pair Redis orders it by: (milliseconds, sequence)."""
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True, slots=True)
class RawEntry:
    """One stream entry as read: its id, its fields (still bytes), the stream it came from (ids
    are only unique within one stream) as the ``ShardMap`` names it (``shard``: the shard's tag
    for its default lane, the lane's stream key for any other), and that lane (None: the
    shard's default lane, class normal without a tenant)."""

    entry_id: bytes
    fields: dict[bytes, bytes]
    shard: str = ""
    lane: Lane | None = None

    @property
    def id_ms(self) -> int:
        """The entry's enqueue time in epoch ms (the first half of its id)."""
        return int(self.entry_id.split(b"-", 1)[0])


@dataclass(frozen=True, slots=True)
class FinishInFlight:
    """A finish step sent and not yet answered (``RequestStream.finish_start``)."""

    items: Sequence[Finish]
    keys: list[bytes]
    args: list[bytes]
    in_flight: resp.InFlight


@dataclass(frozen=True, slots=True)
class Finish:
    """What to do with one entry: reply (encoded) and/or dead-letter it, then ack and delete."""

    entry_id: bytes
    rid: str | None = None
    reply: bytes | None = None
    reply_ttl_s: int = 3600
    dead_reason: str | None = None
    code: str = "OK"  # the outcome, for metrics: OK, an error code, or DEAD_LETTER
    shard: str = ""  # the stream that holds the entry, as ``RawEntry.shard`` names it


class RequestStream:
    """The request stream of one lane of one shard of a model (``tag``: the model's name for its
    first shard; ``lane``: None or a default lane for ``P:{T}:requests``), seen by one consumer
    of the ``workers`` group. Reply, cancel and dead-letter keys are the shard's, whatever the
    lane. ``client`` is that shard's (on a cluster, bound to the master of its slot:
    ``producer.redisio.topology``)."""

    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        tag: str,
        consumer: str,
        events: Events = NO_EVENTS,
        max_request_bytes: int = DEAD_LETTER_BOUND,
        lane: Lane | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.tag = tag
        lane = lane or Lane(tag)
        self.key = lane.stream(prefix)
        # What entries read here name their stream by (``RawEntry.shard``), and their lane:
        # the default lane keeps version 2's names (its tag, no lane)
        self.shard = tag if lane.is_default else self.key
        self.lane: Lane | None = None if lane.is_default else lane
        # Its replies say its class and tenant (the encoder wrote class normal)
        self._relabel = None if lane.is_default else Relabel(lane.cls, lane.tenant)
        self.dead_key = dead_key(prefix, tag)
        self.consumer = consumer
        self.group = StreamGroup(
            client, self.key, self.dead_key, tag, events, recreate=lane.is_default
        )
        self._finish = client.register_script(FINISH_LUA)
        self._bound = b"%d" % max_request_bytes  # what a dead letter copies of a value, at most
        # The requests of the last finish whose reply Redis refused (each dead-lettered instead)
        # and why: read by the writer's thread after the finish, on which it is written
        self.refusals: list[tuple[Finish, str]] = []
        # Unique to this process: a worker restarted under the same name must never push onto a
        # staging key its previous life left behind.
        token = uuid.uuid4().hex[:12]
        self._staging = staging_key(prefix, tag, consumer, token).encode()
        self._serial = itertools.count()
        # Key prefixes for rids that admission has checked already (keys.reply_key would again).
        self._reply = reply_key(prefix, tag, "R")[:-1].encode()
        self._cancel = cancel_key(prefix, tag, "R")[:-1].encode()
        self._head = [
            self.key.encode(),
            self.dead_key.encode(),
            CONSUMER_GROUP.encode(),
            consumer.encode(),
        ]

    def ensure_group(self) -> None:
        """Create the group unless it exists (``StreamGroup.ensure``)."""
        self.group.ensure()

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
        shard, lane = self.shard, self.lane
        return [
            RawEntry(eid, dict(zip(flat[::2], flat[1::2], strict=True)), shard, lane)
            if len(flat) == 4  # rid and body: the only entry a request is (a repeat is short)
            else _entry(eid, flat, shard, lane)
            for eid, flat in entries
            if flat is not None
        ]

    def group_gone(self, exc: redis.ResponseError) -> list[RawEntry]:
        """A read's error (``StreamGroup.gone``): the group recreated when it was gone, and
        nothing read. A lane's stream that is gone (removed as empty: ``worker.redisio.lanegc``)
        is not made again here: ``vanished`` is set, and its lane stops reading."""
        self.group.gone(exc)
        return []

    @property
    def vanished(self) -> bool:
        """A lane's stream was found gone under a read (``StreamGroup.gone``)."""
        return self.group.vanished

    def stats(self) -> StreamStats:
        """The stream as the group sees it, and Redis memory (``StreamGroup.stats``)."""
        return self.group.stats()

    def send_cancel_keys(self, rids: Sequence[str]) -> resp.InFlight:
        """Send the MGET of ``rids``' cancel keys now; its answer is read from the returned
        connection later (worker/redisio/cancels.py), and the next read may be sent behind it
        (worker/redisio/readahead.py)."""
        packer = resp.Packer()
        packer.add_packed(resp.command(b"MGET", *[self._cancel + rid.encode() for rid in rids]))
        return resp.send(self.client, packer)

    def finish(self, items: Sequence[Finish]) -> int:
        """``finish_each``, counted: the entries finished here."""
        return sum(self.finish_each(items))

    def finish_each(self, items: Sequence[Finish]) -> list[bool]:
        """Reply, dead-letter, ack and delete in one script: one round trip (two when Redis is
        full and refused a staged reply). Returns, per item, whether it was finished here; the
        others were not this consumer's to finish (claimed by another, flushed), so their
        replies were not written and must not be counted as served."""
        return self.finish_end(self.finish_start(items)) if items else []

    def finish_start(self, items: Sequence[Finish]) -> FinishInFlight:
        """The first half of ``finish_each``: send the step now, so that the finish steps of
        several shards (a batch mixing them) are on the wire together."""
        keys, args, staging = self._finish_command(items, stage=True)
        staging.add(b"EVALSHA", self._finish.sha.encode(), b"%d" % len(keys), *keys, *args)
        return FinishInFlight(items, keys, args, resp.send(self.client, staging))

    def finish_end(self, sent: FinishInFlight) -> list[bool]:
        """The second half: read the answer, and finish what the first try could not."""
        items = sent.items
        self.refusals = []
        *staged, result = sent.in_flight.receive()
        done = self._flags(self._script_result(result, staged, sent.keys, sent.args), items)
        again = [i for i, flag in enumerate(done) if flag is None]
        if again:  # staged replies refused for memory (or evicted): inside the script this time
            log.debug("%d staged replies were gone; writing them inside the script", len(again))
            for i, flag in zip(again, self._finish_once([items[i] for i in again]), strict=True):
                done[i] = bool(flag)
        finished = [bool(flag) for flag in done]
        if not all(finished):
            log.warning(
                "%d of %d entries were no longer pending on %s (claimed by another worker, "
                "deleted, flushed, or finished by an earlier try whose answer was lost); this "
                "try wrote no reply for them",
                len(items) - sum(finished),
                len(items),
                self.consumer,
            )
        return finished

    def _finish_once(self, items: Sequence[Finish], *, stage: bool = False) -> list[bool | None]:
        """One run of the finish script; per item True (finished), False (not ours) or None
        (its staged reply was gone). With ``stage``, long replies are staged first."""
        keys, args, staging = self._finish_command(items, stage=stage)
        return self._flags(self._run_finish(staging, keys, args), items)

    def _flags(
        self, answer: tuple[bytes, list[Refused]], items: Sequence[Finish]
    ) -> list[bool | None]:
        """Per item, the script's flag; what Redis refused is logged and kept in
        ``refusals``."""
        flags, refused = answer
        if len(flags) != len(items):
            raise WorkerError(f"the finish script answered {flags!r} for {len(items)} entries")
        if refused:
            self._refused(items, refused)
        return [FLAGS[flag] for flag in flags]

    def _refused(self, items: Sequence[Finish], refused: list[Refused]) -> None:
        """Log what Redis refused: a warning per reply (the request was dead-lettered
        instead), one error per run for the dead letters lost."""
        lost: list[tuple[Finish, Refused]] = []
        for refusal in refused:
            item = items[refusal.index]
            if refusal.what == "reply":
                self.refusals.append((item, refusal.detail))
                log.warning(
                    "request %s was not answered: %s; it was moved to the dead letters (%s) "
                    "and acknowledged",
                    item.rid,
                    refusal.detail,
                    self.dead_key,
                )
            else:
                lost.append((item, refusal))
        if lost:
            log.error(
                "the dead-letter key %s holds %s and refused XADD (%s): the dead letters of %d "
                "requests were lost, each still answered where it could be and acknowledged "
                "(%s). DEL or RENAME that key (after saving what it holds) to keep dead letters "
                "again.",
                self.dead_key,
                lost[0][1].held,
                lost[0][1].detail,
                len(lost),
                _listed(lost, {id(item): why for item, why in self.refusals}),
            )

    def _finish_command(
        self, items: Sequence[Finish], *, stage: bool
    ) -> tuple[list[bytes], list[bytes], resp.Packer]:
        """The script's keys and arguments, and the staging commands that go ahead of it."""
        stream, dead, group, me = self._head
        orders = [_id_order(item.entry_id) for item in items]
        keys = [stream, dead]
        args = [group, me, b"%d" % len(items), b"%d-%d" % min(orders), b"%d-%d" % max(orders)]
        args += [b"%d" % (_PAGE_SLACK + 2 * len(items)), self._bound]
        staging = resp.Packer()  # RPUSH and EXPIRE of each staged reply
        relabel = self._relabel
        for item in items:
            how, index, ttl, data = b"", b"0", b"%d" % item.reply_ttl_s, b""
            if item.reply is not None and item.rid is not None:
                index = b"%d" % (len(keys) + 1)  # a Lua index: KEYS[1] is keys[0]
                reply = item.reply if relabel is None else relabel(item.reply)
                if stage and len(reply) >= INLINE_MAX_BYTES:
                    staged = b"%s.%d" % (self._staging, next(self._serial))
                    _stage(staging, staged, reply, ttl)
                    how = b"s"
                    keys.append(staged)
                else:
                    how, data = b"i", reply
                keys.append(self._reply + item.rid.encode())
            args += [item.entry_id, index, (item.dead_reason or "").encode(), how, ttl, data]
        return keys, args, staging

    def _run_finish(
        self, staging: resp.Packer, keys: list[bytes], args: list[bytes]
    ) -> tuple[bytes, list[Refused]]:
        """Send the staging commands and the script in one round trip; raise what failed.

        The script goes by EVALSHA behind the staging commands (redis-py's script helper would
        add a round trip per batch to check that it is loaded); when Redis lost it (a restart,
        SCRIPT FLUSH) it is loaded and run again on the replies already staged. A staging push
        refused for memory is no error: the script reports its reply missing. Any other failed
        staging command is raised after the script ran: the entries it held back stay pending,
        and the writer's retry finishes them.
        """
        staging.add(b"EVALSHA", self._finish.sha.encode(), b"%d" % len(keys), *keys, *args)
        *staged, result = resp.round_trip(self.client, staging)
        return self._script_result(result, staged, keys, args)

    def _script_result(
        self, result: Any, staged: list[Any], keys: list[bytes], args: list[bytes]
    ) -> tuple[bytes, list[Refused]]:
        """The script's flags and what Redis refused; it is loaded and run again when Redis
        lost it. Raises what failed (a staging push refused for memory is no failure: its reply
        is reported gone)."""
        if isinstance(result, redis.exceptions.NoScriptError):
            result = self._finish(keys=keys, args=args)
        if isinstance(result, Exception):
            raise result
        resp.raise_first_error([reply for reply in staged if not is_oom(reply)])
        return read_answer(result)


def _listed(lost: Sequence[tuple[Finish, Refused]], why: dict[int, str], most: int = 10) -> str:
    """The requests whose dead letters were lost, for a log line: entry id, rid and the reason
    each was dead-lettered (``why``: by ``id()``, those whose reply was refused), at most
    ``most``."""
    named = [
        f"entry {item.entry_id.decode()} rid {item.rid or '-'}: "
        f"{(item.dead_reason or why.get(id(item), ''))[:300]}"
        for item, _ in lost[:most]
    ]
    more = f"; and {len(lost) - most} more" if len(lost) > most else ""
    return "; ".join(named) + more
