"""The ACL rules of docs/security.md, passwords and TLS, against real redis-servers.

The rules are read from the doc itself, so a rule the code needs but the doc lacks (or a rule the
doc grants that should be refused) fails here.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from harness import (
    ADMIN,
    ADMIN_PASSWORD,
    direct_run,
    doc_aclfile,
    running_worker,
    send,
    tls_files,
    wait_reply,
    write_config,
)

from producer import AsyncClient, Client
from producer.cli.main import main as redbatch_main
from producer.client import submission
from producer.ops import shards as shardops
from producer.ops.status import gather_status
from producer.protocol.errors import ConnectionFailed
from producer.protocol.keys import (
    cancel_key,
    dead_key,
    reply_key,
    request_stream,
    retiring_key,
    shards_key,
    worker_key,
    workers_key,
)
from producer.redisio import shards
from tools.localredis import LocalRedis
from worker.config import load_config
from worker.errors import WorkerError
from worker.service import Worker, prepare

MODEL = "demo"
STREAM = request_stream("redbatch", MODEL)
DEAD = dead_key("redbatch", MODEL)
X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)


ACL = doc_aclfile()
PASSWORDS = dict(re.findall(r"^user (\S+) on >(\S+)", ACL, flags=re.MULTILINE))
SERVER_ACL = f"{ACL}\nuser {ADMIN} on >{ADMIN_PASSWORD} ~* &* +@all"


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    """A redis-server with exactly the doc's users, plus an administrator for the test itself."""
    with LocalRedis(acl=SERVER_ACL, username=ADMIN, password=ADMIN_PASSWORD) as s:
        yield s


def url(server: LocalRedis, role: str) -> str:
    user = f"redbatch-{role}"
    return server.url_for(user, PASSWORDS[user])


