"""The worker's TOML config, read once at the edge into frozen dataclasses.

Each section is declared once, here: a frozen dataclass whose key fields carry their default and
a ``Key`` (worker/config/keys.py) with kind, bounds and one line of help; units are in the key
names. Reading, ``--help-config`` and the reference check derive from it. Unknown keys and bad
values raise ``ConfigError`` naming the dotted key, what it holds and what would be valid,
before anything touches Redis or the model.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from producer.protocol.keys import DEFAULT_PREFIX
from worker.config import kinds
from worker.config.keys import BOOL, INT, NUMBER, STR, STR_LIST, Key, Kind, declared, key, setting
from worker.config.redisurl import URL_FORMS, redis_url_problem, shown_url
from worker.config.table import Table
from worker.errors import ConfigError

__all__ = [
    "PROVIDERS",
    "URL_FROM_CONFIG",
    "URL_FROM_DEFAULT",
    "URL_FROM_ENV",
    "BatchingConfig",
    "DeliveryConfig",
    "InputConfig",
    "LimitsConfig",
    "MetricsConfig",
    "ModelConfig",
    "OutputConfig",
    "PipelineConfig",
    "ProviderConfig",
    "ProviderOptions",
    "RedisConfig",
    "WarmupConfig",
    "WorkerConfig",
    "WorkerTable",
    "load_config",
    "parse_config",
    "read_toml",
    "sections",
]

_CUDA_KEYS = "require device_id gpu_mem_limit arena_extend_strategy io_binding cuda_graph"
#: Provider short names accepted in ``model.providers``, with the keys of their tables.
PROVIDERS: dict[str, frozenset[str]] = {
    "cpu": frozenset({"require"}),
    "cuda": frozenset(_CUDA_KEYS.split()),
    "tensorrt": frozenset({"require", "device_id", "engine_cache_path", "fp16"}),
}
_DAY_S = 24 * 3600
# Redis refuses an EXPIRE whose milliseconds overflow; ten years is past any use.
_MAX_REPLY_TTL_S = 10 * 365 * _DAY_S
# Longer durations are typos. A huge claim_idle_ms (1e14) overflowed the lease keeper's
# thread wait, which killed it silently, and the worker served on with no lease renewal.
_MAX_CLAIM_IDLE_MS = _DAY_S * 1000
_MAX_RUN_S = float(_DAY_S)
_16_MIB = 16 * 1024 * 1024


def _provider_names(names: Any) -> str | None:
    wrong = STR_LIST.problem(names)
    if wrong is not None:
        return wrong
    if not names:
        return "List at least one, e.g. ['cpu']."
    unknown = [n for n in names if n not in PROVIDERS]
    return f"{unknown[0]!r} is not one; valid: {', '.join(PROVIDERS)}." if unknown else None


_PROVIDER_NAMES = Kind(f"list of {', '.join(PROVIDERS)}", _provider_names, list)


#: Where ``RedisConfig.url`` came from, for the worker's start-up line.
URL_FROM_ENV, URL_FROM_CONFIG, URL_FROM_DEFAULT = "REDIS_URL", "redis.url", "default"


@dataclass(frozen=True, slots=True)
class RedisConfig:
    url: str = setting(
        "redis://127.0.0.1:6379/0", STR, "redis://, rediss:// (TLS) or unix://; REDIS_URL wins."
    )
    prefix: str = setting(DEFAULT_PREFIX, kinds.PREFIX, "Prefix of every key the worker uses.")
    url_from: str = URL_FROM_DEFAULT  # not a key: REDIS_URL, redis.url or default
    url_overrode: bool = False  # not a key: REDIS_URL replaced a redis.url the config set


@dataclass(frozen=True, slots=True)
class ProviderConfig:
    """One execution provider, in order of preference, with its options."""

    name: str
    require: bool = setting(False, BOOL, "Refuse to start without it rather than fall back.")
    options: Mapping[str, Any] = field(default_factory=dict)  # the ProviderOptions set
    io_binding: bool = setting(False, BOOL, "Preallocated device buffers per batch bucket (cuda).")
    cuda_graph: bool = setting(False, BOOL, "Replay a CUDA graph per bucket; implies io_binding.")


@dataclass(frozen=True, slots=True)
class ProviderOptions:
    """The ``[model.PROVIDER]`` keys passed to onnxruntime as provider options when set."""

    device_id: int | None = setting(None, INT, "The device to run on.", min=0, example=0)
    gpu_mem_limit: int | None = setting(
        None, INT, "Bytes the CUDA arena may take.", min=1, example=8 * 1024**3
    )
    arena_extend_strategy: str | None = setting(
        None, kinds.ARENA_STRATEGY, "How the CUDA arena grows.", example="kNextPowerOfTwo"
    )
    engine_cache_path: str | None = setting(
        None, STR, "Where TensorRT keeps engines, relative to the config.", example="../trt-cache"
    )
    fp16: bool | None = setting(None, BOOL, "Let TensorRT run in half precision.", example=False)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str = field(
        metadata=key(kinds.MODEL_NAME, "The model name producers address.", example="demo")
    )
    path: Path = field(
        metadata=key(STR, "The .onnx file, relative to the config.", example="../models/demo.onnx")
    )
    version: str = setting("1", kinds.VERSION, "Named in replies, metrics and status.")
    providers: tuple[ProviderConfig, ...] = setting(
        (ProviderConfig("cpu"),),
        _PROVIDER_NAMES,
        "Execution providers by preference; without cpu listed, no CPU fallback.",
        shown=["cpu"],
        example=["cuda", "cpu"],
    )
    intra_op_threads: int = setting(0, INT, "Threads within an operator; 0: one per core.", min=0)
    inter_op_threads: int = setting(0, INT, "Threads across operators; 0: one per core.", min=0)
    allow_spinning: bool = setting(False, BOOL, "Let idle onnxruntime threads spin, costing CPU.")
    sha256: str | None = setting(
        None,
        kinds.SHA256,
        "The file's SHA-256, lowercased; another file is refused.",
        example="0123456789abcdef" * 4,
    )


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    max_batch_size: int = setting(
        32, INT, "Rows per batch; a request with more is TOO_LARGE.", min=1, max=1_000_000
    )
    max_wait_ms: float = setting(
        5.0, NUMBER, "How long a partial batch waits for more rows.", min=0.0, max=60_000.0
    )
    adaptive_wait: bool = setting(True, BOOL, "Skip the wait while it brings no more requests.")


@dataclass(frozen=True, slots=True)
class SchedulingConfig:
    """``[scheduling]``: how batches are filled across lanes (docs/protocol.md, "Lanes"): class
    high first, then normal, then low, each lower class kept at its minimum share of the rows
    while it has work; within a class, tenants by weight (``P:{M}:weights``)."""

    min_share_normal: float = setting(
        0.1, NUMBER, "Share of rows normal gets while it has work under high load.", min=0.0,
        max=0.5,
    )  # fmt: skip
    min_share_low: float = setting(
        0.05, NUMBER, "Share of rows low gets while it has work under higher load.", min=0.0,
        max=0.5,
    )  # fmt: skip
    max_lanes: int = setting(
        64, INT, "Lanes read per shard; more in P:{T}:lanes are ignored (and logged).", min=1,
        max=1024,
    )  # fmt: skip
    lane_idle_s: float = setting(
        300.0, NUMBER, "An empty lane with nothing pending this long is removed.", min=1.0,
        max=float(_DAY_S),
    )  # fmt: skip
    split_requests: bool = setting(
        True, BOOL, "Lower-class rows fill the room a higher class leaves, split across batches."
    )
    lane_watch_ms: float = setting(
        500.0, NUMBER, "How often lane sets are checked for new lanes; 0: at heartbeats only.",
        min=0.0, max=60_000.0,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    max_request_bytes: int = setting(
        _16_MIB, INT, "Larger bodies are TOO_LARGE, before decoding.", min=64, max=2**31
    )
    reject_non_finite: bool = setting(True, BOOL, "NaN and infinity in inputs are INVALID_INPUT.")
    max_element_bytes: int = setting(
        _16_MIB, INT, "Longer string or bytes elements are TOO_LARGE.", min=1, max=2**31
    )
    max_reply_bytes: int = setting(
        0, kinds.REPLY_BYTES, "Larger replies are TOO_LARGE; 0: Redis's proto-max-bulk-len."
    )


@dataclass(frozen=True, slots=True)
class DeliveryConfig:
    claim_idle_ms: int = setting(
        30_000, INT, "Pending this long, an entry is claimed.", min=100, max=_MAX_CLAIM_IDLE_MS
    )
    max_deliveries: int = setting(3, INT, "Deliveries before an entry is POISONED.", min=1)
    reply_ttl_s: int = setting(3600, INT, "How long replies are kept.", min=1, max=_MAX_REPLY_TTL_S)
    max_run_s: float = setting(
        300.0, NUMBER, "A batch running longer is hung; 0: no check.", min=0.0, max=_MAX_RUN_S
    )


@dataclass(frozen=True, slots=True)
class WarmupConfig:
    runs: int = setting(5, INT, "Runs at batch sizes 1 and max; 0: none.", min=0, max=10_000)


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    port: int = setting(0, INT, "Port of /metrics, /healthz, /readyz; 0: none.", min=0, max=65535)
    host: str = setting(  # every interface, so that probes and Prometheus reach a container
        "0.0.0.0", kinds.LISTEN_HOST, "The address they listen on."
    )


@dataclass(frozen=True, slots=True)
class InputConfig:
    """Per-input checks and warmup hints from ``[inputs.NAME]``."""

    name: str
    min: float | None = setting(
        None, kinds.bound(-math.inf), "Lower values are INVALID_INPUT.", example=-10.0
    )
    max: float | None = setting(
        None, kinds.bound(math.inf), "Higher values are INVALID_INPUT.", example=10.0
    )
    warmup_shape: tuple[int, ...] | None = setting(
        None, kinds.SHAPE, "Free non-batch dimensions in warmup (else 1).", example=[16]
    )
    batch_axis: int | None = setting(0, kinds.BATCH_AXIS, 'The rows\' axis; "none": no rows.')


@dataclass(frozen=True, slots=True)
class OutputConfig:
    """Per-output settings from ``[outputs.NAME]``."""

    name: str
    batch_axis: int | None = setting(0, kinds.BATCH_AXIS, 'The rows\' axis; "none": no rows.')


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """``[pipeline]``: the handler whose hooks run before and after the model (docs/protocol.md
    section 11)."""

    handler: str = field(
        metadata=key(
            kinds.HANDLER, "Built at start, with options.", example="handlers:ImagePipeline"
        )
    )
    threads: int = setting(1, INT, "Threads the hooks run on.", min=1, max=256)
    timeout_s: float = setting(  # worker/pipeline/hookpool.py abandons a call past it
        30.0, NUMBER, "A hook call running longer is abandoned.", min=0.001, max=_MAX_RUN_S
    )
    options: Mapping[str, Any] = field(
        default_factory=dict,
        metadata=key(kinds.HANDLER_OPTIONS, "Keyword arguments for the handler's constructor."),
    )


@dataclass(frozen=True, slots=True)
class WorkerTable:
    """``[worker]``: the worker process across the models it serves (``worker.config.served``)."""

    max_loaded_models: int = setting(
        0, INT, "Model sessions held at once; 0: every model the config lists.", min=0, max=1024
    )
    shared_arena: bool = setting(
        True,
        BOOL,
        "With several models: their sessions share one CPU memory arena (one run at a time).",
    )
    watch_config_s: float = setting(
        0.0,
        NUMBER,
        "Read the config file again when its bytes change, looking this often (a mounted "
        "ConfigMap changes in place); 0: only on SIGHUP or redbatch reload.",
        min=0.0,
        max=3600.0,
    )


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    redis: RedisConfig
    model: ModelConfig
    batching: BatchingConfig = BatchingConfig()
    scheduling: SchedulingConfig = SchedulingConfig()
    limits: LimitsConfig = LimitsConfig()
    delivery: DeliveryConfig = DeliveryConfig()
    warmup: WarmupConfig = WarmupConfig()
    metrics: MetricsConfig = MetricsConfig()
    inputs: Mapping[str, InputConfig] = field(default_factory=dict)
    outputs: Mapping[str, OutputConfig] = field(default_factory=dict)
    pipeline: PipelineConfig | None = None
    source: Path | None = None  # the config file's folder, not a key


def sections() -> dict[str, dict[str, Key]]:
    """Every table of the config with its declared keys; NAME stands for any name."""
    provider = {**declared(ProviderConfig), **declared(ProviderOptions)}
    return {
        "redis": declared(RedisConfig),
        "model": declared(ModelConfig),
        **{
            f"model.{p}": {k: provider[k] for k in provider if k in PROVIDERS[p]} for p in PROVIDERS
        },
        "batching": declared(BatchingConfig),
        "scheduling": declared(SchedulingConfig),
        "limits": declared(LimitsConfig),
        "delivery": declared(DeliveryConfig),
        "warmup": declared(WarmupConfig),
        "metrics": declared(MetricsConfig),
        "inputs.NAME": declared(InputConfig),
        "outputs.NAME": declared(OutputConfig),
        "pipeline": declared(PipelineConfig),
        "worker": declared(WorkerTable),
    }


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> WorkerConfig:
    """Read a TOML file; ``REDIS_URL`` in ``environ`` (default: os.environ) overrides redis.url."""
    path = Path(path)
    env = os.environ if environ is None else environ
    return parse_config(read_toml(path), path.resolve().parent, redis_url=env.get("REDIS_URL"))


def read_toml(path: Path) -> dict[str, Any]:
    """The config file's tables; ConfigError when it cannot be read or is not TOML."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"Cannot read config file {path}: {exc.strerror}.") from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"Config file {path} is not valid TOML: {exc}.") from exc


