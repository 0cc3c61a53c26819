"""A request as a stream entry, and many of them packed for one round trip.

``build_submission`` encodes a request (``rid``, ``body``); ``pack_xadds`` packs submits as
``MULTI``/``EXEC`` transactions by hand (``producer.redisio.resp``), and ``check_xadds`` reads
their replies. Every ``XADD`` is ``XADD stream * rid R body B``: never a trimming option
(``MAXLEN``, ``MINID``) nor an explicit id, which would drop or block other producers'
requests (contract section 2).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from numpy.typing import ArrayLike
from redis.typing import EncodableT, FieldT

from producer.client.results import handle_of
from producer.client.settings import check_ttl_s, deadline_ms
from producer.protocol import codec, keys
from producer.protocol.errors import StreamExhausted
from producer.protocol.lanes import tenant_rid
from producer.redisio import resp

if TYPE_CHECKING:
    from producer.client.lanes import LaneChoice

__all__ = [
    "Submission",
    "Xadds",
    "build_submission",
    "build_submissions",
    "check_xadds",
    "is_exhausted",
    "pack_lane_xadds",
    "pack_xadds",
    "stream_exhausted",
]

log = logging.getLogger(__name__)

# Batches of submits go in transactions of at most this many entries or bytes (pack_xadds).
_MULTI = resp.command(b"MULTI")
_EXEC = resp.command(b"EXEC")
_TXN_ENTRIES = 256
_TXN_BYTES = 1 << 20
_WARNED: set[str] = set()  # warnings given once per process
_NO_SADDS: set[int] = set()  # the default lane's: ``_pack`` adds to it only with a lane set


@dataclass(slots=True)
class Submission:
    """One request ready for ``XADD P:{T}:requests * rid R body B``; ``tag`` is the shard it
    goes to, chosen when it is sent ("" until then); ``lane`` its class and tenant when not
    the default lane (``producer.client.lanes``: its stream on that shard instead)."""

    rid: str
    body: bytes
    tag: str = ""
    lane: LaneChoice | None = None

    @property
    def handle(self) -> str:
        """What ``submit`` returns: the rid on the model's first shard, else ``T/R``."""
        return handle_of(self.tag, self.rid)

    def fields(self) -> dict[FieldT, EncodableT]:
        """The stream entry's fields, in contract order."""
        return {"rid": self.rid, "body": self.body}


@dataclass(frozen=True, slots=True)
class Xadds:
    """``XADD``s packed for one round trip, and how their replies are laid out: ``blocks``
    holds each run of entries sent together, with whether it is a ``MULTI``/``EXEC``;
    ``sadds`` the indexes of the blocks whose transaction opens with a lane's ``SADD``."""

    packer: resp.Packer
    blocks: tuple[tuple[int, bool], ...]
    sadds: frozenset[int] = frozenset()


def pack_xadds(stream: str, subs: Sequence[Submission]) -> Xadds:
    """``XADD stream * rid R body B`` for each submission, for one round trip; two or more go
    in ``MULTI``/``EXEC`` transactions of at most ``_TXN_ENTRIES`` entries or about
    ``_TXN_BYTES`` of bodies.

    Redis serves a blocked ``XREADGROUP`` after each command it runs, so a plain pipeline of
    XADDs wakes a waiting worker after its first entry and the rest come in later reads, each
    with its own round trips and hand-over (docs/design.md). In a transaction the entries
    appear together, and are added whole or not at all. The cap keeps one transaction from
    holding Redis (and every worker's reads and finishes) for long.
    """
    packer = resp.Packer()
    blocks: list[tuple[int, bool]] = []
    _pack(packer, blocks, stream, subs, None, _NO_SADDS)
    return Xadds(packer, tuple(blocks))


def pack_lane_xadds(groups: Sequence[tuple[str, str | None, Sequence[Submission]]]) -> Xadds:
    """As ``pack_xadds``, for several streams of one shard: ``groups`` holds each stream, the
    lane set to add it to in each of its transactions (None: none, the default lane), and its
    submissions. A lane's entries always go in transactions, a single one too, each opening
    with ``SADD LANESET STREAM`` (contract section 7: the lane is registered in the same
    ``MULTI`` as its requests)."""
    packer = resp.Packer()
    blocks: list[tuple[int, bool]] = []
    sadds: set[int] = set()
    for stream, lane_set, subs in groups:
        _pack(packer, blocks, stream, subs, lane_set, sadds)
    return Xadds(packer, tuple(blocks), frozenset(sadds))


def _pack(
    packer: resp.Packer,
    blocks: list[tuple[int, bool]],
    stream: str,
    subs: Sequence[Submission],
    lane_set: str | None,
    sadds: set[int],
) -> None:
    """Pack ``subs`` to ``stream`` onto ``packer``, noting each block (and, with a
    ``lane_set``, each block's index in ``sadds``)."""
    key = stream.encode()
    lane_cmd = None if lane_set is None else resp.command(b"SADD", lane_set.encode(), key)
    i = 0
    while i < len(subs):
        j, size = i, 0
        while j < len(subs) and j - i < _TXN_ENTRIES and (j == i or size < _TXN_BYTES):
            size += len(subs[j].body)
            j += 1
        txn = j - i > 1 or lane_cmd is not None
        if txn:
            packer.add_packed(_MULTI)
        if lane_cmd is not None:
            sadds.add(len(blocks))
            packer.add_packed(lane_cmd)
        for sub in subs[i:j]:
            packer.add(b"XADD", key, b"*", b"rid", sub.rid.encode(), b"body", sub.body)
        if txn:
            packer.add_packed(_EXEC)
        blocks.append((j - i, txn))
        i = j


