"""``redbatch shards``: show, place and retire the shards of a model's queue from the command
line, as text or JSON. What each does is ``producer.ops.shards``; this module is its reports and
its arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from producer.cli import argtypes
from producer.cli.argtypes import EXIT_FAILED, EXIT_OK
from producer.cli.reach import open_redis
from producer.ops.shards import (
    DEFAULT_TIMEOUT_S,
    DrainState,
    Placement,
    Retirement,
    ShardsView,
    check_retirable,
    place,
    retire,
    show,
    spread_notes,
)
from producer.ops.status import ShardAccess
from producer.ops.textformat import ago, printable, table
from producer.ops.words import count
from producer.protocol import keys
from producer.redisio import shards
from producer.redisio.connection import redact_url
from producer.redisio.topology import tag_slot

__all__ = ["add_arguments", "run_command"]


# ---------------------------------------------------------------------------------------------
# Reports


def view_to_json(view: ShardsView) -> dict[str, Any]:
    """``show`` as JSON values."""
    return {
        "model": view.model,
        "prefix": view.prefix,
        "cluster": view.cluster,
        "masters": list(view.masters),
        "list": None if view.listed is None else list(view.listed),
        "send": [s.tag for s in view.shards if s.state == "send"],
        "retiring": [s.tag for s in view.shards if s.state == "retiring"],
        "shards": [
            {
                "tag": s.tag,
                "state": s.state,
                "master": s.node,
                "slot": tag_slot(s.tag),
                "backlog": s.requests.backlog,
                "pending": None if s.requests.group is None else s.requests.group.pending,
                "dead": s.dead.count,
                "oldest_entry_age_s": s.requests.oldest_entry_age_s,
            }
            for s in view.shards
        ],
        "total": {
            "backlog": sum(s.requests.backlog for s in view.shards),
            "pending": sum(s.requests.group.pending for s in view.shards if s.requests.group),
            "dead": sum(s.dead.count for s in view.shards),
        },
    }


def format_view(view: ShardsView, where: str | None = None) -> str:
    """``show`` as a person reads it: the list, the retiring set, a row per shard, a total."""
    at = f" at {where}" if where else ""
    kind = (
        f"a Redis Cluster of {count(len(view.masters), 'master')}" if view.cluster else "one Redis"
    )
    shards_here = count(len(view.shards), "shard")
    lines = [f"model {view.model!r}, prefix {view.prefix!r}{at}: {shards_here} on {kind}"]
    key = keys.shards_key(view.prefix, view.model)
    if view.listed is None:
        lines.append(f"shard list {key}: absent (one shard, {view.model})")
    else:
        lines.append(f"shard list {key}: {', '.join(view.listed)}")
    retiring = [s.tag for s in view.shards if s.state == "retiring"]
    if retiring:
        lines.append(
            f"retiring {keys.retiring_key(view.prefix, view.model)}: {', '.join(retiring)} "
            "(no longer sent to; workers serve them until drained)"
        )
    where_cols = ["MASTER", "SLOT"] if view.cluster else []
    rows = [["SHARD", "STATE", *where_cols, "BACKLOG", "PENDING", "DEAD", "OLDEST"]]
    for s in view.shards:
        group = s.requests.group
        age = s.requests.oldest_entry_age_s
        rows.append(
            [
                s.tag,
                s.state,
                *_where_cells(view.cluster, s.tag, s.node),
                str(s.requests.backlog),
                "-" if group is None else str(group.pending),
                str(s.dead.count),
                "-" if age is None else ago(age),
            ]
        )
    total = view_to_json(view)["total"]
    pending = str(total["pending"]) if any(s.requests.group for s in view.shards) else "-"
    blank = ["", ""] if view.cluster else []
    rows.append(["total", "", *blank, str(total["backlog"]), pending, str(total["dead"]), ""])
    numbers = {3, 4, 5, 6} if view.cluster else {2, 3, 4}
    lines += table(rows, indent="  ", right=frozenset(numbers))
    sending = {s.tag: s.node for s in view.shards if s.state == "send"}
    lines += [f"note: {note}" for note in spread_notes(sending, view.masters)]
    return "\n".join(map(printable, lines))


def _where_cells(cluster: bool, tag: str, node: str | None) -> list[str]:
    """A shard's MASTER and SLOT cells, on a cluster only."""
    return [node or "-", str(tag_slot(tag))] if cluster else []


def placement_to_json(placed: Placement) -> dict[str, Any]:
    """``place`` as JSON values."""
    return {
        "model": placed.model,
        "prefix": placed.prefix,
        "cluster": placed.cluster,
        "count": placed.count,
        "before": list(placed.before),
        "added": list(placed.added),
        "after": list(placed.after),
        "changed": bool(placed.added),
        "shards": [
            {"tag": tag, "master": placed.nodes.get(tag), "slot": tag_slot(tag)}
            for tag in placed.after
        ],
        "notes": list(placed.notes),
    }


