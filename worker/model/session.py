"""The ONNX Runtime session: providers with fallback, thread settings, and the file's identity.

``Model`` is the seam the rest of the worker sees (specs in, arrays out), so batching and error
isolation can be tested without a session; ``OnnxModel`` is the real one.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from producer.protocol.codec import STRING
from worker.config import ModelConfig, ProviderConfig
from worker.errors import ConfigError, ModelError
from worker.model.binding import BoundRunner, buckets_for
from worker.model.fallback import ORT_NAMES, check_fallback, log_unbound
from worker.model.tensorspec import TensorSpec

__all__ = [
    "Model",
    "ModelFile",
    "OnnxModel",
    "TensorSpec",
    "check_sha256",
    "preload_cuda_libraries",
    "read_model_file",
    "share_cpu_arena",
]

log = logging.getLogger(__name__)

_CUDA = "CUDAExecutionProvider"
_ORT_TYPES: dict[str, Any] = {
    "tensor(bool)": "bool",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(int16)": "int16",
    "tensor(uint16)": "uint16",
    "tensor(int32)": "int32",
    "tensor(uint32)": "uint32",
    "tensor(int64)": "int64",
    "tensor(uint64)": "uint64",
    "tensor(float16)": "float16",
    "tensor(float)": "float32",
    "tensor(double)": "float64",
    "tensor(string)": STRING,  # (v2) object arrays of str, which the runtime takes and returns
}


class Model(Protocol):
    """What the worker needs from a runtime session."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        """Run one batch; raises on any runtime failure."""
        ...


@dataclass(frozen=True, slots=True)
class ModelFile:
    """The identity of the served file: what the validation record and replies name."""

    path: Path
    sha256: str
    size_bytes: int
    opsets: dict[str, int]
    ir_version: int | None
    producer: str


def preload_cuda_libraries(ort: Any) -> bool:
    """Load CUDA and cuDNN from the ``nvidia-*`` pip packages, when they are installed; returns
    whether it tried.

    ``pip install "onnxruntime-gpu[cuda,cudnn]"`` puts those libraries in site-packages, where
    the dynamic loader does not look, so without this the CUDA provider fails to start and the
    worker falls back to the CPU. onnxruntime's ``preload_dlls`` (1.21 and later) loads them;
    it reports failures by printing, which goes to the log here instead of stdout. Without the
    packages nothing is done: CUDA then comes from the system (a CUDA base image, say).
    """
    if importlib.util.find_spec("nvidia") is None or not hasattr(ort, "preload_dlls"):
        return False
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            ort.preload_dlls()
    except Exception as exc:  # a broken install must not stop a worker that may fall back
        log.warning("could not preload CUDA libraries from the nvidia packages: %s", exc)
        return True
    text = " ".join(printed.getvalue().split())
    if text:
        log.warning("preloading CUDA libraries from the nvidia packages: %s", text)
    return True


def import_onnxruntime() -> Any:
    """Import the runtime where a session is built: it is heavy, and a producer-only install
    (plain ``pip install redbatch``) does not have it."""
    try:
        import onnxruntime
    except ImportError as exc:
        raise ModelError(
            f"onnxruntime cannot be imported ({exc}): a worker needs it; install "
            "'redbatch[worker]' (onnxruntime-gpu on Linux x86_64), or 'onnxruntime' for the "
            "CPU-only wheel"
        ) from exc
    return onnxruntime


class OnnxModel:
    """An ONNX Runtime session built from a ModelConfig.

    With the CUDA provider active and ``io_binding`` or ``cuda_graph`` set in ``[model.cuda]``,
    runs go through a ``BoundRunner``; ``buckets`` are then the batch sizes that runs are padded
    to (``padded_rows``), each with its own device buffers and, with graphs, its own CUDA graph,
    which warmup runs so that all are in place before the first request.
    """

    def __init__(self, config: ModelConfig, max_batch_size: int = 32) -> None:
        ort = import_onnxruntime()

        self._ort = ort
        # Provider load failures are reported once by us, below; the runtime's own multi-line
        # errors (and its per-node warnings) would only bury that line.
        ort.set_default_logger_severity(4)
        self.requested = [p.name for p in config.providers]
        self._not_built: set[str] = set()  # listed, but not in this onnxruntime build
        if {"cuda", "tensorrt"} & set(self.requested):
            preload_cuda_libraries(ort)
        options = _session_options(ort, config)
        chosen = self._available(config.providers)
        try:
            self._session = ort.InferenceSession(
                str(config.path), sess_options=options, providers=chosen
            )
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise ModelError(f"Cannot load model {config.path}: {exc}") from exc
        self.providers = list(self._session.get_providers())
        self._check_graph_refused(config, options)
        check_fallback(config.providers, self.providers, self._not_built)
        self.inputs = tuple(_spec(a, "input") for a in self._session.get_inputs())
        self.outputs = tuple(_spec(a, "output") for a in self._session.get_outputs())
        self.runtime_version = ort.__version__
        self.binding = "off"  # "io_binding" or "cuda_graph" once a BoundRunner is in use
        self.buckets: tuple[int, ...] = ()
        self._runner: BoundRunner | None = None
        self._bind(config.providers, max_batch_size)

    def _bind(
        self, providers: tuple[ProviderConfig, ...], max_batch_size: int, device: str = "cuda"
    ) -> None:
        """Route runs through a BoundRunner when [model.cuda] asks for it and CUDA is active;
        ``device`` is "cuda" but for tests, which bind host memory."""
        cuda = next((p for p in providers if p.name == "cuda" and p.io_binding), None)
        if cuda is None:
            return
        if _CUDA not in self.providers:
            log_unbound()
            return
        fixed = {s.dims[0] for s in self.inputs if s.dims and isinstance(s.dims[0], int)}
        # A fixed-batch model runs one shape; any other, a few sizes up to max_batch_size.
        buckets = (max(fixed),) if fixed else buckets_for(max_batch_size)
        self._runner = BoundRunner(
            self._ort,
            self._session,
            self.inputs,
            self.outputs,
            buckets,
            graphs=cuda.cuda_graph,
            device=device,
            device_id=int(cuda.options.get("device_id", 0)),
        )
        self.binding = "cuda_graph" if cuda.cuda_graph else "io_binding"
        self.buckets = buckets

    def _available(self, providers: tuple[ProviderConfig, ...]) -> list[Any]:
        available = set(self._ort.get_available_providers())
        chosen: list[Any] = []
        for p in providers:
            ort_name = ORT_NAMES[p.name]
            if ort_name not in available:
                if p.require:
                    raise ModelError(
                        f"Provider {p.name!r} is required (model.{p.name}.require = true) but this "
                        f"onnxruntime build has only {sorted(available)}. Install onnxruntime-gpu "
                        "or drop require."
                    )
                self._not_built.add(p.name)  # check_fallback says so, once the session runs
                continue
            options = _provider_options(p)
            chosen.append((ort_name, options) if options else ort_name)
        if "CPUExecutionProvider" not in [c if isinstance(c, str) else c[0] for c in chosen]:
            chosen.append("CPUExecutionProvider")
        return chosen

    def _check_graph_refused(self, config: ModelConfig, options: Any) -> None:
        """Name the real cause when CUDA is missing because graphs were refused.

        onnxruntime quietly retries on the CPU alone when a session cannot start, and with
        enable_cuda_graph it cannot when the model is not one CUDA graph (a node the CUDA
        provider does not run, or control flow): the fallback message would then blame the
        machine. A second session without graphs tells the two apart.
        """
        cuda = next((p for p in config.providers if p.name == "cuda" and p.cuda_graph), None)
        if cuda is None or _CUDA in self.providers:
            return
        if _CUDA not in self._ort.get_available_providers():
            return
        plain = tuple(replace(p, cuda_graph=False) if p is cuda else p for p in config.providers)
        try:
            probe = self._ort.InferenceSession(
                str(config.path), sess_options=options, providers=self._available(plain)
            )
        except Exception:  # onnxruntime raises its own untyped errors
            return
        if _CUDA in probe.get_providers():
            raise ModelError(
                "Config '[model.cuda] cuda_graph' is true, but onnxruntime cannot run this model "
                "as one CUDA graph (a node the CUDA provider does not run, or control flow such "
                "as If or Loop) and would have served it on the CPU. Set cuda_graph = false; "
                "io_binding = true still works."
            )

    def padded_rows(self, rows: int) -> int:
        """The rows a batch of ``rows`` runs as: its bucket when runs are bound, else ``rows``."""
        return self._runner.padded_rows(rows) if self._runner is not None else rows

    def shrink_arena(self, feeds: dict[str, np.ndarray]) -> None:
        """With the process's shared CPU arena (``share_cpu_arena``): one small run that hands
        the arena's free chunks back to the system. Warmup runs at the largest sizes; the
        arena they grew would stay at that peak for every model after it. Nothing otherwise."""
        if not _ARENA.shared:
            return
        options = self._ort.RunOptions()
        options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        names = [o.name for o in self.outputs]
        try:
            self._session.run(names, feeds, options)
        except Exception as exc:  # the runtime's errors are untyped
            raise ModelError(f"the run that shrinks the shared arena failed: {exc}") from exc

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        if self._runner is not None:
            return self._runner.run(feeds, output_names)
        return list(self._session.run(output_names, feeds))


@dataclass(slots=True)
class _ProcessArena:
    shared: bool = False  # sessions allocate CPU memory from one arena of the process's


_ARENA = _ProcessArena()


def share_cpu_arena() -> None:
    """Have every session made from now on take its CPU memory from one arena of the process,
    not an arena each: a worker serving several models runs one at a time (the device's turns),
    so one arena sized for the largest run serves them all, where arenas of their own each keep
    their peak (docs/operations.md, "Several models in one worker"). Idempotent."""
    if _ARENA.shared:
        return
    ort = import_onnxruntime()
    cpu = ort.OrtMemoryInfo(
        "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
    )
    ort.create_and_register_allocator(cpu, ort.OrtArenaCfg(0, -1, -1, -1))  # the defaults
    _ARENA.shared = True


def _session_options(ort: Any, config: ModelConfig) -> Any:
    options = ort.SessionOptions()
    if _ARENA.shared:
        options.add_session_config_entry("session.use_env_allocators", "1")
    options.log_severity_level = 3
    options.intra_op_num_threads = config.intra_op_threads
    options.inter_op_num_threads = config.inter_op_threads
    # Idle spinning threads cost about 15 CPU ms per request at low load on 2 cores
    # (shared/FACTS.md).
    spin = "1" if config.allow_spinning else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", spin)
    options.add_session_config_entry("session.inter_op.allow_spinning", spin)
    return options


def _provider_options(p: ProviderConfig) -> dict[str, str]:
    opts = dict(p.options)
    if p.name == "tensorrt":
        renamed: dict[str, Any] = {}
        if "device_id" in opts:
            renamed["device_id"] = opts["device_id"]
        if "engine_cache_path" in opts:
            Path(opts["engine_cache_path"]).mkdir(parents=True, exist_ok=True)
            renamed["trt_engine_cache_enable"] = True
            renamed["trt_engine_cache_path"] = opts["engine_cache_path"]
        if opts.get("fp16"):
            renamed["trt_fp16_enable"] = True
        opts = renamed
    if p.name == "cuda" and p.cuda_graph:
        opts["enable_cuda_graph"] = "1"
    return {k: str(v) for k, v in opts.items()}


def _spec(arg: Any, what: str) -> TensorSpec:
    dtype = _ORT_TYPES.get(arg.type)
    if dtype is None:
        raise ModelError(
            f"Model {what} {arg.name!r} has type {arg.type}, which redbatch cannot carry. "
            f"Supported: {', '.join(_ORT_TYPES)}."
        )
    dims = tuple(d if isinstance(d, int) or d is None else str(d) for d in (arg.shape or []))
    return TensorSpec(arg.name, np.dtype(dtype), dims)  # np.dtype keeps STRING's wire name


def read_model_file(path: Path) -> ModelFile:
    """Hash the file and read its opsets without the onnx package (a protobuf walk)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    head = _model_header(path)
    return ModelFile(
        path=path,
        sha256=digest.hexdigest(),
        size_bytes=path.stat().st_size,
        opsets=head["opsets"],
        ir_version=head["ir_version"],
        producer=head["producer"],
    )


def check_sha256(model_file: ModelFile, expected: str | None) -> None:
    """Refuse a file other than the pinned one (``model.sha256``).

    Without the pin, a swapped, corrupted or half-copied file would be served under the
    configured name and version, and replies would carry its hash only after the fact.
    """
    if expected is None or model_file.sha256 == expected.lower():
        return
    raise ConfigError(
        f"Config 'model.sha256' expects {expected.lower()} but {model_file.path} has sha256 "
        f"{model_file.sha256}. Deploy the pinned file, or set model.sha256 to the new hash if "
        "the change is intended."
    )


def _model_header(path: Path) -> dict[str, Any]:
    """Read ModelProto fields 1 (ir_version), 2 (producer_name) and 8 (opset_import)."""
    data = memoryview(path.read_bytes())
    info: dict[str, Any] = {"opsets": {}, "ir_version": None, "producer": ""}
    try:
        for field_no, value in _fields(data):
            if field_no == 1 and isinstance(value, int):
                info["ir_version"] = value
            elif field_no == 2 and not isinstance(value, int):
                info["producer"] = bytes(value).decode("utf-8", "replace")
            elif field_no == 8 and not isinstance(value, int):
                sub = dict(_fields(value))
                domain = bytes(sub.get(1, b"")).decode("utf-8", "replace") or "ai.onnx"
                info["opsets"][domain] = int(sub.get(2, 0))
    except (IndexError, ValueError):
        log.warning("could not read opsets from %s; the record will omit them", path)
    return info


def _fields(buf: memoryview) -> Any:
    """Yield (field number, int or bytes view) for one protobuf message level."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field_no, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield field_no, value
        elif wire == 2:
            length, pos = _varint(buf, pos)
            yield field_no, buf[pos : pos + length]
            pos += length
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
