"""The ``redbatch`` command line: run arrays through a model's workers, and show queue status.

This module is argparse, the shared connection options and the dispatch; each command keeps its
options and its reports in a module of its own: ``producer.cli.run`` (``run``, whose job is
``producer.jobs.job``'s), ``producer.cli.status`` (``status`` and ``status --watch``),
``producer.cli.replay`` (``replay``), ``producer.cli.shards`` (``shards``) and
``producer.cli.reload`` (``reload``). Exit codes
(``producer.cli.argtypes``): 0 every row succeeded, 1 some rows failed, 2 the command could not
run as asked (bad option, missing file, Redis unreachable), 130 interrupted (Ctrl-C; ``run``
still writes the rows answered by then). ``status``, ``replay`` and ``shards`` give up within
3 s on a Redis that never answered (``producer.cli.reach``), unless ``--retry-s`` is given.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import redis

from producer.cli import argtypes
from producer.cli import reload as reloadcmd
from producer.cli import replay as replaycmd
from producer.cli import run as runcmd
from producer.cli import shards as shardcmd
from producer.cli import status as status_command
from producer.cli.argtypes import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    print_error,
)
from producer.jobs.job import one_line
from producer.protocol import keys
from producer.protocol.errors import ConnectionFailed, RedbatchError
from producer.redisio.connection import redact_url
from producer.redisio.retry import DEFAULT_RETRY_S

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "main",
]

DEFAULT_URL = "redis://127.0.0.1:6379/0"


# ---------------------------------------------------------------------------------------------
# Commands


# ---------------------------------------------------------------------------------------------
# Parser


_TOP_HELP = """\
Send inputs through redbatch ONNX workers over Redis streams, and inspect the models' queues.

examples:
  redbatch run --model demo --input x.npy --output y.npz
  redbatch run --model demo --input batch.npz --output y.npz --rows-per-request 8
  redbatch run --model orientation --input 'images/**/*.jpg' --output labels.parquet
  redbatch run --model minilm --input sentences.txt --output vectors.jsonl
  redbatch status
  redbatch status --model demo
  redbatch status --model demo --watch
  redbatch status --worker gpu-box-1-4242-a1b2c3
  REDIS_URL=redis://:secret@cache:6379/0 redbatch status --model demo --json
  redbatch replay --model demo --from-dead --new-ids --delete
  redbatch shards place --model demo --count 3
  redbatch reload --model demo gpu-box-1-4242-a1b2c3
"""

_STATUS_HELP = """\
Without --model: every model this Redis holds (found with SCAN, on every master of a cluster),
one line each: shards, backlog, pending, live workers, dead letters, the oldest entry's age.

With --model: that model's queue: the request stream's backlog, the consumer group (pending,
lag, last delivered id), what each consumer holds, the dead letters and their reasons, and every
live worker's validation record (model version and hash, providers, batching, inputs, runtime,
host, heartbeat, requests served). Workers whose record expired are removed from the registry.

Exit status 1 while a stream is blocked (an exhausted id space, a key of the wrong type), or
when --model names a model this Redis holds nothing of; 2 when Redis did not answer within 3 s
(--retry-s S waits longer) or refused a command.

examples:
  redbatch status
  redbatch status --json | jq '.[] | {model, backlog}'
  redbatch status --model demo
  redbatch status --model demo --json | jq .requests.backlog
