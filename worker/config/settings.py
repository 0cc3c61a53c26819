"""The worker's TOML config, read once at the edge into frozen dataclasses.

Unknown keys and bad values raise ``ConfigError`` naming the dotted key, what it holds and what
would be valid, before anything touches Redis or the model.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from producer.protocol.keys import DEFAULT_PREFIX, is_valid_model_name, is_valid_prefix
from producer.redisio.connection import redact_url
from worker.config.redisurl import URL_FORMS, redis_url_problem
from worker.config.table import Table
from worker.errors import ConfigError

__all__ = [
    "PROVIDERS",
    "BatchingConfig",
    "DeliveryConfig",
    "InputConfig",
    "LimitsConfig",
    "MetricsConfig",
    "ModelConfig",
    "OutputConfig",
    "PipelineConfig",
    "ProviderConfig",
    "RedisConfig",
    "WarmupConfig",
    "WorkerConfig",
    "load_config",
    "parse_config",
]

#: Provider short names accepted in ``model.providers``, with their option keys.
PROVIDERS: dict[str, frozenset[str]] = {
    "cpu": frozenset({"require"}),
    "cuda": frozenset(
        {
            "require",
            "device_id",
            "gpu_mem_limit",
            "arena_extend_strategy",
            "io_binding",
            "cuda_graph",
        }
    ),
    "tensorrt": frozenset({"require", "device_id", "engine_cache_path", "fp16"}),
}
_ARENA_STRATEGIES = ("kNextPowerOfTwo", "kSameAsRequested")
_SHA256_RE = re.compile(r"[0-9A-Fa-f]{64}")


_MAX_REPLY_TTL_S = 10 * 365 * 24 * 3600  # delivery.reply_ttl_s
# Longer durations are typos. A huge claim_idle_ms (1e14) overflowed the lease keeper's
# thread wait, which killed it silently, and the worker served on with no lease renewal.
_MAX_CLAIM_IDLE_MS = 24 * 3600 * 1000  # delivery.claim_idle_ms
_MAX_RUN_S = 24 * 3600.0  # delivery.max_run_s


@dataclass(frozen=True, slots=True)
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = DEFAULT_PREFIX


@dataclass(frozen=True, slots=True)
class ProviderConfig:
    """One execution provider, in order of preference, with its options."""

    name: str
    require: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)
    io_binding: bool = False  # bound, preallocated device buffers per batch bucket (cuda)
    cuda_graph: bool = False  # one captured CUDA graph per bucket size; implies io_binding


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    path: Path
    version: str = "1"
    providers: tuple[ProviderConfig, ...] = (ProviderConfig("cpu"),)
    intra_op_threads: int = 0
    inter_op_threads: int = 0
    allow_spinning: bool = False
    sha256: str | None = None  # the pinned file hash, lowercase hex; None pins nothing


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    max_batch_size: int = 32
    max_wait_ms: float = 5.0
    adaptive_wait: bool = True


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    max_request_bytes: int = 16 * 1024 * 1024
    reject_non_finite: bool = True
    max_element_bytes: int = 16 * 1024 * 1024  # each element of a string or bytes tensor


@dataclass(frozen=True, slots=True)
class DeliveryConfig:
    claim_idle_ms: int = 30_000
    max_deliveries: int = 3
    reply_ttl_s: int = 3600
    max_run_s: float = 300.0


@dataclass(frozen=True, slots=True)
class WarmupConfig:
    runs: int = 5


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    port: int = 0
    host: str = "0.0.0.0"  # every interface, so that probes and Prometheus reach a container


@dataclass(frozen=True, slots=True)
class InputConfig:
    """Per-input checks and warmup hints from ``[inputs.NAME]``."""

    name: str
    min: float | None = None
    max: float | None = None
    warmup_shape: tuple[int, ...] | None = None
    batch_axis: int | None = 0  # the axis rows are on; None: the input has no rows ("none")


@dataclass(frozen=True, slots=True)
class OutputConfig:
    """Per-output settings from ``[outputs.NAME]``."""

    name: str
    batch_axis: int | None = 0


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """``[pipeline]``: the handler whose hooks run before and after the model (contract 6)."""

    handler: str  # "module:attribute"
    threads: int = 1
    timeout_s: float = 30.0  # a hook call past this is abandoned (worker/pipeline/hookpool.py)
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    redis: RedisConfig
    model: ModelConfig
    batching: BatchingConfig = BatchingConfig()
    limits: LimitsConfig = LimitsConfig()
    delivery: DeliveryConfig = DeliveryConfig()
    warmup: WarmupConfig = WarmupConfig()
    metrics: MetricsConfig = MetricsConfig()
    inputs: Mapping[str, InputConfig] = field(default_factory=dict)
    outputs: Mapping[str, OutputConfig] = field(default_factory=dict)
    pipeline: PipelineConfig | None = None
    source: Path | None = None


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> WorkerConfig:
    """Read a TOML file; ``REDIS_URL`` in ``environ`` (default: os.environ) overrides redis.url."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"Cannot read config file {path}: {exc.strerror}.") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"Config file {path} is not valid TOML: {exc}.") from exc
    env = os.environ if environ is None else environ
    return parse_config(data, base_dir=path.resolve().parent, redis_url=env.get("REDIS_URL"))


