"""Lanes (docs/protocol.md section 1, "Lanes"): one request stream per priority class and tenant
on each shard, so that interactive callers never queue behind batch jobs and a tenant confined
by an ACL to its own streams cannot touch another's.

A lane is ``(tag, class, tenant)``. Its stream is ``P:{T}:requests`` for class ``normal``
without a tenant (version 2's stream, which every producer of version 2 writes),
``P:{T}:requests:high`` and ``P:{T}:requests:low`` for the other classes without a tenant, and
``P:{T}:requests:C:N`` for tenant ``N`` in class ``C`` (the class always spelled out). A shard's
lane set ``P:{T}:lanes`` lists the full key names of its lane streams other than
``P:{T}:requests``; a producer adds its lane in the same ``MULTI`` as its request. A tenant's
request ids begin with ``N.``, so that an ACL pattern confines its replies and cancels too.

Everything here is pure: names built and parsed, nothing sent. A key that does not parse as a
lane of the shard it was listed for (``parse_lane``: junk in a lane set) is None, never an error:
workers skip it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from producer.protocol.keys import _check_model, _check_tag, is_valid_rid, request_stream

__all__ = [
    "CLASSES",
    "DEFAULT_CLASS",
    "Lane",
    "check_class",
    "check_tenant",
    "is_valid_tenant",
    "lane_stream",
    "lanes_key",
    "parse_lane",
    "tenant_of_rid",
    "tenant_rid",
    "weights_key",
]

#: The priority classes, highest first: a worker fills each batch in this order.
CLASSES = ("high", "normal", "low")
DEFAULT_CLASS = "normal"

_TENANT_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def is_valid_tenant(tenant: str) -> bool:
    """True for a tenant name: ``[A-Za-z0-9_-]{1,64}`` (no dot: its rids are ``N.`` then its
    own id)."""
    return isinstance(tenant, str) and _TENANT_RE.fullmatch(tenant) is not None


def check_class(cls: str) -> str:
    """``cls`` when it is a class; ValueError naming the three otherwise."""
    if cls not in CLASSES:
        raise ValueError(f"Priority {cls!r} is not a class: use one of {', '.join(CLASSES)}.")
    return cls


def check_tenant(tenant: str | None) -> str | None:
    """``tenant`` when None or a valid name; ValueError naming the pattern otherwise."""
    if tenant is not None and not is_valid_tenant(tenant):
        raise ValueError(f"Tenant {tenant!r} does not match [A-Za-z0-9_-]{{1,64}}.")
    return tenant


@dataclass(frozen=True, slots=True)
class Lane:
    """One lane of shard ``tag``: its class and tenant (None: no tenant)."""

    tag: str
    cls: str = DEFAULT_CLASS
    tenant: str | None = None

    @property
    def is_default(self) -> bool:
        """Version 2's stream ``P:{T}:requests``: class normal, no tenant; never in the set."""
        return self.cls == DEFAULT_CLASS and self.tenant is None

    def stream(self, prefix: str) -> str:
        return lane_stream(prefix, self.tag, self.cls, self.tenant)


def lane_stream(prefix: str, tag: str, cls: str = DEFAULT_CLASS, tenant: str | None = None) -> str:
    """The stream of class ``cls`` and ``tenant`` on shard ``tag``."""
    base = request_stream(prefix, tag)
    check_class(cls)
    if check_tenant(tenant) is not None:
        return f"{base}:{cls}:{tenant}"
    return base if cls == DEFAULT_CLASS else f"{base}:{cls}"


def lanes_key(prefix: str, tag: str) -> str:
    """``P:{T}:lanes``: the set of shard ``tag``'s lane streams other than ``P:{T}:requests``."""
    _check_tag(tag)
    return f"{prefix}:{{{tag}}}:lanes"


def weights_key(prefix: str, model: str) -> str:
    """``P:{M}:weights``: a hash of tenant to its positive integer weight (default 1)."""
    _check_model(model)
    return f"{prefix}:{{{model}}}:weights"


def parse_lane(prefix: str, tag: str, key: str | bytes) -> Lane | None:
    """The lane whose stream is ``key`` on shard ``tag``; None for anything else (another
    shard's stream, a malformed name, a key that is not a request stream at all)."""
    if isinstance(key, bytes):
        try:
            key = key.decode("utf-8")
        except UnicodeDecodeError:
            return None
    base = request_stream(prefix, tag)
    if key == base:
        return Lane(tag)
    if not key.startswith(base + ":"):
        return None
    cls, colon, tenant = key[len(base) + 1 :].partition(":")
    if cls not in CLASSES:
        return None
    if not colon:
        return None if cls == DEFAULT_CLASS else Lane(tag, cls)  # "...:requests:normal" is junk
    return Lane(tag, cls, tenant) if is_valid_tenant(tenant) else None


def tenant_rid(tenant: str | None, rid: str) -> str:
    """The request id a tenant's request carries: ``N.`` then ``rid`` (``rid`` itself without
    a tenant); ValueError when the result breaks the request-id pattern."""
    full = rid if check_tenant(tenant) is None else f"{tenant}.{rid}"
    if not is_valid_rid(full):
        raise ValueError(f"Request id {full!r} does not match [A-Za-z0-9_.:-]{{1,128}}.")
    return full


def tenant_of_rid(rid: str) -> str | None:
    """The tenant a request id names (its part before the first dot), if that is a tenant."""
    head, dot, _ = rid.partition(".")
    return head if dot and is_valid_tenant(head) else None
