"""Which models a worker serves: one ``[model]`` table, or a ``[[models]]`` array (contract
section 8).

Each ``[[models]]`` entry holds what ``[model]`` holds, with the per-model tables nested under it
(``[models.batching]``, ``[models.inputs.NAME]``, ``[models.pipeline]``, ``[models.cuda]``...),
while ``[redis]``, ``[metrics]`` and ``[scheduling]`` stay worker-wide and ``[worker]`` holds
``max_loaded_models``. Each entry becomes a whole ``WorkerConfig``, exactly what the same model
alone in a config of its own would give, so everything after the config sees one model's
settings as before; errors name the entry (``models[1].batching.max_batch_size``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.config.settings import WorkerConfig, WorkerTable, parse_config, read_toml
from worker.config.table import Table
from worker.errors import ConfigError

__all__ = ["PER_MODEL", "WORKER_WIDE", "ServedConfig", "load_served", "parse_served"]

#: Tables each model has its own of (nested under its ``[[models]]`` entry).
PER_MODEL = ("batching", "limits", "delivery", "warmup", "inputs", "outputs", "pipeline")
#: Tables the worker has one of, whatever the models.
WORKER_WIDE = ("redis", "metrics", "scheduling")


@dataclass(frozen=True, slots=True)
class ServedConfig:
    """The models a worker serves, in config order, and its worker-wide ``[worker]`` table."""

    models: tuple[WorkerConfig, ...]
    worker: WorkerTable = field(default_factory=WorkerTable)


def load_served(path: str | Path, environ: Mapping[str, str] | None = None) -> ServedConfig:
    """Read a TOML file; ``REDIS_URL`` in ``environ`` (default: os.environ) overrides redis.url."""
    path = Path(path)
    env = os.environ if environ is None else environ
    return parse_served(read_toml(path), path.resolve().parent, redis_url=env.get("REDIS_URL"))


def parse_served(
    data: Mapping[str, Any], base_dir: Path, redis_url: str | None = None
) -> ServedConfig:
    """The models of parsed TOML: its ``[model]``, or each entry of its ``[[models]]``."""
    worker = Table(data, "").table("worker").build(WorkerTable)
    rest = {k: v for k, v in data.items() if k != "worker"}
    if "models" not in data:
        return ServedConfig((parse_config(rest, base_dir, redis_url),), worker)
    entries = _entries(data)
    wide = {k: data[k] for k in WORKER_WIDE if k in data}
    models = []
    for i, entry in enumerate(entries):
        own = {k: v for k, v in entry.items() if k in PER_MODEL}
        model = {k: v for k, v in entry.items() if k not in PER_MODEL}
        config = parse_config(
            {**wide, **own, "model": model}, base_dir, redis_url, model_where=f"models[{i}]"
        )
        models.append(config)
    _unique([m.model.name for m in models])
    return ServedConfig(tuple(models), worker)


def _entries(data: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The ``[[models]]`` entries, with the top level holding nothing a model would own."""
    if "model" in data:
        raise ConfigError(
            "Config has both a [model] table and a [[models]] array: use [model] for one model, "
            "or one [[models]] entry per model."
        )
    entries = data["models"]
    if (
        not isinstance(entries, list)
        or not entries
        or not all(isinstance(e, Mapping) for e in entries)
    ):
        raise ConfigError(
            "Config 'models' must be an array of tables: a [[models]] entry per model, each "
            "holding what [model] holds (name, path, ...)."
        )
    for name in data:
        if name in PER_MODEL:
            raise ConfigError(
                f"Config has a top-level [{name}] table beside [[models]]: each model has its "
                f"own, nested under its entry as [models.{name}]. Worker-wide tables are "
                f"{', '.join(f'[{t}]' for t in (*WORKER_WIDE, 'worker'))}."
            )
    Table(data, "").check_keys(["models", "worker", *WORKER_WIDE])
    return entries


def _unique(names: list[str]) -> None:
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            raise ConfigError(
                f"Config 'models[{i}].name' is {name!r}, as 'models[{seen[name]}].name' is: each "
                "model a worker serves needs a name of its own (producers address it by name)."
            )
        seen[name] = i
