"""What ``redbatch status --watch`` measures: snapshots of a model's queue, and their maths.

``take_snapshot`` reads the status ``producer.ops.status`` gathers, the stream's and group's
counters
(``XINFO STREAM`` entries-added, ``XINFO GROUPS`` entries-read) of each shard, read from the
shard's own node, and, when asked, the workers' ``/metrics``. The functions below turn two
snapshots into numbers: requests in and out per second (counter deltas, so they cover every
worker, registered or not; per shard, and summed over the shards seen in both snapshots, so a
shard added or retired between them skews nothing), metrics summed over workers since the last
scrape, percentiles from the histogram buckets, Redis ``used_memory``'s change per second,
(``WorkerRates``) each live worker's requests per second from the ``served`` counters its
heartbeat publishes every 5 s, and (``StageWatch``) how busy each worker's pipeline threads and
model were between two of its records' ``stages`` (``producer.ops.stages``). ``producer.ops.watch``
draws them.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from producer.ops import stages, status
from producer.ops.status import epoch_s
from producer.protocol import keys
from producer.redisio.topology import Topology

__all__ = [
    "Counters",
    "SampleKey",
    "Scrape",
    "Snapshot",
    "StageWatch",
    "WorkerRates",
    "epoch_s",
    "flow_per_s",
    "format_seconds",
    "histogram_buckets",
    "memory_per_s",
    "metrics_window",
    "quantile",
    "sample_total",
    "shard_flow_per_s",
    "take_snapshot",
]

_SCRAPE_TIMEOUT_S = 2.0

SampleKey = tuple[str, tuple[tuple[str, str], ...]]

# ---------------------------------------------------------------------------------------------
# Snapshots


@dataclass(frozen=True, slots=True)
class Scrape:
    """One worker's /metrics: every sample by name and labels, or the error that stopped it."""

    url: str
    samples: Mapping[SampleKey, float] | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Counters:
    """One shard's stream counters: entries ever added, entries its group ever read (None where
    Redis cannot tell), and what the group holds now (None without a group)."""

    added: int | None
    read: int | None
    pending: int | None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The model's queue at one moment; ``taken_s`` is monotonic, for rates. ``entries_added``
    and ``entries_read`` are summed over the shards (None when a shard's is unknown);
    ``counters`` has each shard's own, by tag."""

    taken_s: float
    status: status.ModelStatus
    entries_added: int | None
    entries_read: int | None
    scrapes: tuple[Scrape, ...] = ()
    counters: Mapping[str, Counters] = field(default_factory=dict)
    # Each shard's other lanes' counters, by tag, then by lane stream key.
    lane_counters: Mapping[str, Mapping[str, Counters]] = field(default_factory=dict)


def take_snapshot(
    conn: redis.Redis,
    model: str,
    prefix: str = keys.DEFAULT_PREFIX,
    metrics_urls: Sequence[str] = (),
    *,
    retry_s: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
    topology: Topology | None = None,
) -> Snapshot:
    """Read the model's queue, counters and metrics, retrying through an outage for up to
    ``retry_s`` (as ``redbatch status`` does); raises ConnectionFailed when Redis fails. Pass a
    ``topology`` to reuse one slot map over many snapshots (the caller refreshes it)."""
    access = status.ShardAccess(conn, retry_s, topology)
    counters: dict[str, Counters] = {}
    lane_counters: dict[str, dict[str, Counters]] = {}
    try:
        if topology is None:
            access.refresh()
        report = status.gather_status(
            conn, model, prefix, dead_limit=1, retry_s=retry_s, topology=access.topology
        )
        for shard in report.shards:
            added = read = None
            if shard.requests.exists:
                added, read = access.on(shard.tag, _counters, shard.requests.key)
            group = shard.requests.group
            counters[shard.tag] = Counters(added, read, None if group is None else group.pending)
            lane_counters[shard.tag] = {
                ln.key: Counters(*access.on(shard.tag, _counters, ln.key), ln.pending)
                for ln in shard.lanes.lanes
                if ln.exists
            }
    finally:
        access.close()
    existing = [counters[s.tag] for s in report.shards if s.requests.exists]
    total_added = _sum_or_none([c.added for c in existing]) if existing else None
    total_read = _sum_or_none([c.read for c in existing]) if existing else None
    scrapes = tuple(_scrape(url) for url in metrics_urls)
    return Snapshot(clock(), report, total_added, total_read, scrapes, counters, lane_counters)


def _sum_or_none(values: Sequence[int | None]) -> int | None:
    return None if any(v is None for v in values) else sum(v or 0 for v in values)


def _counters(conn: redis.Redis, key: str) -> tuple[int | None, int | None]:
    """The stream's entries-added and its group's entries-read; None where Redis cannot tell."""
    pipe = conn.pipeline(transaction=False)
    pipe.xinfo_stream(key)
    pipe.xinfo_groups(key)
    stream_info, groups = pipe.execute(raise_on_error=False)
    added = read = None
    if isinstance(stream_info, dict):
        added = _int_or_none(stream_info.get("entries-added"))
    for group in groups if isinstance(groups, list) else []:
        if _text(group.get("name")) == keys.CONSUMER_GROUP:
            read = _int_or_none(group.get("entries-read"))
            if read is None and _text(group.get("last-delivered-id")) == "0-0":
                read = 0  # a group that has read nothing yet reports nil
    return added, read


def _scrape(url: str) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=_SCRAPE_TIMEOUT_S) as response:
            text = response.read().decode("utf-8", "replace")
        samples: dict[SampleKey, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                samples[key] = samples.get(key, 0.0) + float(s.value)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        return Scrape(url, None, " ".join(str(exc).split()) or type(exc).__name__)
    return Scrape(url, samples)


# ---------------------------------------------------------------------------------------------
# Per-worker rates from the registry


@dataclass(frozen=True, slots=True)
class _Served:
    heartbeat_s: float
    requests: int
    batches: int


class WorkerRates:
    """Requests/s and requests per batch of each live worker, from its registry record.

    A record's ``served`` counters change only with its heartbeat (every 5 s), so a rate is
    taken between two different heartbeats and kept until the next one.
    """

    def __init__(self) -> None:
        self._base: dict[str, _Served] = {}
        self.rates: dict[str, tuple[float, float | None]] = {}

    def update(self, workers: Iterable[status.WorkerInfo]) -> None:
        """Take in this refresh's live workers; forget the ones that are gone."""
        seen = set()
        for worker in workers:
            served = _served(worker)
            if served is None:
                continue
            seen.add(worker.name)
            base = self._base.get(worker.name)
            if base is None or served.requests < base.requests:
                self._base[worker.name] = served
            elif served.heartbeat_s > base.heartbeat_s:
                seconds = served.heartbeat_s - base.heartbeat_s
                batches = served.batches - base.batches
                self.rates[worker.name] = (
                    (served.requests - base.requests) / seconds,
                    (served.requests - base.requests) / batches if batches > 0 else None,
                )
                self._base[worker.name] = served
        for name in set(self._base) - seen:
            del self._base[name]
            self.rates.pop(name, None)


def _served(worker: status.WorkerInfo) -> _Served | None:
    requests, batches = worker.get("served", "requests"), worker.get("served", "batches")
    beat = epoch_s(worker.get("heartbeat_at"))
    if not isinstance(requests, int) or not isinstance(batches, int) or beat is None:
        return None
    return _Served(beat, requests, batches)


class StageWatch:
    """Each live worker's ``stages`` rates (``producer.ops.stages.StageRates``) between the two
    latest different samples of its record's running totals.

    The record changes only with its heartbeat, so a rate is taken between two heartbeats and
    kept until the next one; the interval is the samples' own ``uptime_s`` when they carry it,
    else their heartbeats'. A total that went down means the worker restarted under its name:
    that sample becomes the new base.
    """

    def __init__(self) -> None:
        self._base: dict[str, tuple[float, dict[str, Any]]] = {}
        self.rates: dict[str, stages.StageRates] = {}

    def update(self, workers: Iterable[status.WorkerInfo]) -> None:
        """Take in this refresh's live workers; forget the ones that are gone."""
        seen = set()
        for worker in workers:
            sample = worker.get("stages")
            at_s = _sampled_at(worker)
            if not isinstance(sample, dict) or at_s is None:
                continue
            seen.add(worker.name)
            base = self._base.get(worker.name)
            if base is None or stages.restarted(base[1], sample):
                self._base[worker.name] = (at_s, sample)
                self.rates.pop(worker.name, None)
            elif at_s > base[0]:
                self.rates[worker.name] = stages.rates(base[1], sample, at_s - base[0])
                self._base[worker.name] = (at_s, sample)
        for name in set(self._base) - seen:
            del self._base[name]
            self.rates.pop(name, None)


def _sampled_at(worker: status.WorkerInfo) -> float | None:
    """When the worker's ``stages`` were sampled: its ``uptime_s`` (monotonic, the worker's
    own) when it has one, else the record's heartbeat."""
    uptime = worker.get("stages", "uptime_s")
    if isinstance(uptime, int | float) and not isinstance(uptime, bool):
        return float(uptime)
    return epoch_s(worker.get("heartbeat_at"))


# ---------------------------------------------------------------------------------------------
# Maths on two snapshots


def flow_per_s(
    before: Snapshot | None, now: Snapshot
) -> tuple[float | None, float | None, float] | None:
    """Requests added and answered per second between two snapshots, summed over the shards
    both have counters for."""
    if before is None or now.taken_s <= before.taken_s:
        return None
    seconds = now.taken_s - before.taken_s
    if now.counters and before.counters:
        flows = [
            flow for tag in now.counters if (flow := shard_flow_per_s(before, now, tag)) is not None
        ]
        added_s = [f[0] for f in flows if f[0] is not None]
        finished_s = [f[1] for f in flows if f[1] is not None]
        return (sum(added_s) if added_s else None, sum(finished_s) if finished_s else None, seconds)
    added = None
    if now.entries_added is not None and before.entries_added is not None:
        added = max(now.entries_added - before.entries_added, 0) / seconds
    finished = None
    g_now, g_before = now.status.requests.group, before.status.requests.group
    if now.entries_read is not None and before.entries_read is not None and g_now and g_before:
        # Every entry read is either still pending or answered.
        answered = (now.entries_read - before.entries_read) - (g_now.pending - g_before.pending)
        finished = max(answered, 0) / seconds
    return added, finished, seconds


def shard_flow_per_s(
    before: Snapshot | None, now: Snapshot, tag: str
) -> tuple[float | None, float | None, float] | None:
    """One shard's requests added and answered per second over its lanes (a lane counts when
    both snapshots have its counters: one that came or went between them is left out); None
    when either snapshot lacks the shard's counters (a shard that came or went)."""
    if before is None or now.taken_s <= before.taken_s:
        return None
    then, current = before.counters.get(tag), now.counters.get(tag)
    if then is None or current is None:
        return None
    seconds = now.taken_s - before.taken_s
    pairs = [(then, current)]
    then_lanes = before.lane_counters.get(tag, {})
    for key, lane_now in now.lane_counters.get(tag, {}).items():
        if key in then_lanes:
            pairs.append((then_lanes[key], lane_now))
    deltas = [_delta(a, b) for a, b in pairs]
    added = [d[0] for d in deltas if d[0] is not None]
    finished = [d[1] for d in deltas if d[1] is not None]
    return (
        sum(added) / seconds if added else None,
        sum(finished) / seconds if finished else None,
        seconds,
    )


def _delta(then: Counters, current: Counters) -> tuple[int | None, int | None]:
    """One stream's entries added and answered between two readings (None: unknown)."""
    added = None
    if current.added is not None and then.added is not None:
        added = max(current.added - then.added, 0)
    finished = None
    if (
        current.read is not None
        and then.read is not None
        and current.pending is not None
        and then.pending is not None
    ):
        finished = max((current.read - then.read) - (current.pending - then.pending), 0)
    return added, finished


def memory_per_s(before: Snapshot | None, now: Snapshot) -> float | None:
    """Bytes per second ``used_memory`` grew (negative: shrank) between two snapshots; None
    when either could not read it."""
    if before is None or now.taken_s <= before.taken_s:
        return None
    then, current = before.status.memory, now.status.memory
    if then is None or current is None:
        return None
    return (current.used_bytes - then.used_bytes) / (now.taken_s - before.taken_s)


def metrics_window(before: Snapshot | None, now: Snapshot) -> tuple[str, dict[SampleKey, float]]:
    """Samples summed over workers: deltas since ``before`` when it has them, else totals."""
    earlier = {sc.url: sc.samples for sc in before.scrapes} if before else {}
    total: dict[SampleKey, float] = {}
    deltas = True
    for sc in now.scrapes:
        if sc.samples is None:
            continue
        old = earlier.get(sc.url)
        restarted = old is not None and any(
            v < old.get(k, 0.0) for k, v in sc.samples.items() if _only_grows(k)
        )
        if old is None or restarted:
            deltas = False
        for key, value in sc.samples.items():
            base = old.get(key, 0.0) if old is not None and not restarted else 0.0
            total[key] = total.get(key, 0.0) + value - base
    if before is not None and deltas:
        return f"last {now.taken_s - before.taken_s:.1f} s", total
    return "since the workers started", total


_GROWING = ("_total", "_count", "_sum", "_bucket")  # counters and histograms never go down


def _only_grows(key: SampleKey) -> bool:
    """True for a counter's or histogram's series, which fall only when a worker restarts; a
    gauge (the backlog, say) falls all the time."""
    return key[0].endswith(_GROWING)


def histogram_buckets(samples: Mapping[SampleKey, float], metric: str) -> list[tuple[float, float]]:
    """The cumulative ``(le, count)`` buckets of histogram ``metric``, summed over labels."""
    by_bound: dict[float, float] = {}
    for (name, labels), value in samples.items():
        if name == f"{metric}_bucket":
            bound = float(dict(labels).get("le", "nan"))
            by_bound[bound] = by_bound.get(bound, 0.0) + value
    return sorted(by_bound.items())


def quantile(buckets: Sequence[tuple[float, float]], q: float) -> str | None:
    """The q-quantile of cumulative buckets, interpolated as Prometheus' histogram_quantile."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return f"> {format_seconds(lower_bound)}"
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return format_seconds(lower_bound + (bound - lower_bound) * share)
        lower_bound, lower_count = bound, count
    return None


def sample_total(samples: Mapping[SampleKey, float], name: str) -> float:
    """Every sample called ``name`` added up, whatever its labels."""
    return sum(v for (n, _), v in samples.items() if n == name)


def format_seconds(seconds: float) -> str:
    """A duration for people: ``4.2 ms``, ``250 ms``, ``3.5 s``, ``7 min``."""
    if seconds < 1.0:
        return f"{seconds * 1000:.1f} ms" if seconds < 0.1 else f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.0f} min"


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