def parse_config(
    data: Mapping[str, Any], base_dir: Path, redis_url: str | None = None
) -> WorkerConfig:
    """Build a WorkerConfig from parsed TOML; paths are relative to ``base_dir``."""
    root = Table(data, "")
    root.check_keys(
        {
            "redis",
            "model",
            "batching",
            "limits",
            "delivery",
            "warmup",
            "metrics",
            "inputs",
            "outputs",
            "pipeline",
        }
    )
    return WorkerConfig(
        redis=_redis(root.table("redis"), redis_url),
        model=_model(root.table("model", required=True), base_dir),
        batching=_batching(root.table("batching")),
        limits=_limits(root.table("limits")),
        delivery=_delivery(root.table("delivery")),
        warmup=_warmup(root.table("warmup")),
        metrics=_metrics(root.table("metrics")),
        inputs=_inputs(root.table("inputs")),
        outputs=_outputs(root.table("outputs")),
        pipeline=_pipeline(root.table("pipeline")) if "pipeline" in root.data else None,
        source=base_dir,
    )


def _redis(t: Table, url_override: str | None) -> RedisConfig:
    t.check_keys({"url", "prefix"})
    url = url_override or t.get_str("url", _default(RedisConfig, "url"))
    where = (
        "Environment variable REDIS_URL (it overrides config 'redis.url')"
        if url_override
        else "Config 'redis.url'"
    )
    problem = redis_url_problem(url)
    if problem is not None:
        raise ConfigError(f"{where} has value {redact_url(url)!r}: {problem}. {URL_FORMS}")
    prefix = t.get_str("prefix", _default(RedisConfig, "prefix"))
    if not is_valid_prefix(prefix):
        raise ConfigError(
            f"Config 'redis.prefix' has value {prefix!r}. Use a non-empty name without braces "
            "or spaces."
        )
    return RedisConfig(url=url, prefix=prefix)


def _model(t: Table, base_dir: Path) -> ModelConfig:
    t.check_keys(
        {
            "name",
            "path",
            "version",
            "providers",
            "intra_op_threads",
            "inter_op_threads",
            "allow_spinning",
            "sha256",
            *PROVIDERS,
        }
    )
    name = t.get_str("name", None)
    if not is_valid_model_name(name):
        raise ConfigError(
            f"Config 'model.name' has value {name!r}. Use 1 to 64 of A-Z a-z 0-9 _ . -"
        )
    path = (base_dir / t.get_str("path", None)).resolve()
    if not path.is_file():
        what = "which is not a file" if path.exists() else "which does not exist"
        raise ConfigError(
            f"Config 'model.path' points to {path}, {what}. Paths are relative to the config file."
        )
    names = t.get_str_list("providers", [p.name for p in _default(ModelConfig, "providers")])
    if not names:
        raise ConfigError("Config 'model.providers' is empty. List at least one, e.g. ['cpu'].")
    for n in names:
        if n not in PROVIDERS:
            raise ConfigError(
                f"Config 'model.providers' has {n!r}. Valid providers: {', '.join(PROVIDERS)}."
            )
    for extra in set(PROVIDERS) - set(names):
        if extra in t.data:
            raise ConfigError(
                f"Config has [model.{extra}] options but 'model.providers' does not list "
                f"{extra!r}. Add it to providers or remove the table."
            )
    providers = tuple(_provider(n, t.table(n), base_dir) for n in names)
    version = t.data.get("version", _default(ModelConfig, "version"))
    if not isinstance(version, str | int) or isinstance(version, bool):
        raise ConfigError(f"Config 'model.version' has value {version!r}. Use a string.")
    if not str(version).strip() or not str(version).isprintable():
        raise ConfigError(
            f"Config 'model.version' has value {version!r}. Use a non-empty printable string "
            "such as '2', and change it with every model file: replies, metrics and status "
            "name it."
        )
    d = _defaults(ModelConfig)
    return ModelConfig(
        name=name,
        path=path,
        version=str(version),
        providers=providers,
        intra_op_threads=t.get_int("intra_op_threads", d["intra_op_threads"], minimum=0),
        inter_op_threads=t.get_int("inter_op_threads", d["inter_op_threads"], minimum=0),
        allow_spinning=t.get_bool("allow_spinning", d["allow_spinning"]),
        sha256=_sha256(t),
    )


