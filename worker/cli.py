"""``redbatch-worker`` / ``python -m worker``: start a worker from a TOML config."""

from __future__ import annotations

import argparse
import errno
import gc
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import redis

from producer.ops.textformat import tensor_spec
from producer.protocol.errors import Misconfigured
from producer.protocol.keys import is_valid_name
from producer.redisio.connection import redact_url
from worker.config import (
    URL_FROM_CONFIG,
    URL_FROM_DEFAULT,
    URL_FROM_ENV,
    RedisConfig,
    WorkerConfig,
    sections,
)
from worker.config.keys import describe
from worker.config.served import load_served
from worker.errors import WorkerError
from worker.fleet.fleet import Fleet
from worker.fleet.watch import ConfigWatch
from worker.ops.faults import FaultPoints
from worker.ops.logs import configure_logging
from worker.ops.metrics import MetricsServer

__all__ = ["main"]

log = logging.getLogger(__name__)

_EPILOG = """\
examples:
  redbatch-worker --config configs/demo.toml
  REDIS_URL=rediss://user:pass@redis:6380/0 redbatch-worker --config prod.toml --log-format json
  redbatch-worker --config configs/demo.toml --check        # load, validate, warm up; no Redis
  redbatch-worker --config configs/demo.toml --burst        # drain the stream, then exit

The config file is TOML; configs/reference.toml documents every key, and --help-config lists
them with their defaults and bounds. REDIS_URL in the environment overrides redis.url; the
worker logs, once at start, the URL it serves (password hidden) and where that came from.
SIGTERM or SIGINT stops reading, answers every request already read and exits 0. SIGHUP (or
`redbatch reload --model M NAME`) reads the config again: models added or removed, and a changed
model's new version loaded beside the old and swapped in without losing a request. When Redis
refuses or cannot be reached, it waits 3 s for a step forward (a second signal: none), then
exits 0 with a WARNING naming the requests it left pending, for another worker to claim.
Exit status 2: a wrong config, or a misconfigured connection (TLS to a plain port or the
reverse, a certificate that does not verify, a wrong password); 1: a failure while serving.
"""


def _version() -> str:
    """redbatch's installed version, from the package metadata (``unknown`` in a checkout)."""
    try:
        return metadata.version("redbatch")
    except metadata.PackageNotFoundError:
        return "unknown"


def _default_name() -> str:
    """HOST-PID-RANDOM: containers on one host's network share its name, and each one's
    worker may be PID 1, so the random part keeps two live workers from one name."""
    host = "".join(c if c.isalnum() or c in "_.-" else "-" for c in socket.gethostname())
    return f"{host[:100] or 'worker'}-{os.getpid()}-{secrets.token_hex(3)}"


