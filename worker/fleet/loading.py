"""A model prepared for a fleet: its session wrapped so the budget may release and load it again.

A session loaded again on demand must be the version the replies name: the file is hashed on
each load and compared with the one prepared at start (or at the last reload), so a file
replaced on disk is never served under the old version's name; SIGHUP loads it as a new one.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

from worker.config import WorkerConfig
from worker.errors import ModelError
from worker.model import gpu
from worker.model.device import Device, Turned
from worker.model.held import Budget, HeldModel
from worker.model.schema import Schema
from worker.model.session import OnnxModel, read_model_file
from worker.warmup import Prepared, prepare, warm_up

__all__ = ["prepare_held"]


def _device_memory(config: WorkerConfig) -> Callable[[], int | None] | None:
    """The free memory of the CUDA device the model's config asks for first, if it does."""
    first = config.model.providers[0] if config.model.providers else None
    if first is None or first.name != "cuda":
        return None
    return functools.partial(gpu.free_bytes, int(first.options.get("device_id", 0) or 0))


def prepare_held(config: WorkerConfig, name: str, budget: Budget, device: Device) -> Prepared:
    """``prepare`` (load, check, warm up, record), with the session a ``HeldModel``."""
    started = time.perf_counter()
    probe = _device_memory(config)
    free_before = probe() if probe is not None else None
    prepared = prepare(config, name, turns=device)
    session = prepared.model
    assert isinstance(session, OnnxModel)
    if "CUDAExecutionProvider" not in session.providers[:1]:
        probe = None  # on the CPU (CUDA listed, but not started): no device memory to bound
    free_after = probe() if probe is not None else None
    took = free_before - free_after if free_before is not None and free_after is not None else 0
    held = HeldModel(
        config.model.name,
        session,
        _loader(config, prepared.schema, prepared.record["model"]["sha256"], device),
        budget,
        device,
        time.perf_counter() - started,
        device_memory=probe,
        device_bytes=max(took, 0),
    )
    return dataclasses.replace(prepared, model=held)


def _loader(
    config: WorkerConfig, schema: Schema, sha256: str, device: Device
) -> Callable[[], OnnxModel]:
    """How the model is loaded again on demand. It holds nothing of the first session (nor of
    the ``Prepared`` that held it): what a release lets go must not stay reachable from here."""

    def load() -> OnnxModel:
        found = read_model_file(config.model.path).sha256
        if found != sha256:
            raise ModelError(
                f"{config.model.path} changed since it was loaded as version "
                f"{config.model.version!r} (sha256 {sha256[:12]}..., now {found[:12]}...); send "
                "the worker SIGHUP (redbatch reload) to serve the new file as a new version"
            )
        fresh = OnnxModel(config.model, config.batching.max_batch_size)
        warm_up(Turned(fresh, device), schema, config.warmup.runs, fresh.buckets)
        with device.turn(1):
            fresh.shrink_arena(schema.synthetic_feeds(schema.fixed_batch or 1))
        return fresh

    return load
