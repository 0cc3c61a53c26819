"""``redbatch replay``: send dead-lettered requests to the request stream again.

A dead letter (``P:{T}:dead``) keeps the original entry's fields, ``rid`` and ``body``, plus the
``reason`` it died. ``replay`` walks each shard ``T`` of the model (``P:{M}:shards``, those
retiring included: they still hold requests), on the node that serves it, reads its dead letters
oldest first, up to the dead stream's last entry when it started (so a request that dies again
during the replay is not replayed twice), and adds each one to the same shard's
``P:{T}:requests`` as a fresh request with exactly the two fields of the protocol. The same
shard, because its reply key ``P:{T}:reply:R`` is where the caller of a kept id looks, and because
every transaction must stay in one cluster slot:

- ``new_ids`` (the default): a new request id (UUID4 hex), as the protocol asks of any retry.
  Works for every dead letter with a body, including those whose ``rid`` was missing or broken.
  The old id's caller will not see the answer; the report maps old ids to new ones.
- ``same_ids``: the old request id, so whoever looks up ``P:{T}:reply:R`` finds the new answer.
  A reply is never replaced, so an old error reply (the ``POISONED`` answer) is deleted first;
  a dead letter whose id already has an ok reply, or a reply that cannot be read, is skipped.
  Dead letters without a valid id need new ids.

With ``delete`` each dead letter that was re-sent is removed (``XDEL``). Each page of one shard's
dead letters is re-sent, its old replies removed and its dead letters deleted in one ``MULTI``
(all keys of that one tag), so a failure never leaves a dead letter deleted without its request
re-sent. A dry run changes nothing. ``limit`` counts over all shards, taken in the list's order.
"""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from producer import argtypes, codec, keys
from producer.errors import WireFormatError
from producer.shards import read_shards
from producer.status import ShardAccess
from producer.statusformat import printable, table
from producer.topology import Topology

__all__ = [
    "PAGE_SIZE",
    "ReplayReport",
    "Resent",
    "ShardReplay",
    "Skipped",
    "add_arguments",
    "format_report",
    "replay",
    "report_to_json",
    "run_command",
]

#: Dead letters read, and re-sent in one MULTI, per round trip.
PAGE_SIZE = 256

_EXIT_OK, _EXIT_SKIPPED = 0, 1


@dataclass(frozen=True, slots=True)
class Resent:
    """A dead letter sent again: its entry, the old and the new request id, the new entry."""

    dead_entry: str
    old_rid: str | None
    rid: str
    entry_id: str | None  # None on a dry run
    reply_removed: bool = False
    tag: str = ""  # the shard: its dead letter, and now its request stream


@dataclass(frozen=True, slots=True)
class Skipped:
    """A dead letter left as it was, and why."""

    dead_entry: str
    rid: str | None
    reason: str
    tag: str = ""


