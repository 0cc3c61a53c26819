"""redbatch's producer library: send arrays to ONNX workers over Redis streams, get replies back.

``Client`` (blocking) and ``AsyncClient`` (asyncio) are thin drivers of one engine: the plans of
``producer.client.plans`` say what to send and what to wait for, over the sans-I/O state of
``producer.client.waiting`` and ``producer.client.mapwindow``. The wire format is
``producer.protocol.codec``, Redis outages are retried by ``producer.redisio.retry``, and every
error derives from ``RedbatchError``. ``AsyncClient`` is imported at first use, so that a
blocking program does not load the asyncio shell.
"""

from __future__ import annotations

import typing
from importlib import metadata

from producer.client.blocking import Client
from producer.client.results import Chunk, Result
from producer.protocol.codec import ErrorInfo, ModelRef
from producer.protocol.errors import (
    BacklogFull,
    Cancelled,
    ConnectionFailed,
    DeadlineExceeded,
    InferenceFailed,
    InternalError,
    InvalidInput,
    MalformedRequest,
    Misconfigured,
    NoWorkerInfo,
    Poisoned,
    RedbatchError,
    RedisFull,
    RedisUnavailable,
    RequestFailed,
    StreamExhausted,
    TooLarge,
    WaitTimeout,
    WireFormatError,
)

if typing.TYPE_CHECKING:
    from producer.client.aio import AsyncClient

try:
    __version__ = metadata.version("redbatch")
except metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "unknown"

__all__ = [
    "AsyncClient",
    "BacklogFull",
    "Cancelled",
    "Chunk",
    "Client",
    "ConnectionFailed",
    "DeadlineExceeded",
    "ErrorInfo",
    "InferenceFailed",
    "InternalError",
    "InvalidInput",
    "MalformedRequest",
    "Misconfigured",
    "ModelRef",
    "NoWorkerInfo",
    "Poisoned",
    "RedbatchError",
    "RedisFull",
    "RedisUnavailable",
    "RequestFailed",
    "Result",
    "StreamExhausted",
    "TooLarge",
    "WaitTimeout",
    "WireFormatError",
]


def __getattr__(name: str) -> typing.Any:
    """``AsyncClient``, imported at first use (PEP 562)."""
    if name == "AsyncClient":
        from producer.client.aio import AsyncClient

        globals()[name] = AsyncClient
        return AsyncClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "AsyncClient"})
