"""``redbatch reload``: have one worker read its config again, as SIGHUP does, by its name.

A worker may run on any host, so the ask goes through Redis: ``SET P:{M}:reload:NAME TOKEN EX
120``, which the worker takes with ``GETDEL`` within a second or so and answers in its record
(``reload``: the asks it answers, when, what changed, what failed). The command waits for that
answer and prints it. Exit 0: applied; 1: the worker answered that something did not load
(the old version serves on) or no live worker has that name; 2: no answer within ``--wait-s``
(a worker older than this command, or one whose ACL user may not take the key).
"""

from __future__ import annotations

import argparse
import json
import secrets
import time
from collections.abc import Callable
from typing import Any

from producer.cli import argtypes
from producer.cli.reach import open_redis
from producer.ops.workerview import gather_worker
from producer.protocol.keys import reload_key, worker_key
from producer.redisio.topology import Topology

__all__ = ["HELP", "add_arguments", "run_command"]

HELP = """\
Have a worker read its config file again, as SIGHUP does: models added to it are served, models
removed are drained and dropped, and a model whose file or settings changed is loaded and warmed
beside the old version, then swapped in without losing a request. The worker says what it did in
its record; this command waits for that and prints it.

examples:
  redbatch reload --model demo gpu-box-1-4242-a1b2c3
  redbatch reload --model demo gpu-box-1-4242-a1b2c3 --json
"""

_ASK_TTL_S = 120  # an ask no worker took (a worker gone) expires
_POLL_S = 0.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("worker", type=argtypes.worker_name, help="the worker's name")
    parser.add_argument(
        "--model",
        required=True,
        type=argtypes.model_name,
        help="a model the worker serves (its record names the worker)",
    )
    parser.add_argument(
        "--wait-s",
        type=argtypes.positive_float,
        default=60.0,
        metavar="S",
        help="how long to wait for the worker's answer (default 60; loading a large model "
        "takes a while)",
    )
    parser.add_argument("--json", action="store_true", help="print the worker's answer as JSON")


def run_command(args: argparse.Namespace) -> int:
    conn = open_redis(args)
    topology = Topology(conn)
    try:
        client = topology.client(args.model)
        record_key = worker_key(args.prefix, args.model, args.worker)
        if client.get(record_key) is None:
            print(
                f"error: no live worker named {args.worker!r} serves model {args.model!r} "
                f"(see redbatch status --model {args.model})"
            )
            return 1
        token = secrets.token_hex(8)
        client.set(reload_key(args.prefix, args.model, args.worker), token, ex=_ASK_TTL_S)
        answer = _answer(
            client,
            record_key,
            token,
            args.wait_s,
            lambda: gather_worker(conn, args.prefix, args.worker),
        )
    finally:
        topology.close()
        conn.close()
    if answer is None:
        print(
            f"error: worker {args.worker!r} did not answer within {args.wait_s:g} s: it may be "
            "older than this command, or its ACL user may not GETDEL its reload key "
            "(docs/security.md); SIGHUP to the process does the same"
        )
        return 2
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        _print(args.worker, answer)
    return 1 if answer.get("errors") else 0


def _answer(
    client: Any, record_key: str, token: str, wait_s: float, others: Callable[[], list[Any]]
) -> dict[str, Any] | None:
    """The worker's ``reload`` answer to ``token``, once its record holds it; when the record
    is gone (the reload removed this model, or the worker stopped), from the worker's records
    of its other models (``others``)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        raw = client.get(record_key)
        records = [json.loads(raw)] if raw is not None else others()
        for record in records:
            reload = record.get("reload") or {}
            if token in (reload.get("tokens") or []):
                return dict(reload)
        time.sleep(_POLL_S)
    return None


def _print(worker: str, answer: dict[str, Any]) -> None:
    changes = answer.get("changes") or {}
    done = [f"{what} {', '.join(names)}" for what, names in changes.items() if names] or [
        "nothing changed"
    ]
    print(f"{worker} read its config again: {'; '.join(done)}")
    for error in answer.get("errors") or []:
        print(f"  not applied: {error}")
    for change in answer.get("restart") or []:
        print(f"  {change} changed: that takes effect when the worker restarts")