@dataclass(frozen=True, slots=True)
class ShardReplay:
    """What one replay did on one shard."""

    tag: str
    dead_key: str
    stream_key: str
    examined: int
    resent: int
    skipped: int


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What one replay did, over all shards (``shards``: each one's counts). ``dead_key`` and
    ``stream_key`` name the one shard's keys, or list every shard's."""

    model: str
    prefix: str
    dead_key: str
    stream_key: str
    same_ids: bool
    delete: bool
    dry_run: bool
    examined: int
    resent: tuple[Resent, ...] = field(default=())
    skipped: tuple[Skipped, ...] = field(default=())
    shards: tuple[ShardReplay, ...] = field(default=())

    @property
    def deleted(self) -> int:
        """Dead letters removed (``delete`` and not a dry run)."""
        return len(self.resent) if self.delete and not self.dry_run else 0


def _new_rid() -> str:
    return uuid.uuid4().hex


@dataclass(slots=True)
class _Plan:
    dead_entry: str
    old_rid: str | None
    rid: str
    body: bytes
    remove_reply: bool = False


def replay(
    conn: redis.Redis,
    model: str,
    prefix: str = keys.DEFAULT_PREFIX,
    *,
    same_ids: bool = False,
    limit: int | None = None,
    delete: bool = False,
    dry_run: bool = False,
    new_rid: Callable[[], str] = _new_rid,
    retry_s: float = 0.0,
    topology: Topology | None = None,
) -> ReplayReport:
    """Re-send up to ``limit`` dead letters of ``model``, shard by shard, retrying each step
    through an outage for up to ``retry_s``; Redis errors raise ConnectionFailed.

    A page's MULTI that ran but whose answer was lost is sent again on retry: its requests are
    queued twice under the same ids (at-least-once; a worker writes one reply per id)."""
    access = ShardAccess(conn, retry_s, topology)
    resent: list[Resent] = []
    skipped: list[Skipped] = []
    shards: list[ShardReplay] = []
    examined = 0
    try:
        if topology is None:
            access.refresh()
        tags = access.on(model, read_shards, prefix, model).serve
        for tag in tags:
            left = None if limit is None else limit - examined
            if left is not None and left <= 0:  # listed anyway: the report names every shard
                dead, stream = keys.dead_key(prefix, tag), keys.request_stream(prefix, tag)
                shards.append(ShardReplay(tag, dead, stream, 0, 0, 0))
                continue
            part = _replay_shard(
                access, prefix, tag, same_ids, left, delete, dry_run, new_rid, resent, skipped
            )
            examined += part.examined
            shards.append(part)
    finally:
        access.close()
    return ReplayReport(
        model=model,
        prefix=prefix,
        dead_key=", ".join(s.dead_key for s in shards) or keys.dead_key(prefix, model),
        stream_key=", ".join(s.stream_key for s in shards) or keys.request_stream(prefix, model),
        same_ids=same_ids,
        delete=delete,
        dry_run=dry_run,
        examined=examined,
        resent=tuple(resent),
        skipped=tuple(skipped),
        shards=tuple(shards),
    )


def _replay_shard(
    access: ShardAccess,
    prefix: str,
    tag: str,
    same_ids: bool,
    limit: int | None,
    delete: bool,
    dry_run: bool,
    new_rid: Callable[[], str],
    resent: list[Resent],
    skipped: list[Skipped],
) -> ShardReplay:
    """One shard's dead letters, page by page, on the node serving it."""
    dead_key = keys.dead_key(prefix, tag)
    stream_key = keys.request_stream(prefix, tag)
    examined = 0
    sent_before, skipped_before = len(resent), len(skipped)
    newest = access.on(tag, _newest, dead_key)
    if newest is not None:
        end, start = newest, "-"
        taken: set[str] = set()
        while limit is None or examined < limit:
            count = PAGE_SIZE if limit is None else min(PAGE_SIZE, limit - examined)
            page = access.on(tag, _page, dead_key, start, end, count)
            if not page:
                break
            examined += len(page)
            start = "(" + _text(page[-1][0])
            plans = _plan_page(page, same_ids, new_rid, taken, skipped, tag)
            if same_ids:
                plans = access.on(tag, _check_replies, prefix, tag, plans, skipped)
            resent += access.on(
                tag, _send, stream_key, dead_key, prefix, tag, plans, delete, dry_run
            )
            if _text(page[-1][0]) == end:
                break
    return ShardReplay(
        tag,
        dead_key,
        stream_key,
        examined,
        resent=len(resent) - sent_before,
        skipped=len(skipped) - skipped_before,
    )


def _newest(conn: redis.Redis, dead_key: str) -> str | None:
    newest = conn.xrevrange(dead_key, "+", "-", count=1)
    return _text(newest[0][0]) if newest else None


def _page(conn: redis.Redis, dead_key: str, start: str, end: str, count: int) -> Any:
    return conn.xrange(dead_key, start, end, count=count)


def _plan_page(
    page: Sequence[tuple[Any, Mapping[Any, Any] | None]],
    same_ids: bool,
    new_rid: Callable[[], str],
    taken: set[str],
    skipped: list[Skipped],
    tag: str = "",
) -> list[_Plan]:
    """What to send for each dead letter of a page; the others go to ``skipped``."""
    plans = []
    for raw_id, raw_fields in page:
        entry = _text(raw_id)
        fields = {_text(k): v for k, v in (raw_fields or {}).items()}
        old = _rid(fields.get("rid"))
        shown = old if old is not None else _shown_rid(fields.get("rid"))
        body = fields.get("body")
        if not isinstance(body, bytes):
            skipped.append(Skipped(entry, shown, "no body field: nothing to send", tag))
            continue
        if not same_ids:
            plans.append(_Plan(entry, shown, new_rid(), body))
            continue
        if old is None:
            reason = (
                "no rid field; use --new-ids"
                if fields.get("rid") is None
                else "rid does not match [A-Za-z0-9_.:-]{1,128}; use --new-ids"
            )
            skipped.append(Skipped(entry, shown, reason, tag))
        elif old in taken:
            skipped.append(Skipped(entry, old, "rid already re-sent by this replay", tag))
        else:
            taken.add(old)
            plans.append(_Plan(entry, old, old, body))
    return plans


def _check_replies(
    conn: redis.Redis, prefix: str, tag: str, plans: list[_Plan], skipped: list[Skipped]
) -> list[_Plan]:
    """With same ids: an old error reply is to be removed; an ok or unreadable one blocks."""
    if not plans:
        return plans
    pipe = conn.pipeline(transaction=False)
    for plan in plans:
        pipe.lindex(keys.reply_key(prefix, tag, plan.rid), 0)
    kept = []
    for plan, raw in zip(plans, pipe.execute(), strict=True):
        if raw is None:
            kept.append(plan)
            continue
        try:
            reply = codec.decode_reply(raw)
        except WireFormatError:
            skipped.append(
                Skipped(plan.dead_entry, plan.rid, "its reply key holds an unreadable reply", tag)
            )
            continue
        if reply.ok:
            skipped.append(
                Skipped(
                    plan.dead_entry,
                    plan.rid,
                    "already answered ok; --new-ids runs it again without losing that answer",
                    tag,
                )
            )
            continue
        plan.remove_reply = True
        kept.append(plan)
    return kept


def _send(
    conn: redis.Redis,
    stream_key: str,
    dead_key: str,
    prefix: str,
    tag: str,
    plans: list[_Plan],
    delete: bool,
    dry_run: bool,
) -> list[Resent]:
    """One MULTI per page: remove old replies, add the requests, delete the dead letters."""
    if dry_run or not plans:
        return [Resent(p.dead_entry, p.old_rid, p.rid, None, p.remove_reply, tag) for p in plans]
    pipe = conn.pipeline(transaction=True)
    positions = []
    for plan in plans:
        if plan.remove_reply:
            pipe.delete(keys.reply_key(prefix, tag, plan.rid))
        positions.append(len(pipe.command_stack))
        pipe.xadd(stream_key, {"rid": plan.rid, "body": plan.body})
        if delete:
            pipe.xdel(dead_key, plan.dead_entry)
    results = pipe.execute()
    return [
        Resent(p.dead_entry, p.old_rid, p.rid, _text(results[i]), p.remove_reply, tag)
        for p, i in zip(plans, positions, strict=True)
    ]


def _rid(value: Any) -> str | None:
    """The dead letter's request id when it is one a key may be built from."""
    if not isinstance(value, bytes):
        return None
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if keys.is_valid_rid(text) else None


def _shown_rid(value: Any) -> str | None:
    if value is None:
        return None
    text = _text(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _text(value: Any) -> str:
    """Bytes from Redis as text, bytes that are not UTF-8 as ``\\xNN`` (as ``status`` shows
    them)."""
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)


# ---------------------------------------------------------------------------------------------
# Reports


def report_to_json(report: ReplayReport) -> dict[str, Any]:
    """The report as JSON values."""
    return {
        "model": report.model,
        "prefix": report.prefix,
        "dead_key": report.dead_key,
        "stream_key": report.stream_key,
        "ids": "same" if report.same_ids else "new",
        "dry_run": report.dry_run,
        "examined": report.examined,
        "resent": [
            {
                "dead_entry": r.dead_entry,
                "old_rid": r.old_rid,
                "rid": r.rid,
                "entry_id": r.entry_id,
                "reply_removed": r.reply_removed,
                "shard": r.tag,
            }
            for r in report.resent
        ],
        "skipped": [
            {"dead_entry": s.dead_entry, "rid": s.rid, "reason": s.reason, "shard": s.tag}
            for s in report.skipped
        ],
        "deleted": report.deleted,
        "shards": [
            {
                "tag": s.tag,
                "dead_key": s.dead_key,
                "stream_key": s.stream_key,
                "examined": s.examined,
                "resent": s.resent,
                "skipped": s.skipped,
                "deleted": s.resent if report.delete and not report.dry_run else 0,
            }
            for s in report.shards
        ],
    }


def format_report(report: ReplayReport) -> str:
    """The readable report ``redbatch replay`` prints; with several shards, each shard's counts
    and a SHARD column."""
    sharded = len(report.shards) > 1
    ids = "same request ids" if report.same_ids else "new request ids"
    if sharded:
        lines = [f"replay P:{{T}}:dead -> P:{{T}}:requests of {len(report.shards)} shards ({ids})"]
    else:
        lines = [f"replay {report.dead_key} -> {report.stream_key} ({ids})"]
    if report.dry_run:
        lines.append("dry run: nothing was sent, removed or deleted")
    if not report.examined:
        return "\n".join([*lines, "no dead letters"])
    verb = "would re-send" if report.dry_run else "re-sent"
    if sharded:
        rows = [["SHARD", "EXAMINED", verb.upper(), "SKIPPED"]]
        rows += [[s.tag, str(s.examined), str(s.resent), str(s.skipped)] for s in report.shards]
        rows.append(
            ["total", str(report.examined), str(len(report.resent)), str(len(report.skipped))]
        )
        lines += table(rows, indent="  ", right=frozenset({1, 2, 3}))
    removed = sum(r.reply_removed for r in report.resent)
    summary = (
        f"examined {report.examined} dead letters: {verb} {len(report.resent)}, "
        f"skipped {len(report.skipped)}"
    )
    if removed:
        summary += f"; {'would remove' if report.dry_run else 'removed'} {removed} old replies"
    if report.delete:
        count = len(report.resent) if report.dry_run else report.deleted
        summary += f"; {'would delete' if report.dry_run else 'deleted'} {count} dead letters"
    lines.append(summary)
    shard = ["SHARD"] if sharded else []
    if report.resent:
        rows = [[*shard, "DEAD ENTRY", "OLD RID", "RID", "REQUEST ENTRY", "OLD REPLY"]]
        rows += [
            [
                *([r.tag] if sharded else []),
                r.dead_entry,
                r.old_rid or "-",
                r.rid,
                r.entry_id or "-",
                "removed" if r.reply_removed else "-",
            ]
            for r in report.resent
        ]
        lines += table(rows, indent="  ")
    if report.skipped:
        lines.append("skipped:")
        rows = [[*shard, "DEAD ENTRY", "RID", "REASON"]]
        rows += [
            [*([s.tag] if sharded else []), s.dead_entry, s.rid or "-", s.reason]
            for s in report.skipped
        ]
        lines += table(rows, indent="  ")
    return "\n".join(map(printable, lines))


# ---------------------------------------------------------------------------------------------
# The command

_HELP = """\
Re-send a model's dead-lettered requests to its request stream, oldest first, and report what
was sent: old and new request ids, the new entries, and each dead letter skipped with the reason.
A model with several shards (P:{M}:shards) has a dead-letter stream per shard, P:{T}:dead: each
shard's dead letters go back to that shard's request stream, P:{T}:requests, and the report
gives each shard's counts and their total. --limit counts over all shards, in the list's order.

--new-ids (the default) gives each request a new id, as any retry should have; callers waiting
on the old id do not see the answer, so use the printed mapping. --same-ids keeps the old ids:
a reply is never replaced, so the old error reply (POISONED) is deleted first, and dead letters
whose id already has an ok reply are skipped; entries without a valid rid need --new-ids.
--delete removes each dead letter that was re-sent. Inspect dead letters first with
`redbatch status`: a request that killed workers may kill them again.
Exit status: 0 when every dead letter examined was re-sent, 1 when some were skipped, 2 when the
command could not run.

examples:
  redbatch replay --model demo --from-dead --dry-run
  redbatch replay --model demo --from-dead --limit 10 --delete
  redbatch replay --model demo --from-dead --same-ids --delete --json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``redbatch replay`` options (``producer.cli`` registers the subcommand)."""
    parser.description = _HELP
    add = parser.add_argument
    add("--model", required=True, type=argtypes.model_name, help="model name")
    add(
        "--from-dead",
        action="store_true",
        required=True,
        help="re-send from the model's dead-letter stream (the one source for now)",
    )
    ids = parser.add_mutually_exclusive_group()
    ids.add_argument(
        "--new-ids",
        dest="same_ids",
        action="store_false",
        help="give each request a new id, a UUID4 in hex (the default)",
    )
    ids.add_argument(
        "--same-ids",
        dest="same_ids",
        action="store_true",
        help="keep each request's id; its old error reply is deleted first",
    )
    parser.set_defaults(same_ids=False)
    add(
        "--limit",
        type=argtypes.positive_int,
        metavar="N",
        help="at most N dead letters, oldest first",
    )
    add("--delete", action="store_true", help="delete each dead letter that was re-sent")
    add("--dry-run", action="store_true", help="show what would be done; change nothing")
    add("--json", action="store_true", help="print the report as JSON")


def run_command(args: argparse.Namespace) -> int:
    """``redbatch replay``: re-send, print the report; 0, or 1 when something was skipped."""
    conn = redis.Redis.from_url(args.redis_url, socket_connect_timeout=5, socket_timeout=30)
    try:
        report = replay(
            conn,
            args.model,
            args.prefix,
            same_ids=args.same_ids,
            limit=args.limit,
            delete=args.delete,
            dry_run=args.dry_run,
            retry_s=args.retry_s,
        )
    finally:
        conn.close()
    if args.json:
        print(json.dumps(report_to_json(report), indent=2))
    else:
        print(format_report(report))
    return _EXIT_SKIPPED if report.skipped else _EXIT_OK