def _sha256(t: Table) -> str | None:
    """The pinned model hash, so a swapped or corrupted file is refused rather than served."""
    if "sha256" not in t.data:
        return None
    value = t.get_str("sha256", None)
    if _SHA256_RE.fullmatch(value) is None:
        raise ConfigError(
            f"Config 'model.sha256' has value {value!r}. Use the model file's SHA-256 as 64 "
            "hex digits, as 'sha256sum FILE' prints it."
        )
    return value.lower()


def _provider(name: str, t: Table, base_dir: Path) -> ProviderConfig:
    t.check_keys(PROVIDERS[name])
    options: dict[str, Any] = {}
    if "device_id" in t.data:
        options["device_id"] = t.get_int("device_id", None, minimum=0)
    if "gpu_mem_limit" in t.data:
        options["gpu_mem_limit"] = t.get_int("gpu_mem_limit", None, minimum=1)
    if "arena_extend_strategy" in t.data:
        strategy = t.get_str("arena_extend_strategy", None)
        if strategy not in _ARENA_STRATEGIES:
            raise ConfigError(
                f"Config '{t.where('arena_extend_strategy')}' has value {strategy!r}. "
                f"Valid values: {', '.join(_ARENA_STRATEGIES)}."
            )
        options["arena_extend_strategy"] = strategy
    if "engine_cache_path" in t.data:
        options["engine_cache_path"] = str(
            (base_dir / t.get_str("engine_cache_path", None)).resolve()
        )
    if "fp16" in t.data:
        options["fp16"] = t.get_bool("fp16", None)
    d = _defaults(ProviderConfig)
    cuda_graph = t.get_bool("cuda_graph", d["cuda_graph"])
    return ProviderConfig(
        name=name,
        require=t.get_bool("require", d["require"]),
        options=options,
        io_binding=t.get_bool("io_binding", d["io_binding"]) or cuda_graph,
        cuda_graph=cuda_graph,
    )


def _batching(t: Table) -> BatchingConfig:
    t.check_keys({"max_batch_size", "max_wait_ms", "adaptive_wait"})
    d = _defaults(BatchingConfig)
    return BatchingConfig(
        max_batch_size=t.get_int(
            "max_batch_size", d["max_batch_size"], minimum=1, maximum=1_000_000
        ),
        max_wait_ms=t.get_number("max_wait_ms", d["max_wait_ms"], minimum=0.0, maximum=60_000.0),
        adaptive_wait=t.get_bool("adaptive_wait", d["adaptive_wait"]),
    )


def _limits(t: Table) -> LimitsConfig:
    t.check_keys({"max_request_bytes", "reject_non_finite", "max_element_bytes"})
    d = _defaults(LimitsConfig)
    return LimitsConfig(
        max_request_bytes=t.get_int(
            "max_request_bytes", d["max_request_bytes"], minimum=64, maximum=2**31
        ),
        reject_non_finite=t.get_bool("reject_non_finite", d["reject_non_finite"]),
        max_element_bytes=t.get_int(
            "max_element_bytes", d["max_element_bytes"], minimum=1, maximum=2**31
        ),
    )


