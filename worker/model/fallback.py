"""Providers asked for that the session does not run: say so once, at the right level, or refuse.

onnxruntime builds a session on the CPU alone, without raising, when CUDA or TensorRT cannot
start. The worker compares the providers ``model.providers`` lists with those the session runs
and decides here:

- a provider whose table says ``require = true`` stops the worker (ModelError);
- a list without ``"cpu"`` stops it when no listed provider started (ConfigError naming
  ``model.providers``): it asked for no CPU fallback, so serving on the CPU would hide it;
- else the fallback is one log line: INFO on a machine without a GPU, where it is expected
  (the shipped configs list ``["cuda", "cpu"]``), a WARNING where a GPU exists and CUDA failed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Sequence

from worker.config import ProviderConfig
from worker.errors import ConfigError, ModelError
from worker.model import gpu

__all__ = ["ORT_NAMES", "check_fallback", "log_unbound"]

log = logging.getLogger(__name__)

ORT_NAMES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
_WHY_NOT_STARTED = "CUDA/cuDNN libraries missing, or a driver too old for this onnxruntime"


def check_fallback(
    requested: Sequence[ProviderConfig], active: Sequence[str], not_built: Collection[str]
) -> None:
    """Refuse or report the listed providers the session does not run; ``active`` is the
    session's providers, ``not_built`` the short names this onnxruntime build lacks."""
    missing = [p for p in requested if ORT_NAMES[p.name] not in active]
    if not missing:
        return
    for p in missing:
        if p.require:
            raise ModelError(
                f"Provider {p.name!r} is required (model.{p.name}.require = true) but "
                f"onnxruntime could not start it on this machine ({_why(p.name, not_built)}). "
                "Fix the machine or drop require."
            )
    has_gpu = gpu.present()
    names = " and ".join(p.name for p in missing)
    if not any(ORT_NAMES[p.name] in active for p in requested):  # serving on the unlisted CPU
        listed = json.dumps([p.name for p in requested])
        why = "it has no GPU" if not has_gpu else _why(missing[0].name, not_built)
        raise ConfigError(
            f"Config 'model.providers' is {listed}, with no \"cpu\" to fall back to, but "
            f'{names} cannot start on this machine ({why}). Add "cpu" to model.providers to '
            "serve on the CPU, or run the worker where CUDA works."
        )
    if not has_gpu:
        log.info("no GPU here; serving on the CPU (%s in model.providers needs one)", names)
        return
    for p in missing:
        log.warning(
            "provider %s cannot start on this machine, which has a GPU (%s); serving with %s",
            p.name,
            _why(p.name, not_built),
            ", ".join(active),
        )


def log_unbound() -> None:
    """``[model.cuda]`` io_binding or cuda_graph without CUDA running: expected without a GPU."""
    level = logging.WARNING if gpu.present() else logging.INFO
    log.log(level, "io_binding and cuda_graph need the CUDA provider; running without them")


def _why(name: str, not_built: Collection[str]) -> str:
    if name in not_built:
        return "this onnxruntime build lacks it: install onnxruntime-gpu"
    return _WHY_NOT_STARTED