def parse_config(
    data: Mapping[str, Any],
    base_dir: Path,
    redis_url: str | None = None,
    *,
    model_where: str = "model",
) -> WorkerConfig:
    """Build a WorkerConfig from parsed TOML; paths are relative to ``base_dir``.

    ``model_where`` is how errors name the model's table (``models[1]`` for a ``[[models]]``
    entry, whose per-model tables are then named under it: ``models[1].batching``)."""
    root = Table(data, "")
    # [worker] is the process's across its models (worker.config.served reads it)
    root.check_keys([*(f.name for f in fields(WorkerConfig) if f.name != "source"), "worker"])
    if "model" not in data:
        raise ConfigError("Config needs a [model] table (or a [[models]] array).")
    under = "" if model_where == "model" else f"{model_where}."

    def own(name: str) -> Table:  # a per-model table, named where its entry is
        return Table(data.get(name, {}), f"{under}{name}")

    return WorkerConfig(
        redis=_redis(root.table("redis"), redis_url),
        model=_model(Table(data["model"], model_where), base_dir),
        batching=own("batching").build(BatchingConfig),
        scheduling=root.table("scheduling").build(SchedulingConfig),
        limits=own("limits").build(LimitsConfig),
        delivery=own("delivery").build(DeliveryConfig),
        warmup=own("warmup").build(WarmupConfig),
        metrics=root.table("metrics").build(MetricsConfig),
        inputs={name: _input(t, name) for name, t in own("inputs").tables()},
        outputs={n: t.build(OutputConfig, name=n) for n, t in own("outputs").tables()},
        pipeline=own("pipeline").build(PipelineConfig) if "pipeline" in data else None,
        source=base_dir,
    )