def _delivery(t: Table) -> DeliveryConfig:
    t.check_keys({"claim_idle_ms", "max_deliveries", "reply_ttl_s", "max_run_s"})
    d = _defaults(DeliveryConfig)
    return DeliveryConfig(
        claim_idle_ms=t.get_int(
            "claim_idle_ms", d["claim_idle_ms"], minimum=100, maximum=_MAX_CLAIM_IDLE_MS
        ),
        max_deliveries=t.get_int("max_deliveries", d["max_deliveries"], minimum=1),
        # Redis refuses an EXPIRE whose milliseconds overflow; ten years is past any use.
        reply_ttl_s=t.get_int("reply_ttl_s", d["reply_ttl_s"], minimum=1, maximum=_MAX_REPLY_TTL_S),
        max_run_s=t.get_number("max_run_s", d["max_run_s"], minimum=0.0, maximum=_MAX_RUN_S),
    )


def _warmup(t: Table) -> WarmupConfig:
    t.check_keys({"runs"})
    runs = t.get_int("runs", _default(WarmupConfig, "runs"), minimum=0, maximum=10_000)
    return WarmupConfig(runs=runs)


def _metrics(t: Table) -> MetricsConfig:
    t.check_keys({"port", "host"})
    host = t.get_str("host", _default(MetricsConfig, "host"))
    try:
        if host != "localhost":
            ipaddress.IPv4Address(host)
    except ValueError:
        raise ConfigError(
            f"Config '{t.where('host')}' has value {host!r}. Use the IPv4 address to listen on: "
            "0.0.0.0 (every interface), localhost, or one of this host's, such as 127.0.0.1."
        ) from None
    port = t.get_int("port", _default(MetricsConfig, "port"), minimum=0, maximum=65535)
    return MetricsConfig(port=port, host=host)


def _inputs(t: Table) -> dict[str, InputConfig]:
    result = {}
    for name in t.data:
        it = t.table(name)
        it.check_keys({"min", "max", "warmup_shape", "batch_axis"})
        lo = it.get_bound("min")
        hi = it.get_bound("max")
        if lo is not None and hi is not None and lo > hi:
            raise ConfigError(
                f"Config '{it.where('min')}' ({lo}) is above '{it.where('max')}' ({hi}). Swap them."
            )
        shape = it.data.get("warmup_shape")
        if shape is not None and (
            not isinstance(shape, list) or not all(type(d) is int and d >= 1 for d in shape)
        ):
            raise ConfigError(
                f"Config '{it.where('warmup_shape')}' has value {shape!r}. Use a list of "
                "positive integers: the input's shape without its batch dimension."
            )
        result[name] = InputConfig(
            name=name,
            min=lo,
            max=hi,
            warmup_shape=None if shape is None else tuple(shape),
            batch_axis=it.get_batch_axis(),
        )
    return result


def _outputs(t: Table) -> dict[str, OutputConfig]:
    result = {}
    for name in t.data:
        ot = t.table(name)
        ot.check_keys({"batch_axis"})
        result[name] = OutputConfig(name=name, batch_axis=ot.get_batch_axis())
    return result


def _pipeline(t: Table) -> PipelineConfig:
    t.check_keys({"handler", "threads", "timeout_s", "options"})
    handler = t.get_str("handler", None)
    module, _, attribute = handler.partition(":")
    if (
        not module
        or not attribute
        or not all(part.isidentifier() for part in [*module.split("."), *attribute.split(".")])
    ):
        raise ConfigError(
            f"Config 'pipeline.handler' has value {handler!r}. Use module:attribute, such as "
            "'handlers:ImagePipeline' (handlers.py next to the config file, or a module on the "
            "worker's sys.path)."
        )
    options = t.data.get("options", {})
    if not isinstance(options, dict):
        raise ConfigError(
            f"Config 'pipeline.options' has value {options!r}. Use a table of the handler's "
            "keyword arguments: [pipeline.options]."
        )
    d = _defaults(PipelineConfig)
    return PipelineConfig(
        handler=handler,
        threads=t.get_int("threads", d["threads"], minimum=1, maximum=256),
        timeout_s=t.get_number("timeout_s", d["timeout_s"], minimum=0.001, maximum=_MAX_RUN_S),
        options=dict(options),
    )


def _defaults(cls: type) -> dict[str, Any]:
    """The field defaults of config dataclass ``cls``: each default is written once, there."""
    result = {}
    for f in fields(cls):
        if f.default is not MISSING:
            result[f.name] = f.default
        elif f.default_factory is not MISSING:
            result[f.name] = f.default_factory()
    return result


def _default(cls: type, name: str) -> Any:
    return _defaults(cls)[name]
