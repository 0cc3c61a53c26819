"""redbatch's producer library: send arrays to ONNX workers over Redis streams, get replies back.

``Client`` (blocking) and ``AsyncClient`` (asyncio) are thin shells over one logic: the plans of
``producer.client.plans`` say what to send and what to wait for, over the sans-I/O state of
``producer.client.core`` and ``producer.client.window``. The wire format is
``producer.protocol.codec``, Redis outages
are retried by ``producer.redisio.retry``, and every error derives from ``RedbatchError``.
"""

from __future__ import annotations

from importlib import metadata

from producer.client.aio import AsyncClient
from producer.client.blocking import Client
from producer.client.core import Chunk, Result
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
    NoWorkerInfo,
    Poisoned,
    RedbatchError,
    RedisFull,
    RedisUnavailable,
    RequestFailed,
    TooLarge,
    WaitTimeout,
    WireFormatError,
)

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
    "ModelRef",
    "NoWorkerInfo",
    "Poisoned",
    "RedbatchError",
    "RedisFull",
    "RedisUnavailable",
    "RequestFailed",
    "Result",
    "TooLarge",
    "WaitTimeout",
    "WireFormatError",
]