def format_placement(placed: Placement) -> str:
    """``place`` as a person reads it."""
    key = keys.shards_key(placed.prefix, placed.model)
    if placed.added:
        lines = [
            f"added {count(len(placed.added), 'shard')} to {key}: {', '.join(placed.added)}; "
            f"{placed.model!r} has {len(placed.after)} (workers and producers pick them up "
            f"within {shards.REFRESH_S:g} s)"
        ]
    else:
        lines = [f"{placed.model!r} has {count(len(placed.after), 'shard')}; nothing changed"]
    where = ["MASTER", "SLOT"] if placed.cluster else []
    rows = [["SHARD", *where, ""]]
    for tag in placed.after:
        new = "new" if tag in placed.added else ""
        rows.append([tag, *_where_cells(placed.cluster, tag, placed.nodes.get(tag)), new])
    lines += table(rows, indent="  ")
    lines += [f"note: {note}" for note in placed.notes]
    return "\n".join(map(printable, lines))


def retirement_to_json(done: Retirement) -> dict[str, Any]:
    """``retire`` as JSON values."""
    return {
        "model": done.model,
        "prefix": done.prefix,
        "shard": done.tag,
        "moved": done.moved,
        "list_deleted": done.list_deleted,
        "waited": done.waited,
        "retired": done.retired,
        "timed_out": done.timed_out,
        "backlog": done.backlog,
        "pending": done.pending,
        "dead": done.dead,
        "waited_s": done.waited_s,
    }


def format_retirement(done: Retirement) -> str:
    """``retire``'s last lines."""
    retiring = keys.retiring_key(done.prefix, done.model)
    lines = []
    if done.retired:
        lines.append(
            f"retired {done.tag}: drained, and removed from {retiring} after "
            f"{done.waited_s:.1f} s; workers stop serving it within {shards.REFRESH_S:g} s"
        )
    elif done.timed_out:
        lines.append(
            f"{done.tag} still holds {count(done.backlog or 0, 'entry', 'entries')} "
            f"({done.pending} pending) after "
            f"{done.waited_s:.1f} s: it stays in {retiring} and workers keep serving it. Run "
            f"`redbatch shards retire --model {done.model} --shard {done.tag}` again to wait on"
        )
    else:
        lines.append(
            f"{done.tag} is retiring: producers stop sending to it within "
            f"{shards.REFRESH_S:g} s, workers serve it until it is drained. Run `redbatch "
            f"shards retire --model {done.model} --shard {done.tag}` (it waits) to finish"
        )
    if done.dead:
        dead = keys.dead_key(done.prefix, done.tag)
        lines.append(
            f"note: {dead} holds {count(done.dead, 'dead letter')}; status and replay list a "
            "shard only "
            "while it is listed or retiring: replay them (redbatch replay --from-dead) before "
            f"it retires, or read them with XRANGE {dead} - +"
        )
    return "\n".join(map(printable, lines))


class _Progress:
    """Prints a retiring shard's drain as it changes (and every 10 s while it does not), so a
    person sees it move without a line per poll."""

    def __init__(self, out: Callable[[str], None], model: str) -> None:
        self.out = out
        self.model = model
        self.last: tuple[int, int, bool] | None = None
        self.printed_at = 0.0

    def __call__(self, state: DrainState) -> None:
        if self.last is None:  # the shard was found and is retiring now
            self.out(
                f"retiring {state.tag} of {self.model!r}: producers stop sending to it within "
                f"{shards.REFRESH_S:g} s; waiting until it is drained"
            )
        seen = (state.backlog, state.pending, state.grace_left_s > 0)
        if seen == self.last and state.elapsed_s - self.printed_at < 10.0:
            return
        self.last, self.printed_at = seen, state.elapsed_s
        text = f"{state.tag}: backlog {state.backlog}, pending {state.pending}"
        if state.grace_left_s > 0:
            text += f"; waiting {state.grace_left_s:.1f} s more for producers to see the change"
        elif state.drained:
            text += ": drained"
        self.out(text)


# ---------------------------------------------------------------------------------------------
# The command

HELP = """\
Show, place and retire the shards of a model's queue. A shard is one request stream (with its
dead letters, replies and cancels) in one Redis Cluster slot; P:{M}:shards lists a model's
shards, its own tag M first, then M~K. Producers spread requests over them and every worker
serves them all, picking up a change within 5 s, without a restart. On a cluster, each shard on
its own master spreads the queue's load; on one Redis, shards add nothing.

examples:
  redbatch shards show --model demo
  redbatch shards place --model demo --count 3
  redbatch shards retire --model demo --shard demo~2
"""

_SHOW_HELP = """\
Show a model's shard list, the shards being retired, and for each shard the master it lives on
(on a cluster), its backlog (XLEN), what workers hold (pending), its dead letters, and a total.

examples:
  redbatch shards show --model demo
  redbatch shards show --model demo --json | jq '.shards[] | {tag, master, backlog}'
"""

