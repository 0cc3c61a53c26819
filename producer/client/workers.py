"""The worker registry as a producer reads it: live worker records, and the model's row limit.

Workers register a JSON record under their own key and their name in the model's worker set;
a record that expired leaves its name behind, which the reader removes (``WorkerRoster.read``).
``read_workers`` is the plan (``producer.client.plans``) that reads them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from producer.client.results import as_bytes
from producer.client.session import Session
from producer.client.settings import Settings
from producer.client.steps import Call, Plan
from producer.protocol import keys
from producer.protocol.errors import NoWorkerInfo
from producer.redisio.retry import RetryPolicy

__all__ = ["WorkerRoster", "check_rows_per_request", "read_workers", "row_limit"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerRoster:
    """The members of a model's worker set, split into names to look up and names to drop."""

    names: list[str]
    record_keys: list[str]
    junk: list[bytes]

    @classmethod
    def from_members(cls, settings: Settings, members: Iterable[bytes | str]) -> WorkerRoster:
        """Sort the set's members; ones that are not valid names can hold no record."""
        names, junk = [], []
        for member in sorted(as_bytes(m) for m in members):
            name = member.decode("utf-8", "replace")
            if keys.is_valid_name(name):
                names.append(name)
            else:
                junk.append(member)
        record_keys = [keys.worker_key(settings.prefix, settings.model, n) for n in names]
        return cls(names, record_keys, junk)

    def read(self, raws: Sequence[bytes | str | None]) -> tuple[list[dict[str, Any]], list[bytes]]:
        """The live records for ``raws`` (one per record key), and the set members to SREM."""
        records: list[dict[str, Any]] = []
        stale = list(self.junk)
        for name, raw in zip(self.names, raws, strict=True):
            if raw is None:
                stale.append(name.encode())
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                log.warning("worker %s has a record that is not JSON; skipped", name)
                continue
            if isinstance(record, dict):
                records.append(record)
            else:
                log.warning("worker %s has a record that is not a JSON object; skipped", name)
        return records, stale


def read_workers(session: Session, retry: RetryPolicy) -> Plan[list[dict[str, Any]]]:
    """The live workers' validation records, by name; forgets workers whose record expired."""
    key = session.settings.workers_key
    members = yield Call("SMEMBERS", lambda r: r.smembers(key), retry)
    roster = WorkerRoster.from_members(session.settings, members)
    raws = []
    if roster.record_keys:
        raws = yield Call("MGET", lambda r: r.mget(roster.record_keys), retry)
    records, stale = roster.read(raws)
    if stale:
        yield Call("SREM", lambda r: r.srem(key, *stale), retry)
    return records


def _row_limits(records: Iterable[Mapping[str, Any]]) -> list[int]:
    limits = []
    for record in records:
        batching = record.get("batching")
        size = batching.get("max_batch_size") if isinstance(batching, dict) else None
        if type(size) is int and size >= 1:
            limits.append(size)
    return limits


def check_rows_per_request(rows: int | None, records: Iterable[Mapping[str, Any]]) -> None:
    """Refuse a ``rows_per_request`` over the live workers' row limit, which would have every
    request answered TOO_LARGE; nothing to check when none has registered."""
    limits = _row_limits(records)
    if rows is not None and limits and rows > min(limits):
        raise ValueError(
            f"rows_per_request={rows} is over the live workers' max_batch_size={min(limits)}: "
            f"every request would be answered TOO_LARGE. Use {min(limits)} or less, or leave "
            "it out to use the workers' limit."
        )


def row_limit(records: Iterable[Mapping[str, Any]], settings: Settings) -> int:
    """The smallest ``batching.max_batch_size`` among live worker records."""
    limits = _row_limits(records)
    if not limits:
        raise NoWorkerInfo(
            f"No live worker of model {settings.model!r} has registered under prefix "
            f"{settings.prefix!r} (set {settings.workers_key}), so its row limit "
            "(batching.max_batch_size) is unknown. Start a worker first, or pass "
            "rows_per_request= to map()."
        )
    return min(limits)
