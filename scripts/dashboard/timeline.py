"""The run's timeline: the load for ``--duration-s`` seconds and the events at fixed fractions of
it (cancelled requests, a burst, a worker killed, dead letters, a Redis restart, a worker
restarted), each run on the main thread."""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import redis

from producer.protocol.keys import CONSUMER_GROUP, request_stream
from tools.localredis import LocalRedis

from .common import MODEL, PREFIX, progress
from .load import Load
from .stack import WorkerProc


@dataclass
class Event:
    at: float  # fraction of the duration
    label: str
    action: Callable[[], None]
    wall: float | None = None


@dataclass
class RunResult:
    start: float
    end: float
    events: list[Event]
    codes: Counter[str]
    client_errors: Counter[str]
    consumers: dict[str, int]  # the group's consumers at the end, with their pending counts


def group_state(url: str) -> tuple[int, dict[str, int]]:
    """XLEN of the request stream and the group's consumers with their pending entries."""
    raw = redis.Redis.from_url(url)
    try:
        stream = request_stream(PREFIX, MODEL)
        consumers = {}
        for c in raw.xinfo_consumers(stream, CONSUMER_GROUP):
            name = c["name"]
            consumers[name.decode() if isinstance(name, bytes) else str(name)] = int(c["pending"])
        return int(raw.xlen(stream)), consumers
    finally:
        raw.close()


def scheduled_events(
    args: argparse.Namespace, load: Load, server: LocalRedis, workers: list[WorkerProc]
) -> list[Event]:
    """The run's events, at fractions of the duration; each runs on the main thread."""
    w1, w2 = workers

    def restart_redis() -> None:
        server.restart()
        progress(f"redis-server restarted on port {server.port} (AOF kept the data)")

    def restart_worker() -> None:
        status = w2.stop()
        progress(f"{w2.name} stopped by SIGTERM, exit status {status}; starting it again in 6s")
        time.sleep(6)
        w2.start()
        progress(f"{w2.name} ready again")

    def kill_worker() -> None:
        """SIGKILL w1 while the burst keeps it busy, then start it again under a new name: the
        entries it held stay pending on the old name until a worker reclaims them (after
        claim_idle_ms), and the old name is removed once idle and empty (2 x claim_idle_ms)."""
        old, new = w1.name, f"{w1.name}b"
        status = w1.kill()
        backlog, consumers = group_state(server.url)
        held = consumers.get(old, 0)
        kill.label = f"{old} SIGKILL holding {held} entries, back as {new}"
        progress(
            f"{old} killed by SIGKILL (status {status}) holding {held} entries, backlog "
            f"{backlog}; starting it again as {new}"
        )
        time.sleep(1)
        w1.name = new
        w1.start()
        progress(f"{new} ready on {w1.instance}")

    kill = Event(0.26, f"{w1.name} SIGKILL + restart as {w1.name}b", kill_worker)
    return [
        Event(0.10, "2 cancelled requests", load.cancelled),
        Event(0.22, f"burst of {args.burst}", lambda: load.spawn(load.burst, "burst")),
        kill,
        Event(0.40, "dead letter", lambda: load.dead_letter(1)),
        Event(0.50, "Redis restart", restart_redis),
        Event(0.62, "w2 SIGTERM + restart", restart_worker),
        Event(0.82, "dead letter", lambda: load.dead_letter(2)),
    ]


def drive(args: argparse.Namespace, server: LocalRedis, workers: list[WorkerProc]) -> RunResult:
    duration = args.duration_s
    load = Load(server.url, duration, args.burst)
    load.prepare_burst()
    events = scheduled_events(args, load, server, workers)
    wall_start = time.time()
    load.started = time.monotonic()
    progress(f"load for {duration:.0f}s: steady closed loop + ~4 invalid requests/s")
    load.spawn(load.steady, "steady")
    load.spawn(load.invalid, "invalid")
    for ev in events:
        wait_s = ev.at * duration - load.elapsed()
        if wait_s > 0:
            time.sleep(wait_s)
        ev.wall = time.time()
        progress(f"event at {load.elapsed():.0f}s: {ev.label}")
        ev.action()
    last = 0.0
    while (left := duration - load.elapsed()) > 0:
        time.sleep(min(left, 10.0))
        if load.elapsed() - last >= 20:
            last = load.elapsed()
            with load._lock:
                seen = dict(load.codes)
            progress(f"{load.elapsed():.0f}s: outcomes so far {seen}")
    wall_end = time.time()
    progress("stopping the load")
    load.join()
    progress(f"outcomes seen by the callers: {dict(load.codes)}")
    if load.client_errors:
        progress(f"client-side errors (the Redis restart): {dict(load.client_errors)}")
    backlog, consumers = group_state(server.url)
    progress(f"at the end: backlog {backlog}, group consumers (pending) {consumers}")
    return RunResult(wall_start, wall_end, events, load.codes, load.client_errors, consumers)
