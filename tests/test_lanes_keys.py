"""Lane key names (producer/protocol/lanes.py): built and parsed as docs/protocol.md's vectors
say, junk in a lane set parsed as nothing, tenants' request ids."""

from __future__ import annotations

import pytest

from producer.protocol.lanes import (
    Lane,
    lane_stream,
    lanes_key,
    parse_lane,
    tenant_of_rid,
    tenant_rid,
    weights_key,
)

P = "redbatch"


@pytest.mark.parametrize(
    ("tag", "cls", "tenant", "key"),
    [
        ("demo", "normal", None, "redbatch:{demo}:requests"),  # version 2's stream
        ("demo", "high", None, "redbatch:{demo}:requests:high"),
        ("demo", "low", None, "redbatch:{demo}:requests:low"),
        ("demo", "normal", "acme", "redbatch:{demo}:requests:normal:acme"),
        ("demo~k3", "low", "team_b-2", "redbatch:{demo~k3}:requests:low:team_b-2"),
    ],
)
def test_lane_streams_are_named_and_parsed_back(
    tag: str, cls: str, tenant: str | None, key: str
) -> None:
    assert lane_stream(P, tag, cls, tenant) == key
    assert parse_lane(P, tag, key) == Lane(tag, cls, tenant)
    assert parse_lane(P, tag, key.encode()) == Lane(tag, cls, tenant)
    assert Lane(tag, cls, tenant).stream(P) == key


def test_set_and_weights_keys_share_the_shard_and_model_slot() -> None:
    assert lanes_key(P, "demo~k3") == "redbatch:{demo~k3}:lanes"
    assert weights_key(P, "demo") == "redbatch:{demo}:weights"


@pytest.mark.parametrize(
    "junk",
    [
        "redbatch:{other}:requests:high",  # another shard's lane
        "redbatch:{demo~k3}:requests:high",  # another shard of the same model
        "redbatch:{demo}:requests:normal",  # the default lane spelled out: not a lane name
        "redbatch:{demo}:requests:urgent",  # no such class
        "redbatch:{demo}:requests:low:a.b",  # a dot: not a tenant
        "redbatch:{demo}:requests:low:",  # an empty tenant
        "redbatch:{demo}:reply:x",  # not a request stream
        "other:{demo}:requests:low",  # another prefix
        b"redbatch:{demo}:requests:low:\xff",  # not UTF-8
    ],
)
def test_junk_in_a_lane_set_parses_as_no_lane(junk: str | bytes) -> None:
    assert parse_lane(P, "demo", junk) is None


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: lane_stream(P, "demo", "urgent"), "not a class"),
        (lambda: lane_stream(P, "demo", "low", "a.b"), "does not match"),
        (lambda: lane_stream(P, "demo", "low", "x" * 65), "does not match"),
        (lambda: tenant_rid("acme", "r" * 124), "does not match"),
    ],
)
def test_bad_names_are_refused_with_the_pattern(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]


def test_a_tenants_request_ids_begin_with_its_name_and_a_dot() -> None:
    assert tenant_rid("acme", "9f1c") == "acme.9f1c"
    assert tenant_rid(None, "9f1c") == "9f1c"
    assert tenant_of_rid("acme.9f1c") == "acme"
    assert tenant_of_rid("9f1c") is None