def _redis(t: Table, url_override: str | None) -> RedisConfig:
    in_config = "url" in t.data
    if url_override:
        t = Table({**t.data, "url": url_override}, t.dotted)
    source = URL_FROM_ENV if url_override else URL_FROM_CONFIG if in_config else URL_FROM_DEFAULT
    config = replace(
        t.build(RedisConfig), url_from=source, url_overrode=bool(url_override) and in_config
    )
    problem = redis_url_problem(config.url)
    if problem is not None:
        where = "Config 'redis.url'"
        if url_override:
            what = "it overrides" if in_config else "read in place of"
            where = f"Environment variable REDIS_URL ({what} config 'redis.url')"
        raise ConfigError(f"{where} has value {shown_url(config.url)!r}: {problem}. {URL_FORMS}")
    return config


def _model(t: Table, base_dir: Path) -> ModelConfig:
    t.check_keys([*declared(ModelConfig), *PROVIDERS])
    values = t.read(ModelConfig)
    path = (base_dir / values.pop("path")).resolve()
    if not path.is_file():
        what = "which is not a file" if path.exists() else "which does not exist"
        raise ConfigError(
            f"Config '{t.where('path')}' points to {path}, {what}. Paths are relative to the "
            "config file."
        )
    names = values.pop("providers", declared(ModelConfig)["providers"].shown)
    for extra in set(PROVIDERS) - set(names):
        if extra in t.data:
            raise ConfigError(
                f"Config has [{t.where(extra)}] options but '{t.where('providers')}' does not list "
                f"{extra!r}. Add it to providers or remove the table."
            )
    providers = tuple(_provider(n, t.table(n), base_dir) for n in names)
    return ModelConfig(path=path, providers=providers, **values)


def _provider(name: str, t: Table, base_dir: Path) -> ProviderConfig:
    t.check_keys(PROVIDERS[name])
    options = t.read(ProviderOptions)
    if "engine_cache_path" in options:
        options["engine_cache_path"] = str((base_dir / options["engine_cache_path"]).resolve())
    config = ProviderConfig(name=name, options=options, **t.read(ProviderConfig))
    return replace(config, io_binding=True) if config.cuda_graph else config


def _input(t: Table, name: str) -> InputConfig:
    config = t.build(InputConfig, name=name)
    if config.min is not None and config.max is not None and config.min > config.max:
        raise ConfigError(
            f"Config '{t.where('min')}' ({config.min}) is above '{t.where('max')}' "
            f"({config.max}). Swap them."
        )
    return config
