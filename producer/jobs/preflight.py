"""``redbatch run``'s first contact with Redis: quick, and refusing a model nobody serves.

Before anything is sent, a run reads the model's live worker records (what its checks compare
the input with) through a client that retries for ``START_RETRY_S`` at most rather than the
run's ``--retry-s``: an unreachable Redis at the start is a wrong URL or a stopped server far
more often than an outage, and is said in seconds, naming the (redacted) URL. Once the run has
started, its own client rides out outages of up to ``--retry-s`` as before.

A model with no live worker is refused (``require_worker``: a ``UsageError``), naming the models
that have workers (``producer.jobs.liveworkers``), unless ``--wait-for-worker`` says the
requests are to wait in the stream for a worker still to come. The run asks once the input is
open (or when it needs an input name only a worker can give), so that a mistake in the input
itself is said first, whatever the model.
"""

from __future__ import annotations

import argparse
from typing import Any

from producer.jobs.liveworkers import live_models
from producer.protocol.errors import ConnectionFailed, Misconfigured, RedisUnavailable, UsageError
from producer.redisio.connection import redact_url
from producer.redisio.retry import describe_redis_error, is_transient

__all__ = ["START_RETRY_S", "live_records", "require_worker"]

#: How long a run's first contact keeps trying an unreachable Redis (or --retry-s if shorter).
START_RETRY_S = 3.0


def live_records(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The live workers' validation records for ``args.model``; RedisUnavailable within
    ``START_RETRY_S`` when Redis does not answer."""
    from producer.client.blocking import Client

    retry_s = min(args.retry_s, START_RETRY_S)
    where = redact_url(args.redis_url)
    try:
        with Client(args.model, args.redis_url, prefix=args.prefix, retry_s=retry_s) as probe:
            records = [r for r in probe.workers() if isinstance(r, dict)]
    except ConnectionFailed as exc:
        cause = exc.__cause__
        if isinstance(exc, Misconfigured) or cause is None or not is_transient(cause):
            raise  # a wrong password or TLS setting, a refused command: said as it is
        detail = describe_redis_error(cause)
        tried = f"tried for {retry_s:g} s" if retry_s else "not retried"
        raise RedisUnavailable(
            f"cannot reach Redis at {where} ({tried}; nothing was sent): {detail}. Check that "
            "Redis is running there and that --redis-url (or $REDIS_URL) is right."
        ) from exc
    return records


def require_worker(args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    """UsageError when the model has no live worker (``records`` empty) and
    ``args.wait_for_worker`` is not set, naming the models that have one."""
    if records or args.wait_for_worker:
        return
    others = live_models(args.redis_url, args.prefix)
    raise UsageError(
        f"model {args.model!r} has no live worker under prefix {args.prefix!r} at "
        f"{redact_url(args.redis_url)}; models with live workers: {others.describe()}. Check "
        "--model (and --prefix), start a worker, or pass --wait-for-worker to queue the "
        "requests until one starts."
    )
