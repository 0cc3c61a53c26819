"""The item variants: what admission makes of an entry, and the finish step each one becomes.

``Admitted``, ``Refused`` and ``DeadLetter`` each carry only what their answer needs; these
tests pin which variant an entry becomes, what it carries, and how ``worker.answer.answerer``
answers the ones that never reach the model, without Redis or a model file.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fuzzing import FuzzTarget, schema_for

from producer.protocol import codec
from producer.protocol.codec import ModelRef, decode_reply
from producer.protocol.replies import ReplyEncoder
from worker.answer import answerer as answerer_module
from worker.answer.answerer import Answerer
from worker.errors import Rejected
from worker.events import NO_EVENTS
from worker.intake.admit import admit, poisoned
from worker.intake.leases import Stuck
from worker.intake.reclaim import Redelivery
from worker.items import Admitted, DeadLetter, Item, Outcome, Refused
from worker.redisio.cancels import CancelCheck
from worker.redisio.claims import Claimed
from worker.redisio.stream import RawEntry

TARGET = FuzzTarget("demo", max_request_bytes=16384, max_batch_size=8)
SCHEMA = schema_for(TARGET)
ROW = {"features": np.zeros((2, 16), np.float32)}


def _entry(**fields: bytes) -> RawEntry:
    return RawEntry(b"1000-0", {k.encode(): v for k, v in fields.items()})


def _admit(entry: RawEntry, **kwargs: Any) -> Item:
    return admit(entry, SCHEMA, TARGET.max_request_bytes, **kwargs)


def test_a_valid_request_is_admitted_with_its_reads_check() -> None:
    check = CancelCheck()
    body = codec.encode_request(ROW, deadline_ms=2**40, reply_ttl_s=30, meta="m")
    item = _admit(_entry(rid=b"r1", body=body), cancel=check, deliveries=2)
    assert isinstance(item, Admitted)
    assert (item.rid, item.rows, item.deadline_ms, item.reply_ttl_s) == ("r1", 2, 2**40, 30)
    assert item.meta_raw == b"\xa1m"  # "m", as it was packed
    assert item.cancel is check
    assert item.alone  # delivered twice: it runs in a batch of its own
    assert item.decode_ms > 0


def test_an_entry_whose_rid_names_no_reply_key_is_a_dead_letter() -> None:
    missing = _admit(_entry(body=b"x"))
    bad = _admit(_entry(rid=b"no spaces", body=b"x"))
    for item in (missing, bad):
        assert isinstance(item, DeadLetter)
        assert (item.rid, item.error, item.rows) == (None, None, 0)
    assert isinstance(missing, DeadLetter)
    assert missing.reason == "entry has no 'rid' field"
    assert isinstance(bad, DeadLetter)
    assert "does not match" in bad.reason


def test_a_refused_request_keeps_what_its_reply_echoes() -> None:
    no_body = _admit(_entry(rid=b"r1"))
    assert isinstance(no_body, Refused)
    assert no_body.error.code == "MALFORMED"
    # a body refused after its meta and TTL were read keeps them for the reply
    wrong = codec.encode_request({"other": np.zeros((1, 2), np.float32)}, reply_ttl_s=5, meta=7)
    item = _admit(_entry(rid=b"r2", body=wrong))
    assert isinstance(item, Refused)
    assert (item.error.code, item.reply_ttl_s, item.meta_raw) == ("INVALID_INPUT", 5, b"\x07")
    assert item.rows == 0
    assert not item.alone


def test_a_bug_in_admission_refuses_that_request_internal_keeping_its_meta(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def buggy(_body: object) -> None:
        raise RuntimeError("a bug (test)")

    monkeypatch.setattr(SCHEMA, "validate", buggy)
    body = codec.encode_request(ROW, reply_ttl_s=9, meta="m")
    item = _admit(_entry(rid=b"r1", body=body))
    assert isinstance(item, Refused)
    assert item.error.code == "INTERNAL"
    assert (item.reply_ttl_s, item.meta_raw) == (9, b"\xa1m")


def _redelivery(rid: bytes, deliveries: int) -> Redelivery:
    entry = _entry(rid=rid, body=b"x")
    return Redelivery(Claimed(entry.entry_id, deliveries - 1, entry), deliveries, True, "gone-1")


def test_a_poisoned_entry_is_a_dead_letter_answered_when_it_has_a_rid() -> None:
    item = poisoned(_redelivery(b"r1", 4), max_deliveries=3)
    assert (item.rid, item.deliveries, item.alone) == ("r1", 4, True)
    assert item.error is not None
    assert item.error.code == "POISONED"
    assert "last held by consumer 'gone-1'" in item.reason
    nameless = poisoned(_redelivery(b"bad rid", 4), max_deliveries=3)
    assert (nameless.rid, nameless.error) == (None, None)
    assert nameless.reason == item.reason


def test_items_are_slotted_and_the_answered_ones_frozen() -> None:
    body = codec.encode_request(ROW)
    item = _admit(_entry(rid=b"r1", body=body), cancel=CancelCheck())
    assert isinstance(item, Admitted)
    assert not hasattr(item, "__dict__")  # slotted: built once per request, on the hot path
    refused = _admit(_entry(rid=b"r1"))  # no body: MALFORMED
    assert isinstance(refused, Refused)
    with pytest.raises(dataclasses.FrozenInstanceError):
        refused.rid = "r2"  # type: ignore[misc]
    assert not hasattr(refused, "__dict__")


# ---------------------------------------------------------------------------------------------
# Answered without a run


def _answerer(reply_ttl_s: int = 3600) -> Answerer:
    schema = SimpleNamespace(max_batch_size=8, fixed_batch=None, output_names=("probs", "label"))
    encoder = ReplyEncoder(ModelRef("demo", "1", "0" * 64), "w1")
    model = SimpleNamespace(padded_rows=None)
    return Answerer(model, schema, None, encoder, reply_ttl_s, NO_EVENTS, Stuck())  # type: ignore[arg-type]


def test_each_variant_that_does_not_run_becomes_its_finish_step() -> None:
    cancelled = CancelCheck()
    cancelled.answer({"c1"})
    request = SimpleNamespace(rows=1, signature=((16,),), outputs=("probs",))
    batch: list[Item] = [
        DeadLetter(_entry(), None, "entry has no 'rid' field"),
        DeadLetter(_entry(), "p1", "delivered 3 times", Rejected("POISONED", "p")),
        Refused(_entry(), "r1", Rejected("MALFORMED", "m"), meta_raw=b"\x07", reply_ttl_s=30),
        Admitted(_entry(), "c1", request, cancelled),  # type: ignore[arg-type]
        Admitted(_entry(), "d1", request, CancelCheck(), deadline_ms=1),  # type: ignore[arg-type]
    ]
    answered = _answerer(reply_ttl_s=600).answer(batch)
    nameless, poison, refused, cancel, late = answered.finishes
    assert (nameless.rid, nameless.reply, nameless.dead_reason, nameless.code) == (
        None,
        None,
        "entry has no 'rid' field",
        "DEAD_LETTER",
    )
    assert (poison.code, poison.dead_reason, poison.reply_ttl_s) == (
        "POISONED",
        "delivered 3 times",
        600,
    )
    assert (refused.code, refused.dead_reason, refused.reply_ttl_s) == ("MALFORMED", None, 30)
    assert (cancel.code, late.code) == ("CANCELLED", "DEADLINE_EXCEEDED")
    replies = {f.rid: decode_reply(f.reply) for f in answered.finishes if f.reply is not None}
    assert replies["r1"].error is not None
    assert replies["r1"].error.code == "MALFORMED"
    assert replies["r1"].meta == 7
    assert replies["p1"].meta_raw is None
    assert answered.runs == []
    assert len(answered.queued_s) == len(answered.decode_s) == 5


def test_a_reply_utf8_cannot_encode_fails_only_its_own_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a run whose model gives one request a string output with a lone surrogate
    labels = {"ok1": "fine", "bad": "\udc80", "ok2": "also fine"}

    def run_batch(model, schema, items, *args, **kwargs):  # type: ignore[no-untyped-def]
        return [
            Outcome(
                item,
                {
                    "probs": np.ones((1, 2), np.float32),
                    "label": np.array([labels[item.rid]], object),
                },
                None,
                len(items),
                1.5,
            )
            for item in items
        ]

    monkeypatch.setattr(answerer_module, "run_batch", run_batch)
    check = CancelCheck()
    check.answer(set())
    request = SimpleNamespace(rows=1, signature=((2,),), outputs=("probs", "label"))
    batch: list[Item] = [
        Admitted(_entry(), rid, request, check, meta_raw=b"\x07")  # type: ignore[arg-type]
        for rid in labels
    ]
    # When the batch is answered
    answered = _answerer().answer(batch)
    # Then that request alone is answered INFERENCE_FAILED, naming the output, and its
    # run-mates get their outputs
    codes = {f.rid: f.code for f in answered.finishes}
    assert codes == {"ok1": "OK", "bad": "INFERENCE_FAILED", "ok2": "OK"}
    replies = {f.rid: decode_reply(f.reply) for f in answered.finishes if f.reply is not None}
    bad = replies["bad"]
    assert bad.error is not None
    assert not bad.error.retryable
    assert "the model's output 'label'" in bad.error.message
    assert bad.meta == 7
    for rid in ("ok1", "ok2"):
        reply = replies[rid]
        assert reply.ok
        assert reply.outputs is not None
        assert list(reply.outputs["label"]) == [labels[rid]]
        assert reply.batch_rows == 3