_PLACE_HELP = """\
Give a model COUNT shards, each new one on a cluster master that holds none of the model's
shards yet (round-robin once every master holds one), by choosing its tag M~K so that its slot
is there. The first shard is always M, wherever its slot is. Shards are only ever appended:
running it again with the same COUNT changes nothing, a larger COUNT adds shards online, a
smaller one changes nothing (retire removes shards). On a single Redis it works too, with every
shard on the one node.

examples:
  redbatch shards place --model demo --count 3
  redbatch shards place --model demo --count 6 --json
"""

_RETIRE_HELP = """\
Retire one shard: take it off the list (producers stop sending to it within 5 s) and into
P:{M}:retiring (workers keep serving it), in one transaction. With --wait (the default), then
wait until it is drained (no entry in its stream, none pending) and remove it from the retiring
set, printing its progress; it first waits 5 s and a margin, as producers may still send until
they read the list again. The model's first shard, M, is never retired. When only M is left the
list is deleted (absent means one shard). A shard already retiring is waited for again, so an
interrupted run can be resumed. Exit status 1 when --timeout-s passed before the drain.

examples:
  redbatch shards retire --model demo --shard demo~2
  redbatch shards retire --model demo --shard demo~2 --no-wait
  redbatch shards retire --model demo --shard demo~2 --timeout-s 600 --json
"""


def _shard_arg(text: str) -> str:
    if not keys.is_valid_tag(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a shard tag: MODEL~K with K in [a-z0-9]{{1,16}}"
        )
    return text


def add_arguments(
    parser: argparse.ArgumentParser,
    connection_options: Callable[[argparse.ArgumentParser], None] | None = None,
) -> None:
    """``redbatch shards`` and its ``show``, ``place`` and ``retire`` (``producer.cli.main``
    registers the command and passes its connection options, added to each)."""
    parser.description = HELP
    formatter = argparse.RawDescriptionHelpFormatter
    actions = parser.add_subparsers(dest="shards_action", metavar="ACTION", required=True)
    made = []
    for name, helptext, description in (
        ("show", "list the shards, where they live and what they hold", _SHOW_HELP),
        ("place", "give the model N shards on distinct masters", _PLACE_HELP),
        ("retire", "retire one shard once it is drained", _RETIRE_HELP),
    ):
        sub = actions.add_parser(
            name, help=helptext, description=description, formatter_class=formatter
        )
        sub.add_argument("--model", required=True, type=argtypes.model_name, help="model name")
        sub.add_argument("--json", action="store_true", help="print JSON instead of text")
        sub.set_defaults(handler=run_command)
        made.append(sub)
    place_cmd, retire_cmd = made[1], made[2]
    place_cmd.add_argument(
        "--count",
        required=True,
        type=argtypes.positive_int,
        metavar="N",
        help="how many shards the model should have, its own first",
    )
    retire_cmd.add_argument(
        "--shard", required=True, type=_shard_arg, metavar="TAG", help="the shard, MODEL~K"
    )
    retire_cmd.add_argument(
        "--wait",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wait until the shard is drained, then drop it from the retiring set (default)",
    )
    retire_cmd.add_argument(
        "--timeout-s",
        type=argtypes.positive_float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"how long to wait for the drain (default: {DEFAULT_TIMEOUT_S:g})",
    )
    if connection_options is not None:
        connection_options(parser)
        for sub in made:
            connection_options(sub)


def run_command(args: argparse.Namespace) -> int:
    """``redbatch shards ACTION``: 0 when done, 1 when ``retire`` timed out waiting."""
    conn = open_redis(args)
    access = ShardAccess(conn, args.retry_s)
    try:
        access.refresh()
        if args.shards_action == "show":
            view = show(access, args.prefix, args.model)
            print(
                json.dumps(view_to_json(view), indent=2)
                if args.json
                else format_view(view, redact_url(args.redis_url))
            )
            return EXIT_OK
        if args.shards_action == "place":
            placed = place(access, args.prefix, args.model, args.count)
            print(
                json.dumps(placement_to_json(placed), indent=2)
                if args.json
                else format_placement(placed)
            )
            return EXIT_OK
        return _run_retire(access, args)
    finally:
        access.close()
        conn.close()


def _run_retire(access: ShardAccess, args: argparse.Namespace) -> int:
    check_retirable(args.model, args.shard)
    stream = sys.stderr if args.json else sys.stdout

    def say(text: str) -> None:
        print(printable(text), file=stream, flush=True)

    done = retire(
        access,
        args.prefix,
        args.model,
        args.shard,
        wait=args.wait,
        timeout_s=args.timeout_s,
        progress=_Progress(say, args.model) if args.wait else None,
    )
    if args.json:
        print(json.dumps(retirement_to_json(done), indent=2))
    else:
        print(format_retirement(done))
    return EXIT_FAILED if done.timed_out else EXIT_OK
