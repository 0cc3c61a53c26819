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
    "handle",
    "is_valid_model_name",
    "is_valid_name",
    "is_valid_prefix",
    "is_valid_rid",
    "is_valid_shard_key",
    "is_valid_tag",
    "model_of",
    "parse_handle",
    "reload_key",
    "reply_key",
    "request_stream",
    "retiring_key",
    "shard_tag",
    "shards_key",
    "staging_key",
    "worker_key",
    "workers_key",
]

DEFAULT_PREFIX = "redbatch"
CONSUMER_GROUP = "workers"

_MODEL_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_RID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_SHARD_RE = re.compile(r"[a-z0-9]{1,16}")
_TAG_RE = re.compile(r"([A-Za-z0-9_.-]{1,64})(?:~([a-z0-9]{1,16}))?")
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


def _check_name(name: str) -> None:
    if not is_valid_name(name):
        raise ValueError(f"Worker name {name!r} does not match [A-Za-z0-9_.:-]{{1,128}}.")


def is_valid_shard_key(key: str) -> bool:
    """True for the ``K`` of a shard tag ``M~K``: ``[a-z0-9]{1,16}``."""
    return isinstance(key, str) and _SHARD_RE.fullmatch(key) is not None


def is_valid_tag(tag: str) -> bool:
    """True for a shard tag: ``M`` (a model's first shard) or ``M~K``."""
    return isinstance(tag, str) and _TAG_RE.fullmatch(tag) is not None


def _check_tag(tag: str) -> None:
    if not is_valid_tag(tag):
        raise ValueError(
            f"Shard tag {tag!r} is neither a model name nor MODEL~K with K in [a-z0-9]{{1,16}}."
        )


def shard_tag(model: str, key: str | None = None) -> str:
    """``M`` for the model's first shard (``key`` None), ``M~K`` for another."""
    _check_model(model)
    if key is None:
        return model
    if not is_valid_shard_key(key):
        raise ValueError(f"Shard key {key!r} does not match [a-z0-9]{{1,16}}.")
    return f"{model}~{key}"


def model_of(tag: str) -> str:
    """The model a shard tag belongs to: ``M`` of ``M`` or ``M~K``."""
    _check_tag(tag)
    return tag.partition("~")[0]


def handle(tag: str, rid: str) -> str:
    """What ``submit`` returns: the rid for a model's first shard, ``T/R`` for another one.

    ``/`` is in neither pattern, so the split is unambiguous; a version 1 caller that kept rids
    keeps working on a model with one shard.
    """
    _check_tag(tag)
    _check_rid(rid)
    return rid if "~" not in tag else f"{tag}/{rid}"


def parse_handle(value: str, model: str) -> tuple[str, str]:
    """``(tag, rid)`` of a handle ``submit`` returned for ``model`` (or of a bare rid, which
    names the model's first shard); ValueError for a malformed one or another model's."""
    tag, slash, rid = value.rpartition("/")
    if not slash:
        tag = model
    _check_tag(tag)
    _check_rid(rid)
    if model_of(tag) != model:
        raise ValueError(
            f"Handle {value!r} names a shard of model {model_of(tag)!r}, not {model!r}."
        )
    return tag, rid


def request_stream(prefix: str, tag: str) -> str:
    """``P:{T}:requests``; the braces are a Redis Cluster hash tag (``T`` is a shard tag, the
    model's name for its first shard)."""
    _check_tag(tag)
    return f"{prefix}:{{{tag}}}:requests"


def dead_key(prefix: str, tag: str) -> str:
    """``P:{T}:dead``, the shard's dead-letter stream."""
    _check_tag(tag)
    return f"{prefix}:{{{tag}}}:dead"


def reply_key(prefix: str, tag: str, rid: str) -> str:
    """``P:{T}:reply:R``, a list holding the single reply, in the slot of the request's stream."""
    _check_tag(tag)
    _check_rid(rid)
    return f"{prefix}:{{{tag}}}:reply:{rid}"


def cancel_key(prefix: str, tag: str, rid: str) -> str:
    """``P:{T}:cancel:R``, set by a caller to cancel a request, in its stream's slot."""
    _check_tag(tag)
    _check_rid(rid)
    return f"{prefix}:{{{tag}}}:cancel:{rid}"


def shards_key(prefix: str, model: str) -> str:
    """``P:{M}:shards``: the model's shard tags in order, first ``M``; absent with one shard."""
    _check_model(model)
    return f"{prefix}:{{{model}}}:shards"


def retiring_key(prefix: str, model: str) -> str:
    """``P:{M}:retiring``: shard tags taken off the list that workers serve until drained."""
    _check_model(model)
    return f"{prefix}:{{{model}}}:retiring"


def workers_key(prefix: str, model: str) -> str:
    """``P:{M}:workers``, the set of worker names that registered for the model."""
    _check_model(model)
    return f"{prefix}:{{{model}}}:workers"


def worker_key(prefix: str, model: str, name: str) -> str:
    """``P:{M}:worker:NAME``, one worker's validation record; heartbeats renew its TTL."""
    _check_model(model)
    _check_name(name)
    return f"{prefix}:{{{model}}}:worker:{name}"


def reload_key(prefix: str, model: str, name: str) -> str:
    """``P:{M}:reload:NAME``, an operator's ask that worker NAME read its config again (as on
    SIGHUP); the worker takes it with ``GETDEL`` and answers in its record's ``reload``."""
    _check_model(model)
    _check_name(name)
    return f"{prefix}:{{{model}}}:reload:{name}"


def staging_key(prefix: str, tag: str, name: str, serial: str) -> str:
    """``P:{T}:staging:NAME:SERIAL``, a reply of worker NAME on its way to its reply key."""
    _check_tag(tag)
    _check_name(name)
    return f"{prefix}:{{{tag}}}:staging:{name}:{serial}"
