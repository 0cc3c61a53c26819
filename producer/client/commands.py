"""The Redis commands of the client's plans, one ``steps.Part`` per shard.

Each builder names the shard tag whose node runs its commands and gives both forms: the packed
RESP bytes (``producer.redisio.resp``, the hot path on an ordinary connection pool) and the redis-py
pipeline calls (any other client). ``producer.client.plans`` decides when to send them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from typing import Any

from producer.client import core, window
from producer.client.base import Session
from producer.client.core import Submission
from producer.client.steps import Batch, Call, Part
from producer.protocol import keys
from producer.redisio import resp
from producer.redisio.retry import RetryPolicy
from producer.redisio.shards import parse_shards

__all__ = [
    "blpop",
    "cancel_part",
    "lpop",
    "lpop_part",
    "popped",
    "shard_list",
    "xadd",
    "xadd_part",
    "xlen",
    "xlen_part",
]


#: ``P:{T}:requests``, built (and checked) once per shard rather than once per send.
_stream = functools.lru_cache(maxsize=4096)(keys.request_stream)


def xadd(session: Session, by_tag: Mapping[str, list[Submission]], retry: RetryPolicy) -> Batch:
    return Batch("XADD", retry, [xadd_part(session, tag, subs) for tag, subs in by_tag.items()])


def xadd_part(session: Session, tag: str, subs: list[Submission]) -> Part:
    stream = _stream(session.settings.prefix, tag)

    def queue(pipe: Any) -> None:
        for sub in subs:
            pipe.xadd(stream, sub.fields())

    if not session.packed:
        return Part(tag, queue, items=subs)
    xadds = core.pack_xadds(stream, subs)
    return Part(tag, queue, xadds.packer, lambda got: core.check_xadds(xadds, got), subs)


def lpop(session: Session, by_tag: Mapping[str, list[bytes]], retry: RetryPolicy) -> Batch:
    return Batch("LPOP", retry, [lpop_part(session, tag, ks) for tag, ks in by_tag.items()])


def lpop_part(session: Session, tag: str, keys_: list[bytes]) -> Part:
    def queue(pipe: Any) -> None:
        for key in keys_:
            pipe.lpop(key)

    return Part(tag, queue, core.pack_lpops(keys_) if session.packed else None, items=keys_)


def popped(by_tag: Mapping[str, list[bytes]], answers: list[Any]) -> tuple[list[bytes], list[Any]]:
    """The keys of an LPOP batch and their replies, each in one list, in the same order."""
    if len(answers) == 1:
        return next(iter(by_tag.values())), answers[0]
    return [k for ks in by_tag.values() for k in ks], [raw for got in answers for raw in got]


def blpop(session: Session, waiter: window.ReplyWaiter, retry: RetryPolicy) -> Call:
    # The block is worked out per try, so a retry after an outage blocks only what is left.
    cap_s = session.block_cap_s
    tag, keys_, shared = waiter.blpop_keys()
    return Call(
        "BLPOP",
        lambda r: r.blpop(keys_, waiter.block_s(time.monotonic(), cap_s, shared)),
        retry,
        tag,
    )


def xlen(session: Session, tags: Sequence[str], retry: RetryPolicy) -> Batch:
    return Batch("XLEN", retry, [xlen_part(session, tag) for tag in tags])


def xlen_part(session: Session, tag: str) -> Part:
    stream = _stream(session.settings.prefix, tag)
    packer = None
    if session.packed:
        packer = resp.Packer()
        packer.add(b"XLEN", stream.encode())
    return Part(tag, lambda pipe: pipe.xlen(stream), packer, lambda got: int(_one(got)))


def _one(replies: list[Any]) -> Any:
    return resp.raise_first_error(replies)[0]


def shard_list(session: Session) -> Part:
    model, prefix = session.settings.model, session.settings.prefix
    listed, retiring = keys.shards_key(prefix, model), keys.retiring_key(prefix, model)

    def queue(pipe: Any) -> None:
        pipe.lrange(listed, 0, -1)
        pipe.smembers(retiring)

    packer = None
    if session.packed:
        packer = resp.Packer()
        packer.add(b"LRANGE", listed.encode(), b"0", b"-1")
        packer.add(b"SMEMBERS", retiring.encode())
    return Part(model, queue, packer, lambda got: parse_shards(model, *resp.raise_first_error(got)))


def cancel_part(tag: str, keys_: list[str], ttl_s: int) -> Part:
    def queue(pipe: Any) -> None:
        for key in keys_:
            pipe.set(key, b"1", ex=ttl_s)

    return Part(tag, queue, items=keys_)
