"""``redbatch status --worker NAME``: every model one worker process serves, from its records.

A worker serving several models (contract section 8) keeps a record per model
(``P:{M}:worker:NAME``); this finds the models under the prefix, reads NAME's record of each,
and shows per model the version served, whether its session is held or released under the
worker's ``max_loaded_models`` budget, its loads and releases, and the last reload's verdict.
"""

from __future__ import annotations

import json
from typing import Any

import redis

from producer.ops.models import find_models
from producer.ops.status import ShardAccess
from producer.ops.textformat import printable, table
from producer.ops.words import count
from producer.protocol.keys import worker_key

__all__ = ["format_worker", "gather_worker"]


def gather_worker(
    conn: redis.Redis, prefix: str, name: str, *, retry_s: float = 0.0
) -> list[dict[str, Any]]:
    """NAME's record of each model it serves, by model name."""
    access = ShardAccess(conn, retry_s)
    try:
        access.refresh()
        found = find_models(access, conn, prefix)
        records = []
        for model in sorted(found.models):
            raw = access.on(model, _get, worker_key(prefix, model, name))
            if raw is not None:
                records.append(json.loads(raw))
    finally:
        access.close()
    return records


def _get(client: redis.Redis, key: str) -> Any:
    return client.get(key)


def worker_to_json(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "model": r.get("model", {}).get("name"),
            "version": r.get("model", {}).get("version"),
            "state": r.get("state"),
            "session": r.get("session"),
            "reload": r.get("reload"),
        }
        for r in records
    ]


def format_worker(name: str, prefix: str, records: list[dict[str, Any]]) -> str:
    if not records:
        return printable(
            f"no live worker named {name!r} under prefix {prefix!r} (redbatch status lists the "
            "models and their workers)"
        )
    rows = [["MODEL", "VERSION", "STATE", "SESSION", "LOADS", "RELEASED", "LAST LOAD"]]
    for r in records:
        session = r.get("session") or {}
        held = "held" if session.get("loaded", True) else "released"
        load_ms = session.get("load_ms")
        rows.append(
            [
                str(r.get("model", {}).get("name")),
                str(r.get("model", {}).get("version")),
                str(r.get("state", "-")),
                held,
                str(session.get("loads", "-")),
                str(session.get("evictions", "-")),
                f"{load_ms:,.0f} ms" if isinstance(load_ms, int | float) else "-",
            ]
        )
    lines = [f"Worker {name} serves {count(len(records), 'model')}, prefix {prefix!r}"]
    lines += table(rows, indent="  ", right=frozenset({4, 5, 6}))
    for r in records:
        error = (r.get("session") or {}).get("error")
        if error:
            lines.append(f"  !! {r.get('model', {}).get('name')}: load failed: {error}")
    reload = next((r.get("reload") for r in records if r.get("reload")), None)
    if reload:
        changes = "; ".join(
            f"{k} {', '.join(v)}" for k, v in (reload.get("changes") or {}).items() if v
        )
        lines.append(f"  last reload at {reload.get('at')}: {changes or 'nothing changed'}")
        lines += [f"  !! not applied: {e}" for e in reload.get("errors") or []]
    return "\n".join(map(printable, lines))
