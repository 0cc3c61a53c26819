"""Loading a pipeline's handler (docs/protocol.md section 11): import, construct, check
what it declares.

Everything here runs once at start, before warmup and before Redis is touched, and anything
wrong stops the worker with one line naming ``pipeline.handler`` and the fix. The handler's
module is looked up next to the config file first, then on ``sys.path``; its source file's
sha256 goes into the validation record and into every reply (``model.pipeline``), so that a
reply says exactly which preprocessing produced it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from producer.protocol.codec import BYTES, DTYPES, STRING, WIRE_DTYPES, PipelineRef
from worker.config import PipelineConfig
from worker.errors import ConfigError
from worker.model.tensorspec import TensorSpec

__all__ = ["Handler", "load_handler"]

_TEXT = {"string": STRING, "bytes": BYTES}


@dataclass(frozen=True, slots=True)
class Handler:
    """A constructed handler and what the worker needs to know of it."""

    obj: Any
    config: PipelineConfig
    source: Path | None
    sha256: str
    inputs: tuple[TensorSpec, ...]  # the raw inputs requests send
    outputs: tuple[TensorSpec, ...] | None  # the reply's outputs, when declared
    preprocess: Callable[[dict[str, np.ndarray]], Any] | None
    preprocess_batch: Callable[[list[dict[str, np.ndarray]]], Any] | None
    postprocess: Callable[..., Any] | None
    postprocess_batch: Callable[..., Any] | None
    post_takes_model_inputs: bool  # postprocess(outputs, inputs, model_inputs)

    @property
    def ref(self) -> PipelineRef:
        return PipelineRef(self.config.handler, self.sha256)

    @property
    def has_postprocess(self) -> bool:
        return self.postprocess is not None or self.postprocess_batch is not None

    def warmup_inputs(self) -> dict[str, np.ndarray] | None:
        """The handler's warmup request, or None when it has no ``warmup_inputs``."""
        make = getattr(self.obj, "warmup_inputs", None)
        return None if make is None else make()

    def record(self) -> dict[str, Any]:
        """The validation record's ``pipeline`` part."""
        return {
            "handler": self.config.handler,
            "source": None if self.source is None else str(self.source),
            "sha256": self.sha256,
            "options": dict(self.config.options),
            "threads": self.config.threads,
            "timeout_s": self.config.timeout_s,
            "postprocess": self.has_postprocess,
            "batch_hooks": [
                name
                for name, hook in (
                    ("preprocess_batch", self.preprocess_batch),
                    ("postprocess_batch", self.postprocess_batch),
                )
                if hook is not None
            ],
            "inputs": [_describe(s) for s in self.inputs],
            "outputs": None if self.outputs is None else [_describe(s) for s in self.outputs],
        }


def load_handler(config: PipelineConfig, config_dir: Path | None) -> Handler:
    """Import and build ``config.handler``; raise ConfigError naming the key and the fix."""
    module_name, _, attribute = config.handler.partition(":")
    module = _import(module_name, config_dir, config.handler)
    target: Any = module
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise _error(
                config.handler,
                f"module {module_name!r} has no attribute {attribute!r}",
                "name a class or factory defined in that module",
            )
    try:
        obj = target(**config.options)
    except Exception as exc:  # the handler's own constructor: anything may go wrong there
        raise _error(
            config.handler,
            f"building it with options {dict(config.options)!r} raised {type(exc).__name__}: {exc}",
            "fix [pipeline.options] or the handler's constructor",
        ) from exc
    source = _source_file(module)
    inputs = _specs(obj, "inputs", config.handler, required=True)
    assert inputs is not None
    preprocess = _hook(obj, "preprocess")
    preprocess_batch = _hook(obj, "preprocess_batch")
    if preprocess is None and preprocess_batch is None:
        raise _error(
            config.handler,
            "the handler has no preprocess(inputs) method",
            "add one: it turns one request's raw inputs into the model's inputs",
        )
    if any(s.dtype.kind == "O" for s in inputs) and _hook(obj, "warmup_inputs") is None:
        raise _error(
            config.handler,
            "it takes string or bytes inputs but has no warmup_inputs() method",
            "add warmup_inputs() returning one request's raw inputs (e.g. a small image), "
            "which warm up the whole pipeline before the worker serves",
        )
    postprocess = _hook(obj, "postprocess")
    return Handler(
        obj=obj,
        config=config,
        source=source,
        sha256=_sha256(source),
        inputs=inputs,
        outputs=_specs(obj, "outputs", config.handler, required=False),
        preprocess=preprocess,
        preprocess_batch=preprocess_batch,
        postprocess=postprocess,
        postprocess_batch=_hook(obj, "postprocess_batch"),
        post_takes_model_inputs=postprocess is not None and _takes_model_inputs(postprocess),
    )


