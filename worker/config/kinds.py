"""The kinds of value particular to the worker's keys; each problem is the fix it prints."""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from producer.protocol.keys import is_valid_model_name, is_valid_prefix
from worker.config.keys import Kind, kind, one_of

__all__ = [
    "ARENA_STRATEGY",
    "BATCH_AXIS",
    "HANDLER",
    "HANDLER_OPTIONS",
    "LISTEN_HOST",
    "MODEL_NAME",
    "PREFIX",
    "REPLY_BYTES",
    "SHA256",
    "SHAPE",
    "VERSION",
    "bound",
]


def _text(name: str, good: Callable[[str], Any], fix: str, convert: Callable = str) -> Kind:
    """A string kind: ``fix`` is printed for a value that is not a string, or not ``good``."""
    return kind(name, lambda v: isinstance(v, str) and good(v), fix, convert)


def _is_ipv4(value: str) -> bool:
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        return value == "localhost"
    return True


def _is_module_attribute(value: str) -> bool:
    module, _, attribute = value.partition(":")
    parts = [*module.split("."), *attribute.split(".")]
    return bool(module and attribute) and all(part.isidentifier() for part in parts)


def _is_version(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, str | int):
        return False
    return str(value).isprintable() and bool(str(value).strip())


ARENA_STRATEGY = one_of("kNextPowerOfTwo", "kSameAsRequested")  # model.cuda.arena_extend_strategy
PREFIX = _text(
    "name without braces or spaces",
    is_valid_prefix,
    "Use a non-empty name without braces or spaces.",
)
MODEL_NAME = _text("[A-Za-z0-9_.-]{1,64}", is_valid_model_name, "Use 1 to 64 of A-Z a-z 0-9 _ . -")
#: ``model.version``: a string, or an integer read as one.
VERSION = kind(
    "string",
    _is_version,
    "Use a non-empty printable string such as '2', and change it with every model file: "
    "replies, metrics and status name it.",
    str,
)
#: ``model.sha256``, kept lowercase as hashlib writes it.
SHA256 = _text(
    "64 hex digits",
    re.compile(r"[0-9A-Fa-f]{64}").fullmatch,
    "Use the model file's SHA-256 as 64 hex digits, as 'sha256sum FILE' prints it.",
    str.lower,
)
LISTEN_HOST = _text(
    "IPv4 address or localhost",
    _is_ipv4,
    "Use the IPv4 address to listen on: 0.0.0.0 (every interface), localhost, or one of this "
    "host's, such as 127.0.0.1.",
)
HANDLER = _text(
    "module:attribute",
    _is_module_attribute,
    "Use module:attribute, such as 'handlers:ImagePipeline' (handlers.py next to the config "
    "file, or a module on the worker's sys.path).",
)
HANDLER_OPTIONS = kind(
    "table",
    lambda v: isinstance(v, Mapping),
    "Use a table of the handler's keyword arguments: [pipeline.options].",
    dict,
)
SHAPE = kind(
    "list of positive integers",
    lambda v: isinstance(v, list) and all(type(d) is int and d >= 1 for d in v),
    "Use a list of positive integers: the input's shape without its batch dimension.",
    tuple,
)
BATCH_AXIS = kind(
    'axis 0 to 31, or "none"',
    lambda v: v == "none" or (type(v) is int and 0 <= v < 32),
    'Use the axis that holds the rows (0 to 31; 0 is the default) or "none" for an input or '
    "output without rows.",
    lambda v: None if v == "none" else v,
)


#: The smallest ``limits.max_reply_bytes``: an error reply (meta is up to 4 KiB) must still fit.
MIN_REPLY_BYTES = 65536
#: ``limits.max_reply_bytes``: 0 learns Redis's ``proto-max-bulk-len``.
REPLY_BYTES = kind(
    f"0 or an integer >= {MIN_REPLY_BYTES}",
    lambda v: type(v) is int and (v == 0 or MIN_REPLY_BYTES <= v <= 2**62),
    f"Use 0 (the worker reads Redis's proto-max-bulk-len) or the largest reply in bytes, "
    f"{MIN_REPLY_BYTES} or more, at most the server's proto-max-bulk-len.",
)


def bound(no_bound: float) -> Kind:
    """``inputs.NAME.min`` (``no_bound`` -inf) or ``.max`` (inf): infinity on its own side, like
    leaving it out, is no bound; NaN or infinity on the other side is an error."""

    def problem(value: Any) -> str | None:
        if type(value) not in (int, float):
            return "Use a number."
        if math.isfinite(value) or value == no_bound:
            return None
        why = "it would switch the range check off" if math.isnan(value) else "no value would pass"
        return (
            f"Not a bound: {why}. Use a finite number, or leave it out (or set {no_bound}) "
            "for no bound."
        )

    return Kind("number", problem, lambda v: None if v == no_bound else float(v))
