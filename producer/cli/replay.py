"""``redbatch replay``: the command around ``producer.ops.replay``, its text and JSON reports and
its arguments.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from producer.cli import argtypes
from producer.cli.reach import open_redis
from producer.ops.replay import ReplayReport, replay
from producer.ops.textformat import printable, table
from producer.ops.words import count

__all__ = ["add_arguments", "format_report", "report_to_json", "run_command"]

_EXIT_OK, _EXIT_SKIPPED = 0, 1


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
        of = count(len(report.shards), "shard")
        lines = [f"replay P:{{T}}:dead -> P:{{T}}:requests of {of} ({ids})"]
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
        f"examined {count(report.examined, 'dead letter')}: {verb} {len(report.resent)}, "
        f"skipped {len(report.skipped)}"
    )
    if removed:
        old = count(removed, "old reply", "old replies")
        summary += f"; {'would remove' if report.dry_run else 'removed'} {old}"
    if report.delete:
        gone = len(report.resent) if report.dry_run else report.deleted
        summary += (
            f"; {'would delete' if report.dry_run else 'deleted'} {count(gone, 'dead letter')}"
        )
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
    """The ``redbatch replay`` options (``producer.cli.main`` registers the subcommand)."""
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
    conn = open_redis(args, socket_timeout=30)
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
