"""A model prepared for a fleet: its session wrapped so the budget may release and load it again.

A session loaded again on demand must be the version the replies name: the file is hashed on
each load and compared with the one prepared at start (or at the last reload), so a file
replaced on disk is never served under the old version's name; SIGHUP loads it as a new one.
"""

from __future__ import annotations

import dataclasses
import time

from worker.config import WorkerConfig
from worker.errors import ModelError
from worker.model.device import Device
from worker.model.held import Budget, HeldModel
from worker.model.session import OnnxModel, read_model_file
from worker.warmup import Prepared, prepare, warm_up

__all__ = ["prepare_held"]


def prepare_held(config: WorkerConfig, name: str, budget: Budget, device: Device) -> Prepared:
    """``prepare`` (load, check, warm up, record), with the session a ``HeldModel``."""
    started = time.perf_counter()
    prepared = prepare(config, name)
    session = prepared.model
    assert isinstance(session, OnnxModel)
    sha256 = prepared.record["model"]["sha256"]

    def load() -> OnnxModel:
        found = read_model_file(config.model.path).sha256
        if found != sha256:
            raise ModelError(
                f"{config.model.path} changed since it was loaded as version "
                f"{config.model.version!r} (sha256 {sha256[:12]}..., now {found[:12]}...); send "
                "the worker SIGHUP (redbatch reload) to serve the new file as a new version"
            )
        fresh = OnnxModel(config.model, config.batching.max_batch_size)
        warm_up(fresh, prepared.schema, config.warmup.runs, fresh.buckets)
        fresh.shrink_arena(prepared.schema.synthetic_feeds(prepared.schema.fixed_batch or 1))
        return fresh

    held = HeldModel(
        config.model.name, session, load, budget, device, time.perf_counter() - started
    )
    return dataclasses.replace(prepared, model=held)
