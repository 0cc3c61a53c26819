"""Redis key names: the one place that builds them.

Only names that passed their pattern are ever interpolated into a key, so a hostile request id
cannot address another key (contract section 1).
"""

from __future__ import annotations

import re

__all__ = [
    "CONSUMER_GROUP",
    "DEFAULT_PREFIX",
    "cancel_key",
    "dead_key",
    "is_valid_model_name",
    "is_valid_name",
    "is_valid_prefix",
    "is_valid_rid",
    "reply_key",
    "request_stream",
    "staging_key",
    "worker_key",
    "workers_key",
]

DEFAULT_PREFIX = "redbatch"
CONSUMER_GROUP = "workers"

_MODEL_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_RID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_NOT_IN_PREFIX = "{} \t\n"


def is_valid_model_name(name: str) -> bool:
    """True when ``name`` matches the contract's model-name pattern."""
    return isinstance(name, str) and _MODEL_RE.fullmatch(name) is not None


def is_valid_prefix(prefix: str) -> bool:
    """True for a key prefix: non-empty, without spaces, tabs, newlines or braces. A brace would
    start a Redis Cluster hash tag ahead of the model's ``{M}``, so a model's keys could land in
    other slots. It is the rule of the worker's ``redis.prefix`` and the CLI's ``--prefix``, so
    a prefix a client takes is one its workers take too."""
    return isinstance(prefix, str) and bool(prefix) and not any(c in prefix for c in _NOT_IN_PREFIX)


def is_valid_rid(rid: str) -> bool:
    """True when ``rid`` matches the contract's request-id pattern."""
    return _RID_RE.fullmatch(rid) is not None


# Worker (consumer) names go into registry keys, so they follow the request-id pattern too.
is_valid_name = is_valid_rid


def _check_model(model: str) -> None:
    if not is_valid_model_name(model):
        raise ValueError(f"Model name {model!r} does not match [A-Za-z0-9_.-]{{1,64}}.")


def _check_rid(rid: str) -> None:
    if not is_valid_rid(rid):
        raise ValueError(f"Request id {rid!r} does not match [A-Za-z0-9_.:-]{{1,128}}.")


def request_stream(prefix: str, model: str) -> str:
    """``P:{M}:requests``; the braces are a Redis Cluster hash tag."""
    _check_model(model)
    return f"{prefix}:{{{model}}}:requests"


def dead_key(prefix: str, model: str) -> str:
    """``P:{M}:dead``, the dead-letter stream."""
    _check_model(model)
    return f"{prefix}:{{{model}}}:dead"


def reply_key(prefix: str, rid: str) -> str:
    """``P:reply:R``, a list holding the single reply."""
    _check_rid(rid)
    return f"{prefix}:reply:{rid}"


def cancel_key(prefix: str, rid: str) -> str:
    """``P:cancel:R``, set by a caller to cancel a request."""
    _check_rid(rid)
    return f"{prefix}:cancel:{rid}"


def workers_key(prefix: str, model: str) -> str:
    """``P:{M}:workers``, the set of worker names that registered for the model."""
    _check_model(model)
    return f"{prefix}:{{{model}}}:workers"


def worker_key(prefix: str, model: str, name: str) -> str:
    """``P:{M}:worker:NAME``, one worker's validation record; heartbeats renew its TTL."""
    _check_model(model)
    if not is_valid_name(name):
        raise ValueError(f"Worker name {name!r} does not match [A-Za-z0-9_.:-]{{1,128}}.")
    return f"{prefix}:{{{model}}}:worker:{name}"


def staging_key(prefix: str, model: str, name: str, serial: str) -> str:
    """``P:{M}:staging:NAME:SERIAL``, a reply of worker NAME on its way to its reply key."""
    _check_model(model)
    if not is_valid_name(name):
        raise ValueError(f"Worker name {name!r} does not match [A-Za-z0-9_.:-]{{1,128}}.")
    return f"{prefix}:{{{model}}}:staging:{name}:{serial}"
