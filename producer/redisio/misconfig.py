"""Telling a misconfigured connection from an outage, and naming the fix.

An outage passes; a wrong setting does not, so retrying it only hides it (a worker that retries a
plain URL to a TLS port forever reports healthy; a client waits out its whole ``retry_s``). Some
mistakes show in the error itself: a certificate that does not verify, a TLS handshake answered
by a plain server, a refused password. Two look like an outage and need a look at the port:

- ``redis://`` to a TLS port: the server resets the connection at the first command, as a
  restarting Redis might. After such an error, and only while no command on that client has
  ever succeeded, a TLS handshake to the port (no verification, a short timeout) tells them
  apart.
- ``rediss://`` to a plain port: the server takes the TLS ClientHello for an unfinished inline
  command and says nothing, so the handshake waits out the socket timeout (forever, for a client
  without one). So before the first command of a ``rediss://`` client, one ``PING`` in plain text
  (a short timeout) asks whether the port speaks plain RESP.

Neither probe runs once a command has succeeded, so a healthy client's hot path never pays.
"""

from __future__ import annotations

import socket
import ssl
import threading
from urllib.parse import parse_qs, urlsplit

import redis.exceptions as rex

__all__ = [
    "FirstContact",
    "misconfiguration",
    "never_passes",
    "speaks_plain_redis",
    "speaks_tls",
]

PROBE_TIMEOUT_S = 1.0

# OpenSSL's words for a handshake answered by something that does not speak TLS.
_NOT_TLS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "HTTP_REQUEST")
# A handshake cut short: a plain server, or a TLS one (or load balancer) going away, which is an
# outage; only a plain PING answered there tells them apart.
_CUT_SHORT = ("UNEXPECTED_EOF",)
# A plain connection the server dropped at once: what a TLS port does with plain RESP.
_DROPPED = ("Connection reset by peer", "Connection closed by server", "Broken pipe")


def _endpoint(where: str) -> tuple[str, str, int, str | None, str | None]:
    """``(scheme, host, port, user, ssl_ca_certs)`` of a URL-like ``where``."""
    parts = urlsplit(where)
    ca = parse_qs(parts.query).get("ssl_ca_certs", [None])[0]
    try:
        port = parts.port or 6379
    except ValueError:
        port = 6379
    return parts.scheme, parts.hostname or "localhost", port, parts.username, ca


def misconfiguration(exc: BaseException, where: str) -> str | None:
    """A sentence naming the fix when ``exc`` shows a wrong setting rather than an outage (a
    refused password, a certificate that does not verify, TLS answered by a plain server);
    None otherwise. ``where`` is the URL without its password."""
    scheme, host, port, user, ca = _endpoint(where)
    text = str(exc)
    if isinstance(exc, rex.AuthenticationError):
        who = f"user {user!r}" if user else "the default user"
        return (
            f"Redis at {host}:{port} refused the password for {who} ({text.rstrip('.')}): put "
            "that user's password in the URL (redis://USER:PASSWORD@HOST:PORT/DB), or create "
            "the user (docs/security.md)."
        )
    if not isinstance(exc, rex.ConnectionError | ssl.SSLError):
        return None
    if "CERTIFICATE_VERIFY_FAILED" in text:
        given = f"you gave (ssl_ca_certs={ca})" if ca else "trusted (the system's; no ssl_ca_certs)"
        return (
            f"the certificate of the server at {host}:{port} does not verify against the CA "
            f"{given}: {text.rstrip('.')}. Pass the CA that signed it (?ssl_ca_certs=PATH in "
            "the URL)."
        )
    if scheme == "rediss" and any(word in text for word in _NOT_TLS):
        return _use_plain(host, port)
    if scheme == "rediss" and any(w in text for w in _CUT_SHORT) and speaks_plain_redis(host, port):
        return _use_plain(host, port)
    return None


def speaks_tls(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``host:port`` completes a TLS handshake (certificates are not checked)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as sock,
            context.wrap_socket(sock, server_hostname=host),
        ):
            return True
    except (OSError, ValueError):
        return False


def speaks_plain_redis(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``host:port`` answers a plain-text ``PING`` as Redis does (``+PONG``, or an
    error such as ``-NOAUTH``); a TLS port drops it or says nothing."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            first = sock.recv(1)
    except OSError:
        return False
    return first in (b"+", b"-")


def _use_plain(host: str, port: int) -> str:
    return (
        f"the server at {host}:{port} does not speak TLS: use redis:// instead of rediss:// "
        "(or turn TLS on in the server)."
    )


def _use_tls(host: str, port: int) -> str:
    return (
        f"the server at {host}:{port} speaks TLS only and dropped a plain connection: use "
        "rediss:// instead of redis:// (with ?ssl_ca_certs=PATH when its CA is not a system one)."
    )


class FirstContact:
    """What a client knows of its server before and after its first command succeeded.

    ``preflight()`` runs once, before the first command of a ``rediss://`` client (the plain
    probe); ``diagnose(exc)`` says what a failed command shows, probing the port only while no
    command ever succeeded; ``reached()`` marks that one did.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        scheme, self.host, self.port, _, _ = _endpoint(where)
        self.scheme = scheme
        self.ever_reached = scheme not in ("redis", "rediss")  # unix sockets: nothing to probe
        self._preflown = scheme != "rediss"
        self._lock = threading.Lock()

    def preflight(self) -> str | None:
        """Once, for ``rediss://``: the fix when the port speaks plain RESP; else None."""
        if self._preflown:
            return None
        with self._lock:
            if self._preflown:
                return None
            self._preflown = True
            if speaks_plain_redis(self.host, self.port):
                return _use_plain(self.host, self.port)
        return None

    def reached(self) -> None:
        self.ever_reached = True

    def diagnose(self, exc: BaseException) -> str | None:
        """The fix ``exc`` calls for, or None for what may be an outage."""
        found = misconfiguration(exc, self.where)
        if found is not None or self.ever_reached:
            return found
        if (
            self.scheme == "redis"
            and isinstance(exc, rex.ConnectionError)
            and any(word in str(exc) for word in _DROPPED)
            and speaks_tls(self.host, self.port)
        ):
            return _use_tls(self.host, self.port)
        return None


def never_passes(exc: BaseException) -> bool:
    """Connection errors that no retry fixes, whatever the URL: a certificate that does not
    verify, a TLS handshake answered by a plain server."""
    if not isinstance(exc, rex.ConnectionError | ssl.SSLError):
        return False
    text = str(exc)
    return "CERTIFICATE_VERIFY_FAILED" in text or any(w in text for w in _NOT_TLS[:2])
