"""What is fuzzed: a synthetic model's inputs and outputs, and the limits of its worker."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from producer.protocol.codec import STRING
from worker.config import BatchingConfig, LimitsConfig, ModelConfig, RedisConfig, WorkerConfig
from worker.model.schema import Schema
from worker.model.session import TensorSpec


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model's inputs (dtype name, dims after the batch axis) and output names."""

    inputs: Mapping[str, tuple[str, tuple[int, ...]]]
    outputs: Mapping[str, tuple[str, tuple[int, ...]]]


#: The synthetic models of ``tools.synthetic`` that the fuzzers know how to feed.
SPECS = {
    "demo": ModelSpec(
        {"features": ("float32", (16,))}, {"probs": ("float32", (4,)), "label": ("int64", ())}
    ),
    "tiny": ModelSpec({"x": ("float32", (128,))}, {"y": ("float32", (64,))}),
    "multi_io": ModelSpec(
        {"a": ("float32", (3,)), "b": ("int64", (2,))},
        {"twice": ("float32", (3,)), "total": ("int64", ())},
    ),
}


@dataclass(frozen=True, slots=True)
class FuzzTarget:
    """The worker under test as the fuzzer sees it: its model and the limits from its config."""

    model: str = "demo"
    prefix: str = "redbatch"
    max_request_bytes: int = 16384
    max_batch_size: int = 32

    @property
    def spec(self) -> ModelSpec:
        return SPECS[self.model]


def schema_for(target: FuzzTarget) -> Schema:
    """The worker's Schema for ``target``, built from its spec (no model file, no runtime)."""
    spec = target.spec

    def tensors(table: Mapping[str, tuple[str, tuple[int, ...]]]) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(n, np.dtype(d), ("N", *dims)) for n, (d, dims) in table.items())

    config = WorkerConfig(
        RedisConfig(),
        ModelConfig(target.model, Path(f"{target.model}.onnx")),
        batching=BatchingConfig(max_batch_size=target.max_batch_size),
        limits=LimitsConfig(max_request_bytes=target.max_request_bytes),
    )
    return Schema(tensors(spec.inputs), tensors(spec.outputs), config)


def text_schema(target: FuzzTarget, max_element_bytes: int) -> Schema:
    """(v2) A Schema like ``schema_for``'s, of a model that takes ``text`` (string, one per row)
    and gives ``label`` (string): what text mutations meet past the demo model's dtype check."""
    config = WorkerConfig(
        RedisConfig(),
        ModelConfig("text", Path("text.onnx")),
        batching=BatchingConfig(max_batch_size=target.max_batch_size),
        limits=LimitsConfig(
            max_request_bytes=target.max_request_bytes, max_element_bytes=max_element_bytes
        ),
    )
    text, label = TensorSpec("text", STRING, ("N",)), TensorSpec("label", STRING, ("N",))
    return Schema((text,), (label,), config)
