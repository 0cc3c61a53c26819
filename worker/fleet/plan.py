"""What a config read again (SIGHUP, ``redbatch reload``) changes: models added, removed and
changed (contract section 8), worked out before anything is touched.

A model is changed when its settings differ or its file's bytes do (the same path, a new file):
either way it is loaded and warmed as a new version beside the old, then swapped in. The
worker-wide tables (``[redis]``, ``[metrics]``, ``[scheduling]``) hold the process's connections,
port and scheduler: a change to them is reported as needing a restart, and not applied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from worker.config import WorkerConfig
from worker.config.served import WORKER_WIDE, ServedConfig
from worker.config.settings import WorkerTable
from worker.errors import WorkerError
from worker.model.session import read_model_file

__all__ = ["Plan", "plan"]


@dataclass(frozen=True, slots=True)
class Plan:
    added: tuple[WorkerConfig, ...]
    removed: tuple[str, ...]
    changed: tuple[WorkerConfig, ...]
    restart_only: tuple[str, ...]  # what changed for a restart: "[redis]", "[worker] KEY"
    max_loaded_models: int

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed)

    def summary(self) -> dict[str, list[str]]:
        return {
            "added": [c.model.name for c in self.added],
            "removed": list(self.removed),
            "changed": [f"{c.model.name}@{c.model.version}" for c in self.changed],
        }


def plan(
    current: Mapping[str, tuple[WorkerConfig, str]],
    served: ServedConfig,
    worker: WorkerTable | None = None,
) -> Plan:
    """``current``: each model served now, by name, with the sha256 of the file it runs;
    ``worker``: the ``[worker]`` table in effect (its ``max_loaded_models`` applies at once,
    its other keys at a restart)."""
    now = next(iter(current.values()))[0] if current else None
    restart_only: list[str] = []
    if now is not None:
        new = served.models[0]
        restart_only = [f"[{t}]" for t in WORKER_WIDE if getattr(new, t) != getattr(now, t)]
    if worker is not None:
        restart_only += [
            f"[worker] {key}"
            for key in ("shared_arena", "watch_config_s")
            if getattr(served.worker, key) != getattr(worker, key)
        ]
    added, changed = [], []
    for listed in served.models:
        config = listed  # the worker-wide tables stay as they are until a restart
        if now is not None:
            config = dataclasses.replace(listed, **{t: getattr(now, t) for t in WORKER_WIDE})
        held = current.get(config.model.name)
        if held is None:
            added.append(config)
        elif config != held[0] or _sha256(config) != held[1]:
            changed.append(config)
    names = {c.model.name for c in served.models}
    removed = tuple(name for name in current if name not in names)
    return Plan(
        tuple(added),
        removed,
        tuple(changed),
        tuple(restart_only),
        served.worker.max_loaded_models,
    )


def _sha256(config: WorkerConfig) -> str | None:
    """The file's hash now; None when it cannot be read (the load then says why)."""
    try:
        return read_model_file(config.model.path).sha256
    except (WorkerError, OSError):
        return None
