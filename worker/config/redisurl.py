"""Checking a Redis URL as redis-py will read it, without connecting.

redis-py quietly serves db 0 for a path that is not a number, and fails only once the model is
loaded (a bad port) or at the first connection (a bad query option); checked at start, so the
worker stops before it loads the model, with a message that never shows the password.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

from redis.connection import Connection, parse_url

__all__ = ["URL_FORMS", "redis_url_problem", "shown_url"]

URL_FORMS = (
    "Use redis://[[user]:password@]host[:port][/db], rediss://... (TLS) or "
    "unix:///path/to/redis.sock[?db=N]."
)


def redis_url_problem(url: str) -> str | None:
    """What is wrong with ``url`` as redis-py reads it, or None; never connects.

    redis-py quietly serves db 0 for a path that is not a number, and fails only once the
    model is loaded (a bad port) or at the first connection (a bad query option): checked here
    so the worker stops before it loads the model.
    """
    if not url.startswith(("redis://", "rediss://", "unix://")):
        guess = _guess(shown_url(url))
        return "it does not start with redis://, rediss:// or unix://" + (
            f" (did you mean {guess!r}?)" if guess else ""
        )
    hint = "; a password with / ? # @ or : in it must be percent-encoded" if "@" in url else ""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        if "IPv6" in str(exc):
            return f"the host is not a valid [IPv6] address{hint}"
        return f"the port is not a number from 1 to 65535{hint}"
    path = unquote(parts.path)
    if parts.scheme == "unix":
        if not path:
            return "a unix:// URL needs the socket's absolute path after the third slash"
    else:
        if port == 0:
            return "the port is not a number from 1 to 65535"
        if path not in ("", "/") and re.fullmatch(r"/[0-9]+", path) is None:
            return f"the database (the path after the host) must be a number, such as /0{hint}"
    try:
        kwargs = parse_url(url)
        connection_class = kwargs.pop("connection_class", Connection)
        kwargs.pop("max_connections", None)  # the pool's, not the connection's
        connection_class(**kwargs)  # builds the connection object only; nothing is sent
    except TypeError as exc:
        unknown = re.search(r"argument '(\w+)'", str(exc))
        option = repr(unknown.group(1)) if unknown else "in it"
        return _scrub(f"the query option {option} is not a redis-py connection option here", url)
    except Exception as exc:  # redis-py's own checks: ?db=x, ?protocol=4
        return _scrub(str(exc).rstrip("."), url)
    return None


def shown_url(url: str) -> str:
    """``url`` exactly as written but for its password, for messages about a URL that may not
    parse: the password in the authority (everything before the last ``@`` but a user name)
    and ``password=`` query values become ``***``."""
    head, sep, rest = url.partition("://")
    if not sep:  # redis//host, host:port: the authority starts after "//", or at the start
        head, sep, rest = url.partition("//")
        if not sep:
            head, rest = "", url
    if "@" in rest:
        userinfo, _, host = rest.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        rest = f"{user}:***@{host}" if colon else f"***@{host}"
    return re.sub(r"([?&]password=)[^&#]*", r"\1***", head + sep + rest)


def _guess(shown: str) -> str | None:
    """The valid URL a near miss was likely meant to be: ``redis//h``, ``redis:/h``,
    ``REDIS://h`` or a bare ``host:port``; None when there is no likely one."""
    near = re.fullmatch(r"(?i)(rediss|redis|unix)(:/{0,3}|/{1,3})(?!/)(.+)", shown)
    if near is not None:
        scheme, rest = near.group(1).lower(), near.group(3)
        return f"unix:///{rest}" if scheme == "unix" else f"{scheme}://{rest}"
    if re.fullmatch(r"[\w.-]+:[0-9]{1,5}(/[0-9]+)?", shown):
        return f"redis://{shown}"
    return None


def _scrub(message: str, url: str) -> str:
    """``message`` with every quoted word that could be part of the URL's password hidden."""
    secret = url.partition("://")[2].rpartition("@")[0]
    secret += "".join(re.findall(r"[?&]password=([^&#]*)", url))
    return re.sub(r"'([^']+)'", lambda m: "'***'" if m.group(1) in secret else m.group(0), message)