@pytest.fixture
def as_producer(server: LocalRedis, admin: redis.Redis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(url(server, "producer"), socket_timeout=60)
    yield client
    client.close()


@pytest.fixture
def as_worker(server: LocalRedis, admin: redis.Redis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(url(server, "worker"), socket_timeout=60)
    yield client
    client.close()


def test_doc_defines_the_roles_and_turns_default_off() -> None:
    assert set(PASSWORDS) == {
        "redbatch-producer", "redbatch-worker", "redbatch-operator", "redbatch-tenant-example"
    }  # fmt: skip
    assert "user default off" in ACL.splitlines()


def test_default_user_is_refused(server: LocalRedis) -> None:
    for client in (
        redis.Redis(port=server.port),
        redis.Redis(port=server.port, password="anything"),
    ):
        with pytest.raises(redis.AuthenticationError):
            client.ping()
        client.close()


def test_producer_and_worker_users_serve_requests_end_to_end(
    tmp_path: Path, server: LocalRedis, admin: redis.Redis
) -> None:
    # Given a worker and a producer that log in with the doc's users and nothing else
    config = write_config(tmp_path, MODEL, url(server, "worker"))
    model_path = tmp_path / f"{MODEL}.onnx"
    with Client(MODEL, url(server, "producer"), max_backlog=1000) as client:
        client.cancel("cancelled-early", ttl_s=600)
        client.submit({"features": X}, rid="cancelled-early")
        assert client.backlog() == 1
        assert 0 < admin.ttl(cancel_key("redbatch", MODEL, "cancelled-early")) <= 600
        with running_worker(config, name="w-acl"):
            # When it submits, waits, polls and maps
            outputs = client.infer({"features": X}, timeout_s=20)
            cancelled = client.wait("cancelled-early", timeout_s=20)
            rid = client.submit({"features": X})
            popped = admin.blpop([reply_key("redbatch", MODEL, rid)], timeout=20)
            assert popped is not None
            admin.rpush(reply_key("redbatch", MODEL, rid), popped[1])  # put it back for poll
            polled = client.poll(rid)
            chunks = list(client.map({"features": np.repeat(X, 5, axis=0)}, timeout_s=20))
            batch = list(client.wait_many(client.submit_many([{"features": X}] * 3), 20))
            workers = [w["name"] for w in client.workers()]
            backlog = client.backlog()
    # Then every call works, and the answers are the model's
    expected = direct_run(model_path, {"features": X})
    np.testing.assert_allclose(outputs["probs"], expected["probs"], rtol=1e-6)
    assert cancelled.error is not None
    assert cancelled.error.code == "CANCELLED"
    assert polled is not None
    assert polled.ok
    assert all(c.error is None for c in chunks)
    assert sum(len(c.outputs["label"]) for c in chunks if c.outputs) == 5
    assert [r.ok for r in batch] == [True] * 3  # a batch of submits: one MULTI/EXEC
    assert workers == ["w-acl"]
    assert backlog == 0


def test_worker_user_writes_dead_letters_through_its_script(
    tmp_path: Path, server: LocalRedis, admin: redis.Redis
) -> None:
    # Given an entry whose rid cannot name a reply key, then a good one behind it
    config = write_config(tmp_path, MODEL, url(server, "worker"))
    admin.xadd(STREAM, {"rid": "not a rid!", "body": b"\x80"})
    send(admin, MODEL, "after-the-bad-one", {"features": X})
    # When a worker with the doc's rules serves them
    with running_worker(config):
        assert wait_reply(admin, "after-the-bad-one").ok
    # Then the bad one was copied to the dead-letter stream, and both left the request stream
    dead = admin.xrange(DEAD)
    assert [fields[b"rid"] for _, fields in dead] == [b"not a rid!"]
    assert b"does not match" in dead[0][1][b"reason"]
    assert admin.xlen(STREAM) == 0


def test_a_producer_without_multi_still_adds_its_batches_once(
    server: LocalRedis,
    admin: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(submission, "_WARNED", set())  # the warning is given once per process
    # Given a producer user from before transactions: the doc's rules less +multi +exec +discard
    rules = re.search(r"^user redbatch-producer on >\S+ (.*)$", ACL, flags=re.MULTILINE)
    assert rules is not None
    old_rules = rules.group(1).replace("+multi +exec +discard ", "")
    admin.execute_command(
        "ACL", "SETUSER", "old-producer", "on", ">old-producer", *old_rules.split()
    )
    old_url = server.url_for("old-producer", "old-producer")
    # When it submits batches, sync and async
    with Client(MODEL, old_url) as client:
        rids = client.submit_many([{"features": X}] * 3)
        rids += client.submit_many([{"features": X}] * 2)

    async def submit_async() -> list[str]:
        async with AsyncClient(MODEL, old_url) as aclient:
            return await aclient.submit_many([{"features": X}] * 3)

    rids += asyncio.run(submit_async())
    # Then each request is in the stream once, and one warning says what to grant
    added = [fields[b"rid"].decode() for _, fields in admin.xrange(STREAM)]
    assert added == rids
    warnings = [r.getMessage() for r in caplog.records if "refused MULTI" in r.getMessage()]
    assert len(warnings) == 1
    assert "+multi +exec +discard" in warnings[0]


RECLAIM_SOON = "[delivery]\nclaim_idle_ms = 200"
# The worker's rules of the release before shards (contract version 1's reply and cancel keys,
# no shard list): docs/security.md, "Upgrading".
V1_WORKER_RULES = (
    "on >old-worker resetchannels -@all +ping +info +script|load (~redbatch:{*}:requests "
    "+xgroup|create +xgroup|delconsumer +xreadgroup +xack +xdel +xclaim +xautoclaim +xpending "
    "+xrange +xlen +xinfo|groups +xinfo|consumers) (~redbatch:{*}:dead +xadd +xlen) "
    "(%W~redbatch:reply:* +rpush +expire +ltrim) (~redbatch:{*}:staging:* +rpush +expire +del) "
    "(~redbatch:{*}:staging:* %W~redbatch:reply:* +renamenx) (%R~redbatch:cancel:* +mget) "
    "(~redbatch:{*}:workers +sadd +srem) (%W~redbatch:{*}:worker:* +set +del) "
    "(~redbatch:{*}:requests ~redbatch:{*}:dead ~redbatch:reply:* ~redbatch:{*}:staging:* "
    "~redbatch:{*}:workers ~redbatch:{*}:worker:* +evalsha +eval)"
)


def _doc_worker_rules_without(selector: str) -> str:
    """The doc's worker rules less one selector, as an ``ACL SETUSER`` rule string."""
    line = next(r for r in ACL.splitlines() if r.startswith("user redbatch-worker on "))
    rules = line.removeprefix("user redbatch-worker ").replace(">CHANGE-ME-worker", ">old-worker")
    assert selector in rules
    return rules.replace(f" {selector}", "")


def _old_worker(tmp_path: Path, server: LocalRedis, admin: redis.Redis, rules: str) -> Worker:
    """A worker whose user has ``rules`` (an ``ACL SETUSER`` rule string)."""
    admin.execute_command("ACL", "SETUSER", "old-worker", "reset", *rules.split(" "))
    (tmp_path / "old").mkdir()
    old = write_config(tmp_path / "old", MODEL, server.url_for("old-worker", "old-worker"))
    prepared = prepare(load_config(old), "w-old")
    return Worker(prepared, redis.Redis.from_url(load_config(old).redis.url))


def _answered_by_a_worker_with_the_rules(
    tmp_path: Path, server: LocalRedis, admin: redis.Redis, rid: str
) -> None:
    new = write_config(tmp_path, MODEL, url(server, "worker"), extra=RECLAIM_SOON)
    with running_worker(new, name="w-new"):
        reply = wait_reply(admin, rid)
    assert reply.ok
    assert reply.worker == "w-new"


def test_a_worker_missing_the_reply_rule_stops_and_leaves_its_batch_pending(
    tmp_path: Path, server: LocalRedis, admin: redis.Redis
) -> None:
    # Given a worker user with the doc's rules less the one that lets the finish script write
    # a reply
    rules = _doc_worker_rules_without("(%W~redbatch:{*}:reply:* +rpush +expire +ltrim)")
    worker = _old_worker(tmp_path, server, admin, rules)
    rid = send(admin, MODEL, "across-the-upgrade", {"features": X})
    try:
        # When it serves a request, it stops at the finish step, naming the refusal (Redis 7.0
        # words a refusal inside a script as a plain ERR)
        with pytest.raises(WorkerError) as stopped:
            worker.run()
        refusal = stopped.value.__cause__
        assert isinstance(refusal, redis.ResponseError)
        assert "RPUSH" in str(refusal)
        # Then the request is unanswered and still pending, for a worker with the new rules
        assert not admin.exists(reply_key("redbatch", MODEL, rid))
        assert admin.xpending(STREAM, "workers")["pending"] == 1
    finally:
        worker.stream.client.close()
    _answered_by_a_worker_with_the_rules(tmp_path, server, admin, rid)


def test_a_worker_with_the_previous_release_rules_stops_at_start(
    tmp_path: Path, server: LocalRedis, admin: redis.Redis
) -> None:
    # Given a worker user with the rules of the release before shards (v1 reply keys, no read
    # of the shard list)
    worker = _old_worker(tmp_path, server, admin, V1_WORKER_RULES)
    rid = send(admin, MODEL, "across-the-upgrade", {"features": X})
    try:
        # When it starts, it stops before reading, naming the refused read of the shard list
        with pytest.raises(WorkerError, match=r"\+lrange.*\+smembers") as stopped:
            worker.run()
        refusal = stopped.value.__cause__
        assert isinstance(refusal, redis.exceptions.NoPermissionError)
        assert "lrange" in str(refusal).lower()
        # Then the request waits, unread, for a worker with the new rules
        assert admin.xpending(STREAM, "workers")["pending"] == 0
    finally:
        worker.stream.client.close()
    _answered_by_a_worker_with_the_rules(tmp_path, server, admin, rid)


def test_worker_user_may_run_the_reclaim_commands(
    as_worker: redis.Redis, admin: redis.Redis
) -> None:
    # Given a request read by one consumer (what a worker that then died leaves behind)
    as_worker.xgroup_create(STREAM, "workers", id="0", mkstream=True)
    admin.xadd(STREAM, {"rid": "r1", "body": b""})
    [[_, [(entry_id, _)]]] = as_worker.xreadgroup("workers", "dead-one", {STREAM: ">"}, count=1)
    # Then the worker user may inspect, claim and clean up, directly and from a script
    assert as_worker.xpending_range(STREAM, "workers", "-", "+", 10)[0]["consumer"] == b"dead-one"
    assert as_worker.xclaim(STREAM, "workers", "alive", 0, [entry_id], justid=True) == [entry_id]
    as_worker.xautoclaim(STREAM, "workers", "other", 0, justid=True)
    assert as_worker.xpending_range(STREAM, "workers", "-", "+", 10)[0]["consumer"] == b"other"
    names = {c["name"] for c in as_worker.xinfo_consumers(STREAM, "workers")}
    assert names == {b"dead-one", b"alive", b"other"}
    forget = as_worker.register_script(
        "redis.call('XPENDING', KEYS[1], ARGV[1]) "
        "return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])"
    )
    assert forget(keys=[STREAM], args=["workers", "dead-one"]) == 0
    assert as_worker.xinfo_groups(STREAM)[0]["consumers"] == 2
    assert as_worker.xack(STREAM, "workers", entry_id) == 1
    assert as_worker.xdel(STREAM, entry_id) == 1


REPLY = reply_key("redbatch", MODEL, "someone-else")
RECORD = worker_key("redbatch", MODEL, "w1")
SHARDS = shards_key("redbatch", MODEL)
RETIRING = retiring_key("redbatch", MODEL)
PRODUCER_REFUSED = [
    ("XREADGROUP", "GROUP", "workers", "p", "STREAMS", STREAM, ">"),
    ("XRANGE", STREAM, "-", "+"),
    ("XDEL", STREAM, "1-0"),
    ("XACK", STREAM, "workers", "1-0"),
    ("XGROUP", "DESTROY", STREAM, "workers"),
    ("DEL", STREAM),
    ("XRANGE", DEAD, "-", "+"),
    ("XADD", DEAD, "*", "rid", "x"),
    ("RPUSH", REPLY, "forged"),
    ("SET", REPLY, "forged"),
    ("GET", cancel_key("redbatch", MODEL, "someone-else")),
    ("SET", RECORD, "{}"),
    ("SADD", workers_key("redbatch", MODEL), "impostor"),
    ("RPUSH", SHARDS, "demo~x"),  # steering other producers' requests
    ("DEL", SHARDS),
    ("SADD", RETIRING, "demo~x"),
    ("FLUSHALL",),
    ("KEYS", "*"),
    ("CONFIG", "GET", "requirepass"),
    ("EVAL", "return 1", "0"),
]
WORKER_REFUSED = [
    ("XADD", STREAM, "*", "rid", "injected", "body", ""),
    ("SET", cancel_key("redbatch", MODEL, "r1"), "1"),
    ("DEL", cancel_key("redbatch", MODEL, "r1")),
    ("LINDEX", REPLY, "0"),
    ("LPOP", REPLY),
    ("XRANGE", DEAD, "-", "+"),
    ("GET", RECORD),
    ("FLUSHALL",),
    ("KEYS", "*"),
    ("CONFIG", "SET", "maxmemory-policy", "allkeys-lru"),
    ("XADD", "redbatch:other", "*", "a", "b"),
    ("LRANGE", REPLY, "0", "-1"),  # reading a reply
    ("RENAMENX", REPLY, "redbatch:{demo}:staging:w:t.0"),  # moving a reply away
    ("LRANGE", "redbatch:{demo}:staging:w:t.0", "0", "-1"),  # reading a staged reply
    ("RPUSH", SHARDS, "demo~x"),
    ("LREM", SHARDS, "0", "demo"),
]


@pytest.mark.parametrize("command", PRODUCER_REFUSED, ids=lambda c: " ".join(c[:2]))
def test_producer_user_is_refused_what_it_must_not_do(
    as_producer: redis.Redis, command: tuple[str, ...]
) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        as_producer.execute_command(*command)


@pytest.mark.parametrize("command", WORKER_REFUSED, ids=lambda c: " ".join(c[:2]))
def test_worker_user_is_refused_what_it_must_not_do(
    as_worker: redis.Redis, command: tuple[str, ...]
) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        as_worker.execute_command(*command)


def test_worker_script_cannot_reach_keys_outside_its_rules(as_worker: redis.Redis) -> None:
    # A script is checked command by command: a key the worker may pass to EVALSHA is still
    # refused to a command its rules do not allow on that key.
    script = as_worker.register_script("return redis.call('LINDEX', KEYS[1], 0)")
    with pytest.raises(redis.exceptions.ResponseError, match=r"user executing the script can't"):
        script(keys=[REPLY])


def test_operator_user_reads_status_and_is_refused_the_queue(
    tmp_path: Path, server: LocalRedis, admin: redis.Redis
) -> None:
    config = write_config(tmp_path, MODEL, url(server, "worker"))
    operator = redis.Redis.from_url(url(server, "operator"))
    with running_worker(config, name="w-status"):
        report = gather_status(operator, MODEL)
    assert [w.name for w in report.workers] == ["w-status"]
    assert report.requests.group is not None
    for command in (("XREADGROUP", "GROUP", "workers", "o", "STREAMS", STREAM, ">"), ("FLUSHALL",)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            operator.execute_command(*command)
    operator.close()


def test_operator_user_runs_shards_status_and_replay_per_shard(
    server: LocalRedis,
    admin: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shards, "REFRESH_S", 0.0)  # no producer here to wait for
    monkeypatch.setattr(shardops, "MARGIN_S", 0.0)
    base = ["--redis-url", url(server, "operator"), "--retry-s", "0"]
    # The operator places three shards, shows them, and reads status per shard
    assert redbatch_main([*base, "shards", "place", "--model", MODEL, "--count", "3"]) == 0
    assert admin.lrange(SHARDS, 0, -1) == [b"demo", b"demo~1", b"demo~2"]
    assert redbatch_main([*base, "shards", "show", "--model", MODEL]) == 0
    admin.xadd(dead_key("redbatch", "demo~2"), {"rid": "r1", "body": b"x", "reason": "POISONED"})
    assert redbatch_main([*base, "status", "--model", MODEL]) == 0
    assert "demo~2  send" in capsys.readouterr().out
    # replays the shard's dead letter to the shard's stream, then retires two shards
    assert redbatch_main([*base, "replay", "--model", MODEL, "--from-dead", "--delete"]) == 0
    assert admin.xlen(request_stream("redbatch", "demo~2")) == 1
    admin.delete(request_stream("redbatch", "demo~2"))  # what a worker's answer leaves
    for tag in ("demo~2", "demo~1"):
        assert redbatch_main([*base, "shards", "retire", "--model", MODEL, "--shard", tag]) == 0
    assert admin.exists(SHARDS, RETIRING) == 0
    assert "retired demo~1" in capsys.readouterr().out


def test_wrong_password_fails_with_a_clear_error(server: LocalRedis) -> None:
    wrong = server.url_for("redbatch-producer", "not-the-password")
    with Client(MODEL, wrong) as client, pytest.raises(ConnectionFailed) as info:
        client.backlog()
    assert "invalid username-password pair" in str(info.value)
    assert "not-the-password" not in str(info.value)


def test_requirepass_alone_protects_the_default_user(tmp_path: Path) -> None:
    with LocalRedis(password="only-password") as plain:
        with Client(MODEL, plain.url) as client:
            assert client.backlog() == 0
        for bad in (plain.url_for(None, "wrong"), f"redis://127.0.0.1:{plain.port}/0"):
            with pytest.raises(redis.AuthenticationError):
                redis.Redis.from_url(bad).ping()


# -- TLS ------------------------------------------------------------------------------------


def _lacks_tls(startup_error: str) -> bool:
    """redis-server built without TLS rejects the tls-* options as unknown, or says so."""
    text = startup_error.lower()
    return "tls" in text and any(
        words in text for words in ("bad directive", "not supported", "not compiled")
    )


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    """A TLS-only server (no plain port) with the doc's users and a CA made for this module."""
    where = tmp_path_factory.mktemp("tls")
    files = tls_files(where)
    server = LocalRedis(acl=SERVER_ACL, username=ADMIN, password=ADMIN_PASSWORD, tls=files)
    try:
        server.start()
    except RuntimeError as exc:
        if _lacks_tls(str(exc)):
            server.close()
            pytest.skip(f"this redis-server has no TLS support: {exc}")
        raise
    yield server
    server.close()


def test_worker_and_client_work_over_tls(tmp_path: Path, tls_server: LocalRedis) -> None:
    assert url(tls_server, "worker").startswith("rediss://")
    config = write_config(tmp_path, MODEL, url(tls_server, "worker"))
    with Client(MODEL, url(tls_server, "producer")) as client, running_worker(config):
        outputs = client.infer({"features": X}, timeout_s=20)
    expected = direct_run(tmp_path / f"{MODEL}.onnx", {"features": X})
    np.testing.assert_allclose(outputs["probs"], expected["probs"], rtol=1e-6)


def test_plain_tcp_to_the_tls_port_fails(tls_server: LocalRedis) -> None:
    password = PASSWORDS["redbatch-producer"]
    plain = redis.Redis(
        port=tls_server.port, username="redbatch-producer", password=password, socket_timeout=5
    )
    with pytest.raises(redis.ConnectionError):
        plain.ping()
    plain.close()


def test_tls_without_trusting_the_ca_fails(tls_server: LocalRedis) -> None:
    untrusting = url(tls_server, "producer").split("?", 1)[0]  # rediss:// with the system CAs
    client = redis.Redis.from_url(untrusting, socket_timeout=5)
    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        client.ping()
    client.close()


def test_operator_reloads_a_worker_process_of_the_worker_role_by_name(
    tmp_path: Path, server: LocalRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    import subprocess
    import sys

    from eventually import eventually

    # Given a worker process that logs in as the doc's worker user
    config = write_config(tmp_path, MODEL, url(server, "worker"))
    operator = redis.Redis.from_url(url(server, "operator"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker", "--config", str(config), "--name", "w-reload"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        key = worker_key("redbatch", MODEL, "w-reload")
        eventually(lambda: operator.get(key), timeout_s=60, what="the worker's record")
        # When its config names a new version and the operator user asks it, by name
        config.write_text(config.read_text().replace('version = "7"', 'version = "8"'))
        base = ["--redis-url", url(server, "operator")]
        assert redbatch_main([*base, "reload", "--model", MODEL, "w-reload"]) == 0
        # Then the new version serves, and the producer user's requests say so
        assert "changed demo@8" in capsys.readouterr().out
        with Client(MODEL, url(server, "producer")) as client:
            handle = client.submit({"features": X})
            assert client.wait(handle, timeout_s=20).model.version == "8"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        operator.close()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert b"cannot reach this worker" not in err  # the role's GETDEL is allowed
