"""Hand-packed commands and their one round trip, against a real Redis."""

from __future__ import annotations

import pytest
import redis

from producer import resp


def test_a_packed_command_is_the_bytes_redis_py_would_send(rconn: redis.Redis) -> None:
    args = (b"RPUSH", b"k", b"\x00\r\n" * 3000, b"")
    conn = rconn.connection_pool.get_connection()
    try:
        assert resp.command(*args) == b"".join(conn.pack_command(*args))
    finally:
        rconn.connection_pool.release(conn)


def test_replies_come_back_in_order_with_errors_in_place(rconn: redis.Redis) -> None:
    rconn.set("s", "a string")
    packed = b"".join(
        [
            resp.command(b"RPUSH", b"l", b"one"),
            resp.command(b"RPUSH", b"s", b"two"),  # WRONGTYPE
            resp.command(b"LRANGE", b"l", b"0", b"-1"),
        ]
    )
    pushed, refused, listed = resp.round_trip(rconn, packed, 3)
    assert pushed == 1
    assert isinstance(refused, redis.ResponseError)
    assert "WRONGTYPE" in str(refused)
    assert listed == [b"one"]
    # And the connection went back to the pool clean: the next command reads its own reply
    assert rconn.lrange("l", 0, -1) == [b"one"]


def test_a_connection_that_failed_part_way_is_not_reused(
    rconn: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a round trip that fails after reading the first of its two replies (an error
    # redis-py's own reader would not disconnect on)
    assert rconn.ping()  # connected first: the handshake's own reads are not counted below
    real_read = redis.connection.Connection.read_response
    reads = []

    def read_then_fail(conn: redis.connection.Connection, *args: object, **kw: object) -> object:
        reads.append(1)
        if len(reads) == 2:
            raise RuntimeError("interrupted")
        return real_read(conn, *args, **kw)

    monkeypatch.setattr(redis.connection.Connection, "read_response", read_then_fail)
    packed = resp.command(b"SET", b"a", b"1") + resp.command(b"GET", b"a")
    with pytest.raises(RuntimeError):
        resp.round_trip(rconn, packed, 2)
    monkeypatch.undo()
    # Then the pool holds no connection with that reply still owed: the next command's answer
    # is its own
    assert rconn.get("missing") is None
    assert rconn.get("a") == b"1"
