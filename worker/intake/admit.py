"""Admission: what a stream entry becomes before it may join a batch.

``admit`` runs per entry on the reading thread: the ``rid`` (bad or missing: dead letter, no
reply key), the entry's fields (exactly ``rid`` and ``body``: contract section 2, v3), the size
limit before decoding, decoding (``producer/protocol/codec.py``), then
names, dtypes, shapes, rows and outputs against the schema. A body laid out byte for byte like
one admitted before, but for its tensor data, skips decoding and those checks
(``layouts.py``). Values (ranges, NaN, infinity) are the other half of admission: the schema
screens them per batch once it is assembled for its run (``Schema.screen``), in one vectorised
pass that costs far less than a pass per request.

A request that fails either is refused with the contract's code and its own message, and never
reaches the runtime; one bad request never fails its batch. A refused or dead-lettered item keeps
its entry's id and shard but none of its fields: what a hostile producer sent (an extra field of
tens of MB, a body over the limit) is freed as soon as its read is admitted, not held until the
answer is written (the finish step's dead-letter copy reads the entry from Redis itself).
"""

from __future__ import annotations

import logging
import time

from producer.protocol.codec import decode_request
from producer.protocol.errors import WireFormatError
from producer.protocol.keys import is_valid_rid
from worker.errors import Rejected
from worker.intake.layouts import Layouts
from worker.intake.reclaim import Redelivery
from worker.items import Admitted, DeadLetter, Item, Refused
from worker.model.schema import Schema
from worker.redisio.cancels import CancelCheck
from worker.redisio.stream import RawEntry

__all__ = ["FIELDS_ALLOWANCE", "admit", "poisoned"]

log = logging.getLogger(__name__)

#: What an entry's fields may hold beyond ``max_request_bytes``: the rid (at most 128 bytes)
#: and the field names, with room to spare (contract section 2, v3: "a small fixed allowance").
FIELDS_ALLOWANCE = 4096
_FIELDS = (b"rid", b"body")  # the only fields a request carries
_NAMED_MOST = 5  # extra fields a refusal names one by one


def admit(
    entry: RawEntry,
    schema: Schema,
    max_request_bytes: int,
    deliveries: int = 1,
    layouts: Layouts | None = None,
    cancel: CancelCheck | None = None,
    max_element_bytes: int | None = None,
) -> Item:
    """Turn a raw entry into an item: admitted, refused with a code, or a dead letter.

    ``cancel`` is the cancel check of the read the entry came in (a fresh one when None).
    With ``layouts``, a body laid out like one admitted before skips decoding.
    """
    started = time.perf_counter()
    rid, reason = _rid(entry)
    if rid is None:
        return DeadLetter(
            _bare(entry), None, reason, decode_ms=_ms_since(started), deliveries=deliveries
        )
    deadline_ms: int | None = None
    meta_raw: bytes | None = None  # what is known of these when a check refuses the request
    reply_ttl_s: int | None = None
    try:
        fields = entry.fields
        if len(fields) != 2 or b"body" not in fields:  # one test on the hot path
            _check_fields(fields, max_request_bytes)
        body = fields.get(b"body")
        if body is None:
            raise Rejected("MALFORMED", "the stream entry has no 'body' field.")
        known = layouts.match(body) if layouts is not None else None
        if known is not None:
            request, reply_ttl_s, deadline_ms = known
        else:
            try:
                decoded = decode_request(body, max_request_bytes, max_element_bytes)
            except WireFormatError as exc:
                meta_raw, reply_ttl_s = exc.meta_raw, exc.reply_ttl_s
                raise Rejected(exc.code, exc.message) from exc
            deadline_ms = decoded.deadline_ms
            meta_raw = decoded.meta_raw
            reply_ttl_s = decoded.reply_ttl_s
            request = schema.validate(decoded)
            if layouts is not None:
                layouts.learn(body, decoded, request)
    except Rejected as exc:
        error = _detached(exc)
        bare = _bare(entry)
        return Refused(bare, rid, error, meta_raw, reply_ttl_s, _ms_since(started), deliveries)
    except Exception:  # a decoder bug must fail this request only, never stop the reading thread
        log.exception("unexpected error decoding entry %s", entry.entry_id.decode())
        error = Rejected(
            "INTERNAL", "the worker could not decode this request (a worker bug; it is logged)."
        )
        bare = _bare(entry)
        return Refused(bare, rid, error, meta_raw, reply_ttl_s, _ms_since(started), deliveries)
    return Admitted(
        entry,
        rid,
        request,
        cancel if cancel is not None else CancelCheck(),
        deadline_ms,
        meta_raw,
        reply_ttl_s,
        _ms_since(started),
        deliveries,
    )