def _import(module_name: str, config_dir: Path | None, handler: str) -> Any:
    """The handler's module: next to the config file first, then on ``sys.path``."""
    if config_dir is not None:
        local = config_dir.joinpath(*module_name.split("."))
        candidates = [local.with_suffix(".py"), local / "__init__.py"]
        found = next((p for p in candidates if p.is_file()), None)
        if found is not None:
            return _import_file(module_name, found, handler)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name.split(".", maxsplit=1)[0] and exc.name != module_name:
            raise _error(
                handler,
                f"importing {module_name!r} failed: it needs module {exc.name!r}, which is not "
                "installed",
                f"install {exc.name!r} on the worker's machine",
            ) from exc
        where = f"{config_dir}/{module_name.replace('.', '/')}.py" if config_dir else "the config"
        raise _error(
            handler,
            f"no module {module_name!r} next to the config file ({where}) or on the worker's "
            "sys.path",
            "put the handler's file next to the config file, or install its package",
        ) from exc
    except Exception as exc:
        raise _error(
            handler,
            f"importing {module_name!r} raised {type(exc).__name__}: {exc}",
            "fix the module",
        ) from exc


def _import_file(module_name: str, path: Path, handler: str) -> Any:
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        missing = f" (it needs module {exc.name!r})" if isinstance(exc, ImportError) else ""
        raise _error(
            handler,
            f"importing {path} raised {type(exc).__name__}: {exc}{missing}",
            "fix the module, or install what it imports on the worker's machine",
        ) from exc
    return module


def _source_file(module: Any) -> Path | None:
    try:
        name = inspect.getsourcefile(module)
    except TypeError:  # a built-in module
        return None
    return None if name is None else Path(name).resolve()


def _sha256(source: Path | None) -> str:
    """The handler's source file's sha256 ("" for a module without a source file)."""
    return "" if source is None else hashlib.sha256(source.read_bytes()).hexdigest()


def _hook(obj: Any, name: str) -> Callable[..., Any] | None:
    hook = getattr(obj, name, None)
    return hook if callable(hook) else None


def _takes_model_inputs(hook: Callable[..., Any]) -> bool:
    """Whether ``postprocess`` takes a third argument, the request's model inputs (ours, beyond
    docs/protocol.md section 11: mean pooling needs the attention mask the tokenizer made)."""
    try:
        params = list(inspect.signature(hook).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _specs(obj: Any, member: str, handler: str, required: bool) -> tuple[TensorSpec, ...] | None:
    """The handler's ``inputs`` or ``outputs``: name to {"dtype", "shape"}, as TensorSpecs."""
    declared = getattr(obj, member, None)
    if declared is None:
        if required:
            raise _error(
                handler,
                f"the handler has no {member!r}",
                f'declare {member} = {{"image": {{"dtype": "bytes", "shape": [-1]}}}}: each raw '
                "input's dtype and shape, the leading dimension its rows",
            )
        return None
    if not isinstance(declared, Mapping) or not declared:
        raise _error(
            handler,
            f"its {member!r} is {type(declared).__name__}, not a non-empty mapping",
            f"make {member} a dict of name to {{'dtype': ..., 'shape': [...]}}",
        )
    return tuple(_spec(name, value, member, handler) for name, value in declared.items())


def _spec(name: Any, value: Any, member: str, handler: str) -> TensorSpec:
    where = f"{member}[{name!r}]"
    if not isinstance(name, str) or not name:
        raise _error(handler, f"{member} has a name {name!r}", "use non-empty strings")
    if not isinstance(value, Mapping) or set(value) != {"dtype", "shape"}:
        raise _error(
            handler,
            f"{where} is {value!r}",
            'declare it as {"dtype": D, "shape": [...]} exactly',
        )
    dtype_name, shape = value["dtype"], value["shape"]
    if dtype_name not in WIRE_DTYPES:
        raise _error(
            handler, f"{where} has dtype {dtype_name!r}", f"use one of {', '.join(WIRE_DTYPES)}"
        )
    if (
        not isinstance(shape, list | tuple)
        or not shape
        or not all(type(d) is int and d >= -1 for d in shape)
    ):
        raise _error(
            handler,
            f"{where} has shape {shape!r}",
            "use a list of sizes, -1 for any size, whose first dimension is the rows, "
            "such as [-1] or [-1, 3]",
        )
    dims = tuple(None if d == -1 else d for d in shape)
    dtype = _TEXT.get(dtype_name) or DTYPES[dtype_name]
    return TensorSpec(name, dtype, dims)


def _describe(spec: TensorSpec) -> dict[str, Any]:
    meta = spec.dtype.metadata
    dtype = meta["wire"] if meta and "wire" in meta else str(spec.dtype)
    return {"name": spec.name, "dtype": dtype, "shape": spec.shape}


def _error(handler: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"Config 'pipeline.handler' ({handler!r}): {problem}; {fix}.")
