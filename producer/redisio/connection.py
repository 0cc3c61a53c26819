"""Where a client connects, said without passwords, and what its redis-py client must be.

Pure functions over URLs and a connection pool's settings, shared by the clients (``base``),
``redbatch status`` and the worker's configuration; ``core`` re-exports them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

__all__ = [
    "MAX_BLOCK_S",
    "block_cap_s",
    "block_s",
    "check_connection_kwargs",
    "describe_connection",
    "redact_url",
]

#: The longest single blocking command. redis-py's default socket timeout is 5 s, and a BLPOP that
#: outlasts the socket timeout fails, so long waits are made of several short blocks.
MAX_BLOCK_S = 2.0


def check_connection_kwargs(connection_kwargs: Mapping[str, Any]) -> None:
    """Refuse a redis-py client that decodes responses to text: bodies and replies are bytes."""
    if connection_kwargs.get("decode_responses"):
        raise ValueError(
            "The Redis client was created with decode_responses=True; redbatch needs raw bytes. "
            "Create it with decode_responses=False (the default)."
        )


def block_cap_s(socket_timeout_s: float | None) -> float:
    """The longest blocking command that cannot trip the connection's socket timeout."""
    if socket_timeout_s is None or socket_timeout_s <= 0:
        return MAX_BLOCK_S
    return min(MAX_BLOCK_S, socket_timeout_s / 2)


def redact_url(url: str) -> str:
    """``url`` without its password (in the authority or a ``password=`` query value)."""
    if "://" not in url:  # not a URL (redis//host, host:port): as written, less a password
        return _as_written(url)
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:  # a bad port or host: shown as written, less what could be a password
        return _as_written(url)
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{port}" if port is not None else "")
    if parts.username:
        netloc = f"{parts.username}@{netloc}"
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "password"])
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def _as_written(url: str) -> str:
    """``url`` exactly as written but for what could be a password: everything before the
    authority's last ``@``, and ``password=`` query values."""
    head, sep, rest = url.partition("://")
    if not sep:  # redis//host: the authority starts after "//"; host:port: at the start
        head, sep, rest = url.partition("//")
        if not sep:
            head, rest = "", url
    if "@" in rest:
        rest = "***@" + rest.rpartition("@")[2]
    return re.sub(r"([?&]password=)[^&#]*", r"\1***", head + sep + rest)


def describe_connection(connection_kwargs: Mapping[str, Any], tls: bool) -> str:
    """A URL-like description of a redis-py connection pool's settings, without a password."""
    if connection_kwargs.get("path"):
        return f"unix://{connection_kwargs['path']}?db={connection_kwargs.get('db', 0)}"
    scheme = "rediss" if tls else "redis"
    user = connection_kwargs.get("username")
    host = connection_kwargs.get("host", "localhost")
    port = connection_kwargs.get("port", 6379)
    db = connection_kwargs.get("db", 0)
    return f"{scheme}://{f'{user}@' if user else ''}{host}:{port}/{db}"


def block_s(until: float, now: float, cap_s: float) -> float:
    """Seconds a BLPOP should block to end by the monotonic ``until``: at most ``cap_s``, and
    never 0 (Redis counts in milliseconds, and a timeout of 0 would block forever)."""
    return max(round(min(until - now, cap_s), 3), 0.001)