def poisoned(redelivery: Redelivery, max_deliveries: int) -> DeadLetter:
    """An entry delivered ``max_deliveries`` times: dead-letter it, never run it again."""
    entry = redelivery.claimed.entry
    assert entry is not None
    rid, _ = _rid(entry)
    times = redelivery.deliveries - 1
    reason = (
        f"delivered {times} times without an answer (max_deliveries {max_deliveries}); "
        f"last held by consumer {redelivery.previous_consumer!r}"
    )
    error = None
    if rid is not None:
        error = Rejected(
            "POISONED",
            f"the request was delivered {times} times and each time its worker stopped before "
            f"answering (max_deliveries {max_deliveries}); it was moved to the dead-letter "
            "stream and was not run again.",
        )
    return DeadLetter(_bare(entry), rid, reason, error, deliveries=redelivery.deliveries)


def _bare(entry: RawEntry) -> RawEntry:
    """The entry without its fields: all that answering or dead-lettering it needs (its id,
    shard and lane), so that a refused entry's bytes are not held until its answer is written."""
    return RawEntry(entry.entry_id, {}, entry.shard, entry.lane)


def _detached(exc: Rejected) -> Rejected:
    """The refusal without its traceback and causes: their frames hold the entry and its body,
    which the refused item must not keep alive until its answer is written."""
    exc.__cause__ = exc.__context__ = None
    return exc.with_traceback(None)


def _check_fields(fields: dict[bytes, bytes], max_request_bytes: int) -> None:
    """Refuse an entry with fields other than ``rid`` and ``body`` as ``MALFORMED`` (contract
    section 2, v3), naming them, their sizes and, when they are over it, the size limit. A
    body alone over ``max_request_bytes`` is left to the decoder (``TOO_LARGE``)."""
    extra = [name for name in fields if name not in _FIELDS]
    if not extra:
        return  # no body: the caller's own check says so
    named = ", ".join(f"{_field_name(n)} ({len(fields[n]):,} bytes)" for n in extra[:_NAMED_MOST])
    if len(extra) > _NAMED_MOST:
        named += f" and {len(extra) - _NAMED_MOST:,} more"
    message = f"the stream entry has fields other than 'rid' and 'body': {named}"
    total = sum(len(name) + len(value) for name, value in fields.items())
    limit = max_request_bytes + FIELDS_ALLOWANCE
    if total > limit:
        message += (
            f"; its fields total {total:,} bytes, over the limit of {limit:,} "
            f"(max_request_bytes {max_request_bytes:,} plus {FIELDS_ALLOWANCE:,} for the rid and "
            "field names)"
        )
    raise Rejected(
        "MALFORMED",
        f"{message}. A request is exactly those two fields (docs/protocol.md section 2); send the "
        "request's data in 'body' only, as the client library does.",
    )


def _field_name(name: bytes) -> str:
    """A field's name for a message: quoted, and cut short when long."""
    shown = repr(name[:64].decode("utf-8", "replace"))
    return shown + "..." if len(name) > 64 else shown


def _rid(entry: RawEntry) -> tuple[str | None, str]:
    """The entry's rid, or None and why it cannot name a reply key."""
    raw_rid = entry.fields.get(b"rid")
    rid = raw_rid.decode("ascii", "replace") if raw_rid is not None else None
    if rid is not None and is_valid_rid(rid):
        return rid, ""
    if rid is None:
        return None, "entry has no 'rid' field"
    return None, (
        f"rid {rid[:140]!r} does not match [A-Za-z0-9_.:-]{{1,128}}; no reply key is written for it"
    )


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000.0
