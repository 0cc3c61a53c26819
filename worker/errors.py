"""Errors raised by the worker package.

::

    WorkerError                 root; never escapes the CLI as a traceback
    ├── ConfigError             the config file is wrong; names the dotted key and the fix
    ├── ModelError              the model cannot be loaded, batched or warmed up as configured
    ├── ModelUnavailable        a model of several cannot be loaded on demand; its batch fails
    └── Rejected                one request is answered with an error code instead of a result

``Rejected`` is the only one raised per request; it carries the contract code and never stops
the worker.
"""

from __future__ import annotations

__all__ = ["ConfigError", "ModelError", "ModelUnavailable", "Rejected", "WorkerError"]


class WorkerError(Exception):
    """Raised for every failure the worker reports; the root of the tree."""


class ConfigError(WorkerError):
    """Raised when a config key is unknown, missing or has a bad value."""


class ModelError(WorkerError):
    """Raised when the model file cannot be loaded, batched as configured, or warmed up."""


class Rejected(WorkerError):
    """Raised when one request must be answered with an error code rather than run."""

    def __init__(self, code: str, message: str, retryable: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable


class ModelUnavailable(WorkerError):
    """Raised when a model's session is not held and cannot be loaded now (several models in one
    worker, ``worker.model.held``): its batch is answered INTERNAL, retryable, and the worker
    goes on serving its other models."""