def check_xadds(xadds: Xadds, replies: Sequence[Any]) -> None:
    """Raise the first error among the replies of ``xadds``, as ``resp.raise_first_error``.

    A ``MULTI`` refused (a producer ACL without ``+multi``, from before transactions) does not
    start a transaction: Redis runs that block's XADDs one by one and refuses its ``EXEC``. The
    entries are then in the stream, so that is not an error; it is logged once. A block of a
    lane (in ``xadds.sadds``) has its ``SADD`` first: one more reply.
    """
    at, sadds = 0, xadds.sadds
    for n, (entries, txn) in enumerate(xadds.blocks):
        if not txn:
            resp.raise_first_error([replies[at]])
            at += 1
            continue
        count = entries + 1 if n in sadds else entries
        opened, added, done = replies[at], replies[at + 1 : at + 1 + count], replies[at + 1 + count]
        at += count + 2
        if isinstance(opened, Exception):
            _warn_no_multi(opened)
            resp.raise_first_error(list(added))
            continue
        resp.raise_first_error([*added, done])


def is_exhausted(exc: BaseException | None) -> bool:
    """True for Redis's refusal of an ``XADD *`` to a stream whose last id is the largest
    possible one."""
    return exc is not None and "exhausted the last possible ID" in str(exc)


def stream_exhausted(where: str, stream: str) -> StreamExhausted:
    """The error for an ``XADD`` refused because ``stream``'s id space is used up."""
    return StreamExhausted(
        f"Redis at {where} refused to add a request to {stream}: the stream has exhausted the "
        "last possible ID. Someone added an entry with the largest possible id (XADD with an "
        "explicit id 18446744073709551615-18446744073709551615), and no XADD * can succeed "
        "after it; nothing was sent, and retrying will not help. An operator must repair the "
        "stream: delete that entry, set the stream's last id back with XSETID, then the "
        f"group's with XGROUP SETID {stream} workers (docs/operations.md, 'A damaged stream')."
    )


def _warn_no_multi(exc: Exception) -> None:
    if "no multi" not in _WARNED:
        _WARNED.add("no multi")
        log.warning(
            "Redis refused MULTI (%s); submits are sent without transactions, so a waiting "
            "worker may read a batch in parts. Grant the producer user +multi +exec +discard "
            "(docs/security.md).",
            exc,
        )


def build_submission(
    inputs: Mapping[str, ArrayLike],
    *,
    outputs: Sequence[str] | None = None,
    deadline_s: float | None = None,
    meta: Any = None,
    rid: str | None = None,
    reply_ttl_s: int | None = None,
    now_s: float,
    lane: LaneChoice | None = None,
) -> Submission:
    """Encode one request; ``deadline_s`` is relative to ``now_s`` (Unix epoch seconds). A
    request of ``lane`` (None: the default lane) with a tenant gets a rid that begins with the
    tenant's name and a dot; a ``rid`` given must already."""
    if not isinstance(inputs, Mapping):
        raise TypeError(
            f"inputs must be a mapping of input name to array, got {type(inputs).__name__}."
        )
    if rid is None:
        rid = uuid.uuid4().hex
        if lane is not None and lane.tenant is not None:
            rid = tenant_rid(lane.tenant, rid)
    elif not isinstance(rid, str) or not keys.is_valid_rid(rid):
        raise ValueError(f"Request id {rid!r} does not match [A-Za-z0-9_.:-]{{1,128}}.")
    elif lane is not None and lane.tenant is not None and not rid.startswith(f"{lane.tenant}."):
        raise ValueError(
            f"Request id {rid!r} of tenant {lane.tenant!r} must begin with {lane.tenant + '.'!r}: "
            f"pass rid={lane.tenant + '.' + rid!r}, or leave rid out for a new one."
        )
    if reply_ttl_s is not None:
        check_ttl_s("reply_ttl_s", reply_ttl_s)
    if isinstance(outputs, str):
        raise ValueError(f"outputs must be a list of output names, got the string {outputs!r}.")
    body = codec.encode_request(
        inputs,
        outputs=outputs,
        deadline_ms=deadline_ms(deadline_s, now_s),
        meta=meta,
        reply_ttl_s=reply_ttl_s,
    )
    sub = Submission(rid, body)
    if lane is not None:
        sub.lane = lane
    return sub


def build_submissions(
    requests: Sequence[Mapping[str, ArrayLike]],
    *,
    outputs: Sequence[str] | None = None,
    deadline_s: float | None = None,
    meta: Any = None,
    reply_ttl_s: int | None = None,
    now_s: float,
    lane: LaneChoice | None = None,
) -> list[Submission]:
    """Encode many requests sharing their options and lane, each with its own new rid."""
    # A string or a single mapping iterates as names, which would fail deep in the encoder.
    if isinstance(requests, str | bytes | Mapping) or not isinstance(requests, Iterable):
        raise TypeError(
            "submit_many takes a list of requests, each a mapping of input name to array; got "
            f"{type(requests).__name__} (for one request, use submit)."
        )
    return [
        build_submission(
            inputs,
            outputs=outputs,
            deadline_s=deadline_s,
            meta=meta,
            reply_ttl_s=reply_ttl_s,
            now_s=now_s,
            lane=lane,
        )
        for inputs in requests
    ]
