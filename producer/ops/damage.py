"""Damage to a model's streams, for ``redbatch status``: what the stream shows now, and what
the workers saw happen (the ``damage`` notes in their records).

A stream is damaged when its id space is exhausted (it holds the largest id, so every ``XADD *``
fails), when undelivered entries were deleted (a trim: the group's counters say so), or when a
key holds another type than a stream. Each note ends with where the repair is written. Measured
on Redis 7.0: a null ``lag`` is no sign of damage (acknowledgements out of order make it null
too), so a trim is read from ``entries-added - entries-read - length``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from producer.ops.words import count
from producer.protocol import keys
from producer.redisio.streaminfo import MAX_ID, REPAIR, is_exhausted, undelivered_lost

__all__ = [
    "DamageNote",
    "damage_json",
    "damage_lines",
    "stream_damage",
    "worker_damage",
]


#: Kinds that block the queue now: ``redbatch status`` exits 1 while one is seen.
BLOCKING = frozenset({"exhausted", "wrong_type"})


@dataclass(frozen=True, slots=True)
class DamageNote:
    """One damage: its kind, the key, the requests lost (at least; None when unknown), what it
    means, and who saw it (a worker's name; None when status saw it in the stream now)."""

    kind: str
    stream: str
    lost: int | None
    detail: str
    worker: str | None = None
    at: float | None = None  # epoch s, when a worker saw it

    @property
    def blocking(self) -> bool:
        """True when the queue is blocked now (status saw it, of a kind that blocks)."""
        return self.worker is None and self.kind in BLOCKING


def stream_damage(conn: redis.Redis, requests_key: str, dead_key: str) -> tuple[DamageNote, ...]:
    """What ``requests_key`` and ``dead_key`` show now: a wrong type, an exhausted id space,
    undelivered entries deleted. XINFO STREAM refused (an ACL without ``+xinfo|stream``) shows
    nothing."""
    notes = [_wrong_type(conn, key) for key in (requests_key, dead_key)]
    found = [n for n in notes if n is not None]
    if found and found[0].stream == requests_key:
        return tuple(found)
    try:
        stream = conn.xinfo_stream(requests_key)
        groups = conn.xinfo_groups(requests_key)
    except redis.ResponseError:  # no such key, or refused
        return tuple(found)
    if is_exhausted(stream):
        found.append(
            DamageNote(
                "exhausted",
                requests_key,
                None,
                f"the stream holds the largest possible id ({MAX_ID}): every XADD * fails, so "
                "producers get StreamExhausted and nothing new is queued",
            )
        )
    group = next((g for g in groups if _text(g.get("name")) == keys.CONSUMER_GROUP), None)
    lost = undelivered_lost(stream, group)
    if lost:
        found.append(
            DamageNote(
                "trimmed",
                requests_key,
                lost,
                f"undelivered entries were deleted (trimmed): at least {lost} since the group's "
                "counter began; no worker will answer them",
            )
        )
    return tuple(found)


def _wrong_type(conn: redis.Redis, key: str) -> DamageNote | None:
    """A note when ``key`` exists and is not a stream."""
    kind = _text(conn.type(key))
    if kind in ("stream", "none"):
        return None
    what = "requests" if key.endswith(":requests") else "dead letters"
    return DamageNote(
        "wrong_type",
        key,
        None,
        f"the {what} key holds a {kind}, not a stream: nothing can be queued or dead-lettered "
        "there until it is renamed or deleted (after saving what it holds)",
    )


def worker_damage(workers: Any) -> tuple[DamageNote, ...]:
    """The damage notes of live workers' records (``WorkerInfo``), newest first."""
    notes = []
    for worker in workers:
        for raw in worker.get("damage") or []:
            if not isinstance(raw, dict):
                continue
            lost, at = raw.get("lost"), raw.get("at")
            notes.append(
                DamageNote(
                    kind=str(raw.get("kind", "?")),
                    stream=str(raw.get("stream", "?")),
                    lost=lost if isinstance(lost, int) else None,
                    detail=str(raw.get("detail", "")),
                    worker=worker.name,
                    at=float(at) if isinstance(at, int | float) else None,
                )
            )
    return tuple(sorted(notes, key=lambda n: -(n.at or 0.0)))


def damage_lines(notes: tuple[DamageNote, ...], now_s: float) -> list[str]:
    """The notes as report lines, each ending with the repair pointer; none when undamaged."""
    if not notes:
        return []
    lines = ["Damage (see " + REPAIR + ")"]
    for note in notes:
        lost = "" if note.lost is None else f", at least {count(note.lost, 'request')} lost"
        if note.worker is None:
            who = "now"
        else:
            age = "" if note.at is None else f" {max(0.0, now_s - note.at):.0f} s ago"
            who = f"seen by worker {note.worker}{age}"
        lines.append(f"  {note.kind} {note.stream} ({who}{lost}): {note.detail}. Repair: {REPAIR}")
    return lines


def damage_json(notes: tuple[DamageNote, ...]) -> list[dict[str, Any]]:
    """The notes as JSON values."""
    return [
        {
            "kind": n.kind,
            "stream": n.stream,
            "lost": n.lost,
            "detail": n.detail,
            "worker": n.worker,
            "at": n.at,
            "blocking": n.blocking,
            "repair": REPAIR,
        }
        for n in notes
    ]


def _text(value: Any) -> str:
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)
