"""The oracle: which reply codes each fuzzed entry may get, predicted by running ``admit`` locally.

The contract's promise is that every input gets exactly one answer, whose code is OK (the
mutation happened to stay valid) or a client-error code, never INTERNAL and never nothing. On
top of that the worker must answer with the code ``admit`` and the batch's value screen predict.
"""

from __future__ import annotations

import time

from worker.items import Admitted, DeadLetter, Item, Refused
from worker.model.schema import Schema
from worker.redisio.stream import RawEntry

#: What admit may decide for a fuzzed entry ("DEAD": dead-lettered, its rid names no reply key).
ADMIT_CODES = frozenset({"OK", "MALFORMED", "INVALID_INPUT", "TOO_LARGE", "DEAD"})
#: Codes a worker may answer a fuzzed request with; INTERNAL or silence is always a failure.
WORKER_CODES = frozenset({"OK", "MALFORMED", "INVALID_INPUT", "TOO_LARGE", "DEADLINE_EXCEEDED"})


def outcome(item: Item) -> str:
    match item:
        case DeadLetter():
            return "DEAD"
        case Refused():
            return item.error.code
    return "OK"


def expected_codes(item: Item, schema: Schema, now_ms: int) -> frozenset[str]:
    """Codes the worker may answer ``item`` with, from admit, the value screen and the deadline."""
    code = outcome(item)
    if not isinstance(item, Admitted):
        return frozenset({code})
    if schema.screen(item.request.inputs, [item.request]):
        code = "INVALID_INPUT"
    deadline = item.deadline_ms
    if deadline is None or deadline > now_ms + 600_000:
        return frozenset({code})
    if deadline < now_ms:
        return frozenset({"DEADLINE_EXCEEDED", code})  # which check runs first is the worker's
    return frozenset({code, "DEADLINE_EXCEEDED"})  # near now: either is right


def raw_entry(rid: bytes, body: bytes | None) -> RawEntry:
    fields = {b"rid": rid} if body is None else {b"rid": rid, b"body": body}
    return RawEntry(b"%d-0" % int(time.time() * 1000), fields)