class _HelpConfig(argparse.Action):
    """``--help-config``: print every config key, from its declaration, and exit like --help."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(describe(sections()), end="")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="redbatch-worker",
        description="Serve an ONNX model from a Redis stream with dynamic batching.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"redbatch-worker {_version()}")
    parser.add_argument("--config", required=True, help="path to the worker's TOML config file")
    parser.add_argument(
        "--help-config",
        action=_HelpConfig,
        help="print every config key with its default, bounds and meaning, as TOML, and exit",
    )
    parser.add_argument(
        "--name",
        default=None,
        help="consumer name in the group, unique among live workers (default: HOST-PID-RANDOM); "
        "[A-Za-z0-9_.:-], at most 128",
    )
    parser.add_argument(
        "--log-format", choices=("plain", "json"), default="plain", help="log line format"
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="lowest level logged (default INFO)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="load the config and model, warm up, print the validation record and exit 0; "
        "never touches Redis",
    )
    parser.add_argument(
        "--burst",
        action="store_true",
        help="exit 0 once the stream is drained (batch jobs, tests) instead of waiting for more: "
        "a read finds nothing new and nothing is pending on any consumer (entries a stopped "
        "worker left pending are claimed once idle past delivery.claim_idle_ms; a live "
        "worker's are waited for)",
    )
    return parser


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _StoppedStarting(BaseException):
    """SIGTERM or SIGINT before the worker serves: nothing was read, so it just exits."""


def _stop_while_starting(signum: int, _frame: object) -> None:
    raise _StoppedStarting(signal.Signals(signum).name)


def _reload_while_starting(_signum: int, _frame: object) -> None:
    log.warning("SIGHUP while starting: the config is read once the worker serves; send it again")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    # Until the worker installs its own (drain, then exit 0), a signal during config, model
    # load or warm-up ends start-up cleanly: exit 0 with a line, as the docs promise.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _stop_while_starting) for sig in _STOP_SIGNALS}
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, _reload_while_starting)
    try:
        return _main(args)
    except _StoppedStarting as stop:
        log.info("stopped by %s while starting; nothing was read from Redis", stop)
        return 0
    finally:  # for in-process callers (tests): their own handlers again
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _main(args: argparse.Namespace) -> int:
    name = args.name or _default_name()
    if not is_valid_name(name):
        log.error("--name %r must match [A-Za-z0-9_.:-]{1,128}", name)
        return 2
    try:
        served = load_served(args.config)
    except WorkerError as exc:
        log.error("%s", exc)
        return 2
    try:  # the fault-injection suite's variables, read here at the edge (worker/ops/faults.py)
        faults = FaultPoints.from_env(os.environ)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    watch_s = served.worker.watch_config_s
    fleet = Fleet(
        served,
        name,
        burst=args.burst,
        faults=faults,
        read_config=lambda: load_served(args.config),
        watch=ConfigWatch(Path(args.config), watch_s) if watch_s > 0 else None,
    )
    config = served.models[0]  # the worker-wide tables are the same in every model's
    server = None
    if config.metrics.port and not args.check:
        # Up before warmup, so /healthz answers and /readyz says "not ready" while warming.
        try:
            server = MetricsServer(
                fleet.metrics,  # type: ignore[arg-type]  # a registry is all it serves
                fleet.ready,
                config.metrics.port,
                problem=fleet.health_problem,
                host=config.metrics.host,
            )
        except OSError as exc:
            hint = (
                "; is another worker on this host using the port? Give each worker its own "
                "port, or 0 to turn the endpoint off"
                if exc.errno == errno.EADDRINUSE
                else ""
            )
            log.error(
                "[metrics] %s:%d cannot be opened (%s)%s",
                config.metrics.host,
                config.metrics.port,
                exc.strerror or exc,
                hint,
            )
            return 2
        server.start()
    try:
        return _serve(args, config, fleet)
    finally:
        if server is not None:
            server.close()


def _serve(args: argparse.Namespace, config: WorkerConfig, fleet: Fleet) -> int:
    if not args.check:  # --check never touches Redis
        _log_redis_url(config.redis)

    def loading(model: WorkerConfig) -> None:
        fields = {"worker": fleet.name, "model": model.model.name, "path": str(model.model.path)}
        log.info("loading the model", extra={"fields": fields})

    try:
        prepared = fleet.prepare(loading)
    except WorkerError as exc:
        log.error("%s", exc)
        return 2
    for each in prepared:
        log.info("validation record", extra={"fields": _record_summary(each.record)})
    if args.check:
        records = [each.record for each in prepared]
        print(json.dumps(records[0] if len(records) == 1 else records, indent=2))
        return 0
    # A read timeout well above the longest blocking read (block_ms, 0.5 s): a master whose host
    # vanished without a reset (a partition) is noticed, and the cluster followed, in 30 s.
    client = redis.Redis.from_url(
        config.redis.url,
        socket_connect_timeout=5,
        socket_timeout=30,
        socket_keepalive=True,
        health_check_interval=30,
    )
    fleet.abandon = _exit_abandoning
    for sig in _STOP_SIGNALS:
        signal.signal(sig, lambda *_: fleet.request_stop())
    signal.signal(signal.SIGHUP, lambda *_: fleet.request_reload())
    log.info("froze %d start-up objects out of the garbage collector", _freeze_start_up())
    try:
        fleet.run(client)
    except Misconfigured as exc:
        log.error("%s", exc)
        return 2
    except WorkerError as exc:
        log.error("%s", exc)
        return 1
    except redis.RedisError as exc:
        log.error("Redis at %s failed: %s", redact_url(config.redis.url), exc)
        return 1
    finally:
        fleet.close()
        client.close()
    return 0


def _exit_abandoning() -> None:
    """A stop that gave up on Redis still waits on a call its cut did not reach: exit now, as
    a SIGKILL would, but 0 and saying so (what it held stays pending, for another worker)."""
    log.warning("a thread still waits on Redis after the stop gave up on it; exiting now")
    logging.shutdown()
    os._exit(0)


def _freeze_start_up() -> int:
    """Move what start-up left alive (modules, the session's wrappers) out of the cyclic
    collector's view, after collecting the garbage among it; returns how many.

    A full collection walks every tracked object with the GIL held, stalling reading, batching
    and the writer alike; with start-up's objects frozen it walks a small fraction of them
    (docs/design.md). Done here, once per worker process, not in ``Worker.run``: a process that
    runs workers in-process would freeze its own objects.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _record_summary(record: dict[str, Any]) -> dict[str, Any]:
    """What is served, in one log line: model, runtime, input ranges, batching, limits and
    delivery, so that the log alone says what a worker enforced after it is gone (its
    registry record expires with it); --check prints the record whole."""
    model = record["model"]
    runtime = record["runtime"]
    return {
        "worker": record["name"],
        "model": f"{model['name']}@{model['version']}",
        "sha256": model["sha256"],
        "opset": model["opset"],
        "onnxruntime": runtime["onnxruntime"],
        "providers": runtime["providers"],
        "binding": runtime["binding"],
        "inputs": [tensor_spec(i, ranged=True) for i in record["inputs"]],
        "outputs": [tensor_spec(o, ranged=False) for o in record["outputs"]],
        "batching": record["batching"],
        "limits": record["limits"],
        "delivery": record["delivery"],
        "warmup_ms": record["warmup"]["total_ms"],
    }


def _log_redis_url(redis_config: RedisConfig) -> None:
    """Say once which Redis the worker serves and why that one: REDIS_URL set in a shell and
    forgotten, or a config's redis.url it overrides, is otherwise invisible."""
    source = {
        URL_FROM_ENV: "REDIS_URL in the environment",
        URL_FROM_CONFIG: "redis.url in the config",
        URL_FROM_DEFAULT: "the default (neither REDIS_URL nor redis.url is set)",
    }[redis_config.url_from]
    if redis_config.url_overrode:
        source += ", which overrides the config's redis.url"
    url = redact_url(redis_config.url)
    log.info(
        "Redis at %s, from %s",
        url,
        source,
        extra={"fields": {"redis": url, "redis_url_from": redis_config.url_from}},
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
