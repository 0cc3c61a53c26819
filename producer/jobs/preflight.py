"""``redbatch run``'s first contact with Redis: quick, and refusing a model nobody serves.

Before anything is sent, a run makes a first contact of a few seconds
(``producer.redisio.firstcontact``, as the operator commands do): an unreachable Redis at the
start is a wrong URL or a stopped server far more often than an outage, and is said in seconds,
naming the (redacted) URL. Then it reads the model's live worker records (what its checks
compare the input with); from there on it rides out outages of up to ``--retry-s`` as before.

A model with no live worker is refused (``require_worker``: a ``UsageError``), naming the models
that have workers (``producer.cli.reach.live_models``, when this user may ``SCAN``), unless
``--wait-for-worker`` says the
requests are to wait in the stream for a worker still to come. The run asks once the input is
open (or when it needs an input name only a worker can give), so that a mistake in the input
itself is said first, whatever the model.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import redis

from producer.protocol.errors import UsageError
from producer.redisio.connection import redact_url
from producer.redisio.firstcontact import contact_window, first_contact

__all__ = ["live_records", "require_worker"]


def live_records(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The live workers' validation records for ``args.model``, after a first contact of a few
    seconds (``RedisUnavailable`` when nothing answers, naming the URL; nothing was sent)."""
    from producer.client.blocking import Client

    window = contact_window(args.retry_s, bool(getattr(args, "retry_s_given", False)))
    probe = redis.Redis.from_url(args.redis_url, socket_connect_timeout=5, socket_timeout=10)
    try:
        first_contact(probe, args.redis_url, window)
    finally:
        probe.close()
    with Client(args.model, args.redis_url, prefix=args.prefix, retry_s=args.retry_s) as client:
        return [r for r in client.workers() if isinstance(r, dict)]


def require_worker(
    args: argparse.Namespace, records: list[dict[str, Any]], others: Callable[[], str]
) -> None:
    """UsageError when the model has no live worker (``records`` empty) and
    ``args.wait_for_worker`` is not set; ``others()`` says which models have one."""
    if records or args.wait_for_worker:
        return
    raise UsageError(
        f"model {args.model!r} has no live worker under prefix {args.prefix!r} at "
        f"{redact_url(args.redis_url)}; {others()}. Check --model (and --prefix), start "
        "a worker, or pass --wait-for-worker to queue the requests until one starts."
    )
