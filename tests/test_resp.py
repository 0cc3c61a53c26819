"""Hand-packed commands and their one round trip, against a real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio

from producer.redisio import resp


def _packer(*commands: tuple[bytes, ...]) -> resp.Packer:
    packer = resp.Packer()
    for args in commands:
        packer.add(*args)
    return packer


def test_packed_commands_are_the_bytes_redis_py_would_send(rconn: redis.Redis) -> None:
    big = b"\x00\r\n" * 3000  # over resp.BIG: sent as it is
    commands = [(b"RPUSH", b"k", big, b""), (b"LPOP", b"k"), (b"SET", b"s", b"v" * 100)]
    packer = _packer(*commands)
    conn = rconn.connection_pool.get_connection()
    try:
        expected = b"".join(b"".join(conn.pack_command(*args)) for args in commands)
    finally:
        rconn.connection_pool.release(conn)
    chunks = packer.chunks()
    assert b"".join(chunks) == expected
    assert packer.count == 3
    assert any(chunk is big for chunk in chunks)  # not copied
    assert resp.command(b"LPOP", b"k") == b"".join(_packer((b"LPOP", b"k")).chunks())


def test_replies_come_back_in_order_with_errors_in_place(rconn: redis.Redis) -> None:
    rconn.set("s", "a string")
    packer = _packer((b"RPUSH", b"l", b"one"), (b"RPUSH", b"s", b"two"))  # the second: WRONGTYPE
    packer.add_packed(resp.command(b"LRANGE", b"l", b"0", b"-1"))
    pushed, refused, listed = resp.round_trip(rconn, packer)
    assert pushed == 1
    assert isinstance(refused, redis.ResponseError)
    assert "WRONGTYPE" in str(refused)
    assert listed == [b"one"]
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        resp.raise_first_error([pushed, refused, listed])
    # And the connection went back clean: the next command reads its own reply
    assert rconn.lrange("l", 0, -1) == [b"one"]


def _set_then_wait() -> resp.Packer:
    """SET a 1, then a BLPOP whose (empty) reply comes 0.3 s later: a reply still owed when
    the round trip is interrupted, which would answer the next command on that connection."""
    return _packer((b"SET", b"a", b"1"), (b"BLPOP", b"nothing", b"0.3"))


def test_a_connection_that_failed_part_way_is_not_reused(
    rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a round trip that fails after reading its first reply, with the second still owed
    assert rconn.ping()  # connected first: the handshake's own reads are not counted below
    real_read = redis.connection.Connection.read_response
    reads = []

    def read_then_fail(conn: redis.connection.Connection, *args: object, **kw: object) -> object:
        reads.append(1)
        if len(reads) == 2:
            raise RuntimeError("interrupted")
        return real_read(conn, *args, **kw)

    monkeypatch.setattr(redis.connection.Connection, "read_response", read_then_fail)
    with pytest.raises(RuntimeError):
        resp.round_trip(rconn, _set_then_wait())
    monkeypatch.undo()
    # Then the next command's answer is its own, not the BLPOP's late nil
    assert rconn.get("a") == b"1"


def test_a_cancelled_async_round_trip_drops_its_connection(redis_url: str) -> None:
    async def scenario() -> tuple[object, int]:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            # When the round trip is cancelled while the BLPOP's reply is owed
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(resp.round_trip_async(client, _set_then_wait()), 0.05)
            # Then the next command reads its own reply, and no connection is left in use
            got = await client.get("a")
            return got, len(client.connection_pool._in_use_connections)
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == (b"1", 0)