"""


def _redis_url(text: str) -> str:
    if not text.startswith(("redis://", "rediss://", "unix://")):
        raise argparse.ArgumentTypeError(
            f"{redact_url(text)!r} is not a Redis URL (from --redis-url, else $REDIS_URL): use "
            "redis://[[user]:password@]host[:port][/db], rediss://... (TLS) or "
            "unix:///path/to/redis.sock[?db=N]"
        )
    try:
        redis.connection.parse_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{redact_url(text)!r}: {exc}") from None
    return text


def _add_connection_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    # The subcommands repeat these with SUPPRESS defaults, so they work before or after the
    # command name without the subcommand's default overwriting the top level's value.
    default_url = os.environ.get("REDIS_URL", DEFAULT_URL) if top else argparse.SUPPRESS
    parser.add_argument(
        "--redis-url",
        default=default_url,
        type=_redis_url,
        metavar="URL",
        help="Redis to use; default: $REDIS_URL, else " + DEFAULT_URL,
    )
    parser.add_argument(
        "--prefix",
        default=keys.DEFAULT_PREFIX if top else argparse.SUPPRESS,
        type=argtypes.prefix,
        help=f"key prefix the workers use (default: {keys.DEFAULT_PREFIX})",
    )
    parser.add_argument(
        "--retry-s",
        default=DEFAULT_RETRY_S if top else argparse.SUPPRESS,
        type=argtypes.non_negative_float,
        action=_GivenRetry,
        metavar="S",
        help="how long to keep retrying while Redis is unreachable, with backoff (default: "
        f"{DEFAULT_RETRY_S:g}; 0: fail at once; every command gives up after 3 s on a Redis "
        "it never reached unless this is given)",
    )
    if top:
        parser.set_defaults(retry_s_given=False)


class _GivenRetry(argparse.Action):
    """Stores ``--retry-s`` and notes that it was given (``retry_s_given``): a first contact
    waits that long only when asked to (``producer.cli.reach``)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.retry_s_given = True


def build_parser() -> argparse.ArgumentParser:
    """The ``redbatch`` argument parser."""
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="redbatch", description=_TOP_HELP, formatter_class=formatter
    )
    parser.add_argument(
        "--version", action="version", version=f"redbatch {argtypes.package_version()}"
    )
    _add_connection_options(parser, top=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = commands.add_parser(
        "run",
        help="run .npy/.npz arrays, files (a folder or glob), .txt lines, .jsonl or "
        ".parquet/.arrow rows through the model",
        description=runcmd.HELP,
        formatter_class=formatter,
    )
    runcmd.add_arguments(run)
    _add_connection_options(run, top=False)
    run.set_defaults(handler=runcmd.run_command)

    stat = commands.add_parser(
        "status",
        help="list the models, or show one model's queue, dead letters and workers",
        description=_STATUS_HELP,
        formatter_class=formatter,
    )
    stat.add_argument(
        "--model",
        type=argtypes.model_name,
        help="the model to show in full (default: list every model)",
    )
    stat.add_argument(
        "--worker",
        type=argtypes.worker_name,
        metavar="NAME",
        help="show every model worker NAME serves: version, session held or released, loads",
    )
    stat.add_argument("--json", action="store_true", help="print JSON instead of tables")
    stat.add_argument(
        "--dead-letters",
        type=argtypes.positive_int,
        default=status_command.DEFAULT_DEAD_LIMIT,
        metavar="N",
        help=f"how many recent dead letters to show (default: {status_command.DEFAULT_DEAD_LIMIT})",
    )
    status_command.add_watch_arguments(stat)
    _add_connection_options(stat, top=False)
    stat.set_defaults(handler=status_command.run_status)

    replay_cmd = commands.add_parser(
        "replay", help="re-send dead-lettered requests", formatter_class=formatter
    )
    replaycmd.add_arguments(replay_cmd)
    _add_connection_options(replay_cmd, top=False)
    replay_cmd.set_defaults(handler=replaycmd.run_command)

    shards_cmd = commands.add_parser(
        "shards",
        help="show, place and retire a model's shards",
        formatter_class=formatter,
    )
    shardcmd.add_arguments(shards_cmd, lambda p: _add_connection_options(p, top=False))

    reload_cmd = commands.add_parser(
        "reload",
        help="have a worker read its config again (new model versions without a restart)",
        description=reloadcmd.HELP,
        formatter_class=formatter,
    )
    reloadcmd.add_arguments(reload_cmd)
    _add_connection_options(reload_cmd, top=False)
    reload_cmd.set_defaults(handler=reloadcmd.run_command)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``redbatch`` command line; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        return int(args.handler(args))
    except (UsageError, ConnectionFailed) as exc:
        print_error(one_line(exc))
        return EXIT_USAGE
    except RedbatchError as exc:
        print_error(one_line(exc))
        return EXIT_FAILED
    except KeyboardInterrupt:
        print_error("interrupted")
        return EXIT_INTERRUPTED
