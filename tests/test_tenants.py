"""Tenant isolation (contract section 7, docs/security.md "Tenants"): two producer users made from
the documented tenant template, a worker under the documented worker user, one redis-server
with exactly the doc's aclfile. Each tenant's client works under its role; neither can read,
trim, delete, exhaust or cancel the other's lanes and replies (NOPERM); one tenant's worst on its
own lanes, and junk in the shared lane set, leave the other's requests all answered."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from harness import ADMIN, ADMIN_PASSWORD, doc_aclfile, running_worker, write_config

from producer import Client
from producer.protocol.errors import StreamExhausted
from producer.protocol.keys import cancel_key, reply_key, request_stream
from producer.protocol.lanes import lane_stream, lanes_key
from tools.localredis import LocalRedis

MODEL = "demo"
P = "redbatch"
X = np.zeros((1, 16), np.float32)
MAX_ID = "18446744073709551615-18446744073709551615"


ACL = doc_aclfile()
TEMPLATE = next(line for line in ACL.splitlines() if "redbatch-tenant-example " in line)
# Tenant "beta" made from the template as the doc says: "example" replaced, and the password
BETA = TEMPLATE.replace("example", "beta")
PASSWORDS = dict(re.findall(r"^user (\S+) on >(\S+)", f"{ACL}\n{BETA}", flags=re.MULTILINE))


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    acl = f"{ACL}\n{BETA}\nuser {ADMIN} on >{ADMIN_PASSWORD} ~* &* +@all"
    with LocalRedis(acl=acl, username=ADMIN, password=ADMIN_PASSWORD) as s:
        yield s


def url(server: LocalRedis, user: str) -> str:
    return server.url_for(user, PASSWORDS[user])


def as_user(server: LocalRedis, user: str) -> redis.Redis:
    return redis.Redis.from_url(url(server, user), socket_timeout=30)


def test_the_template_confines_a_tenant_to_its_own_keys(
    server: LocalRedis, admin: redis.Redis
) -> None:
    beta_lane = lane_stream(P, MODEL, "low", "beta")
    admin.xadd(beta_lane, {"rid": "beta.1", "body": b"x"})
    admin.rpush(reply_key(P, MODEL, "beta.1"), b"reply")
    example = as_user(server, "redbatch-tenant-example")
    refused = [
        ("XADD", beta_lane, "*", "rid", "example.1", "body", "b"),  # write another's lane
        ("XADD", beta_lane, "MAXLEN", "0", "*", "rid", "x", "body", "b"),  # trim it
        ("XTRIM", beta_lane, "MAXLEN", "0"),
        ("XADD", beta_lane, MAX_ID, "rid", "x", "body", "b"),  # exhaust its id space
        ("DEL", beta_lane),
        ("XLEN", beta_lane),  # even its length
        ("XRANGE", beta_lane, "-", "+"),
        ("LINDEX", reply_key(P, MODEL, "beta.1"), "0"),  # read another's reply
        ("LPOP", reply_key(P, MODEL, "beta.1")),
        ("SET", cancel_key(P, MODEL, "beta.1"), "1"),  # cancel another's request
        ("XADD", request_stream(P, MODEL), "*", "rid", "x", "body", "b"),  # the shared lane
        ("SMEMBERS", lanes_key(P, MODEL)),  # the lane set is write only
        ("SREM", lanes_key(P, MODEL), beta_lane),
        ("GET", f"{P}:{{{MODEL}}}:worker:w"),
    ]
    for command in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            example.execute_command(*command)
    assert admin.xlen(beta_lane) == 1
    assert admin.lrange(reply_key(P, MODEL, "beta.1"), 0, -1) == [b"reply"]
    example.close()


def test_each_tenants_client_works_under_its_role_and_one_harms_only_itself(
    tmp_path: Path, server: LocalRedis, admin: redis.Redis
) -> None:
    config = write_config(tmp_path, MODEL, url(server, "redbatch-worker"))
    with (
        Client(MODEL, url(server, "redbatch-tenant-example"), max_backlog=10_000) as example,
        Client(MODEL, url(server, "redbatch-tenant-beta"), max_backlog=10_000) as beta,
        running_worker(config, name="w-tenants") as worker,
    ):
        # Given beta's requests queued in two classes, and example's own worst meanwhile:
        # junk in the shared lane set, its own lane trimmed to nothing and its id space used up
        handles = beta.submit_many([{"features": X}] * 20, priority="low", tenant="beta")
        handles += [beta.submit({"features": X}, priority="high", tenant="beta")]
        mine = lane_stream(P, MODEL, "low", "example")
        example.submit({"features": X}, priority="low", tenant="example")
        fakes = [lane_stream(P, MODEL, "high", f"x{i}") for i in range(50)]
        attacker = as_user(server, "redbatch-tenant-example")
        attacker.sadd(lanes_key(P, MODEL), *fakes, "junk", lane_stream(P, "other", "high"))
        attacker.execute_command("XADD", mine, "MAXLEN", "0", "*", "rid", "example.t", "body", "b")
        attacker.execute_command("XADD", mine, MAX_ID, "rid", "example.z", "body", "b")
        attacker.close()
        worker.registry.beat_soon()  # learn the new lanes now rather than at the next beat
        # Then beta's requests are all answered, each once, and its client works: infer, map
        results = list(beta.wait_many(handles, timeout_s=30))
        out = beta.infer({"features": X}, priority="high", tenant="beta", timeout_s=30)
        chunks = list(beta.map({"features": np.repeat(X, 6, axis=0)}, tenant="beta", timeout_s=30))
        # and example's next request to its exhausted lane fails for example alone
        with pytest.raises(StreamExhausted):
            example.submit({"features": X}, priority="low", tenant="example")
        late = example.submit({"features": X}, priority="high", tenant="example")
        worker.registry.beat_soon()
        ok_after = example.wait(late, timeout_s=30)
    assert [r.ok for r in results] == [True] * 21
    assert {r.rid.split(".")[0] for r in results} == {"beta"}
    assert all(admin.llen(reply_key(P, MODEL, r.rid)) == 0 for r in results)  # popped once
    assert out["probs"].shape == (1, 4)
    assert all(c.error is None for c in chunks)
    assert ok_after.ok
    assert not any(admin.exists(f) for f in fakes)  # no stream was made for a fake name
