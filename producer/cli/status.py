"""``redbatch status`` and its ``--watch`` view as commands: the options, the one-shot report,
the list of every model when no ``--model`` is given (``producer.ops.models``), and the loop that
redraws ``producer.ops.watch.render`` until Ctrl-C or ``--iterations``.

The view is plain ANSI (clear screen, redraw) on a terminal and plain frames otherwise.
Ctrl-C ends it with exit status 0; ``--iterations`` ends it after that many frames. Each command
gives up within a few seconds on a Redis that never answered (``producer.cli.reach``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import TextIO
from urllib.parse import urlsplit

import redis

from producer.cli import argtypes
from producer.cli.argtypes import EXIT_FAILED, EXIT_OK
from producer.cli.reach import open_redis
from producer.ops import models, nomodel, status, workerview
from producer.ops import report as status_report
from producer.ops.status import DEFAULT_DEAD_LIMIT
from producer.ops.watch import DEFAULT_INTERVAL_S, render
from producer.ops.watchstats import Snapshot, StageWatch, WorkerRates, take_snapshot
from producer.protocol.errors import ConnectionFailed, UsageError
from producer.redisio.connection import redact_url
from producer.redisio.topology import Topology

__all__ = [
    "DEFAULT_DEAD_LIMIT",
    "add_watch_arguments",
    "run_overview",
    "run_status",
    "run_watch",
    "watch_only_options",
]

_CLEAR = "\x1b[H\x1b[2J"  # cursor home, erase screen


def _metrics_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an http:// URL of a worker's /metrics, "
            "such as http://127.0.0.1:9100/metrics"
        )
    return text


def add_watch_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--watch`` options of ``redbatch status`` (``producer.cli.main`` registers them)."""
    add = parser.add_argument
    add("--watch", action="store_true", help="redraw a live view until Ctrl-C")
    add(
        "--interval-s",
        type=argtypes.positive_float,
        default=None,
        metavar="S",
        help=f"with --watch: seconds between refreshes (default: {DEFAULT_INTERVAL_S:g})",
    )
    add(
        "--iterations",
        type=argtypes.positive_int,
        metavar="N",
        help="with --watch: stop after N refreshes (default: until Ctrl-C)",
    )
    add(
        "--metrics-url",
        type=_metrics_url,
        action="append",
        default=[],
        metavar="URL",
        help="with --watch: a worker's /metrics, for latency percentiles and batch rows "
        "(repeat for each worker)",
    )


def watch_only_options(args: argparse.Namespace) -> list[str]:
    """The --watch options given without --watch (a usage error: they would do nothing)."""
    given = {
        "--interval-s": args.interval_s is not None,
        "--iterations": args.iterations is not None,
        "--metrics-url": bool(args.metrics_url),
    }
    return [] if args.watch else [flag for flag, on in given.items() if on]


def _refresh(
    conn: redis.Redis, topology: Topology, args: argparse.Namespace, *, first: bool
) -> Snapshot:
    """One snapshot. The first rides out an outage for ``--retry-s``, as ``redbatch status``
    does, since there is no view to show yet; a later one tries once, so an outage shows at once
    over the last view, and the next refresh is the retry. The slot map is read on the first,
    and again on each on a cluster (a failover or a migration moves shards)."""
    retry_s = getattr(args, "retry_s", 0.0) if first else 0.0
    if first or topology.cluster:
        # Unreachable: the snapshot below meets the same outage, retries it and reports it.
        with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
            topology.refresh()
    return take_snapshot(
        conn, args.model, args.prefix, args.metrics_url, retry_s=retry_s, topology=topology
    )


def run_watch(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``redbatch status --watch``: redraw until Ctrl-C or ``--iterations``; returns 0."""
    if getattr(args, "json", False):
        raise UsageError("--watch draws a live view; leave out --json (or drop --watch).")
    if getattr(args, "model", None) is None:
        raise UsageError(
            "--watch shows one model live: name it with --model NAME (redbatch status without "
            "--model lists the models)."
        )
    if args.metrics_url:
        argtypes.require_cli_extra("prometheus_client", "--metrics-url")
    stream = sys.stdout if out is None else out
    where = redact_url(args.redis_url)
    clear = stream.isatty()
    conn = open_redis(args)
    topology = Topology(conn)
    rates = WorkerRates()
    stage_rates = StageWatch()
    before: Snapshot | None = None
    frames = 0
    try:
        while args.iterations is None or frames < args.iterations:
            if frames:
                time.sleep(args.interval_s or DEFAULT_INTERVAL_S)
            problem = None
            try:
                now = _refresh(conn, topology, args, first=before is None)
            except ConnectionFailed as exc:
                if before is None:
                    raise  # it names the Redis and the retrying done, as `redbatch status` does
                problem = f"Redis unreachable ({exc}); showing the last view, retrying"
                now = before
            else:
                rates.update(now.status.workers)
                stage_rates.update(now.status.workers)
            frame = render(
                None if problem else before,
                now,
                rates=rates,
                redis_url=where,
                interval_s=args.interval_s or DEFAULT_INTERVAL_S,
                problem=problem,
                stage_rates=stage_rates,
            )
            stream.write((_CLEAR if clear else ("\n" if frames else "")) + frame + "\n")
            stream.flush()
            before = now
            frames += 1
    except KeyboardInterrupt:
        stream.write("\n")
        stream.flush()
    finally:
        topology.close()
        conn.close()
    return 0


def run_status(args: argparse.Namespace) -> int:
    """``redbatch status``: one report of the queue, the live view with ``--watch``, or every
    model's line without ``--model``. Exits 1 when a stream is blocked now (an exhausted id
    space, a key of the wrong type), and when the model leaves no key in this Redis (then the
    text says so and names the models there; ``--json`` prints the empty report and says so on
    stderr)."""
    stray = watch_only_options(args)
    if stray:
        raise UsageError(f"{' and '.join(stray)} go with --watch; add --watch or leave them out.")
    if getattr(args, "worker", None) is not None:
        if args.watch or args.model is not None:
            raise UsageError("--worker shows one worker's models; leave out --model and --watch.")
        return run_worker(args)
    if args.watch:
        return run_watch(args)
    if getattr(args, "model", None) is None:
        return run_overview(args)
    where = redact_url(args.redis_url)
    conn = open_redis(args)
    try:  # a ConnectionFailed names the Redis and the retrying done; main() prints it as it is
        report = status.gather_status(
            conn, args.model, args.prefix, dead_limit=args.dead_letters, retry_s=args.retry_s
        )
        unknown = nomodel.is_unknown(report)
        found = models.find_live_models(conn, args.prefix) if unknown else None
    finally:
        conn.close()
    if args.json:
        print(json.dumps(status_report.status_to_json(report), indent=2, default=str))
        if unknown:
            print("redbatch: " + nomodel.format_unknown(report, found, where), file=sys.stderr)
    elif unknown:
        print(nomodel.format_unknown(report, found, where))
    else:
        print(status_report.format_status(report, redis_url=where))
    blocked = any(note.blocking for note in report.damage)
    return EXIT_FAILED if blocked or unknown else EXIT_OK


def run_worker(args: argparse.Namespace) -> int:
    """``redbatch status --worker NAME``: the models one worker serves; exits 1 when no live
    worker has that name."""
    conn = open_redis(args)
    try:
        records = workerview.gather_worker(conn, args.prefix, args.worker, retry_s=args.retry_s)
    finally:
        conn.close()
    if args.json:
        print(json.dumps(workerview.worker_to_json(records), indent=2))
    else:
        print(workerview.format_worker(args.worker, args.prefix, records))
    return EXIT_OK if records else EXIT_FAILED


def run_overview(args: argparse.Namespace) -> int:
    """``redbatch status`` without ``--model``: a line per model the Redis holds; exits 1 when
    a model's stream is blocked now."""
    conn = open_redis(args)
    try:
        overview = models.gather_models(conn, args.prefix, retry_s=args.retry_s)
    finally:
        conn.close()
    if args.json:
        print(json.dumps(models.overview_to_json(overview), indent=2))
    else:
        print(models.format_overview(overview, redact_url(args.redis_url)))
    if args.json and not overview.complete:  # the text says so itself
        print(
            "redbatch: warning: the list may be incomplete (a scan reached its bound); name a "
            "model with --model",
            file=sys.stderr,
        )
    return EXIT_FAILED if any(m.blocked for m in overview.models) else EXIT_OK
