"""What a plan (``producer.client.plans``) asks of the shell that runs it, and the Redis
commands behind each step.

A plan yields steps: ``Call`` (one redis-py command), ``Batch`` (many commands, one round trip
per node), ``Sleep``, ``Aside`` (a plan of clean-up commands the call does not wait for),
``Shared`` (a plan concurrent calls run once between them), and two that concurrent calls of
the asyncio shell share: ``Send`` (a submit, coalesced with others) and ``Pop`` (one call's
BLPOP, served by a BLPOP that watches many calls' keys). The blocking shell runs ``Send`` as
the ``plans.send`` plan and ``Pop`` as the BLPOP it is, so both shells run the same plans, and
a plan cannot tell them apart.

Every command names its shard tag (contract section 1): a ``Batch`` is made of one ``Part`` per
shard, so that no transaction or multi-key command spans two slots. Each builder below gives
both forms of its commands: packed RESP bytes (``producer.redisio.resp``, the hot path on an
ordinary connection pool) and redis-py pipeline calls (any other client).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from producer.client import lanes, lanesend
from producer.client.lanes import LaneChoice
from producer.client.session import Session
from producer.client.submission import Submission, check_xadds, pack_xadds
from producer.client.waiting import ReplyWaiter
from producer.protocol import keys
from producer.redisio import resp
from producer.redisio.connection import block_s
from producer.redisio.retry import RetryPolicy
from producer.redisio.shards import parse_shards

__all__ = [
    "Aside",
    "Batch",
    "Call",
    "Part",
    "Plan",
    "Pop",
    "Send",
    "Shared",
    "Sleep",
    "Step",
    "blpop",
    "cancel_part",
    "lpop",
    "lpop_part",
    "pack_lpops",
    "pop_reply",
    "popped",
    "shard_list",
    "xadd",
    "xadd_part",
    "xlen",
    "xlen_part",
]

R = TypeVar("R")

#: A plan: yields steps (and, when it streams, outputs), is sent answers, returns ``R``.
Plan = Generator[Any, Any, R]


@dataclass(eq=False, slots=True)
class Call:
    """One redis-py command, ``fn(redis)`` on the client of shard ``tag`` (None: the model's
    first), tried through ``retry`` (the asyncio shell awaits what ``fn`` returns); ``tries``
    counts the tries the shell made."""

    name: str  # the Redis command, for tests and debugging
    fn: Callable[[Any], Any]
    retry: RetryPolicy
    tag: str | None = None
    tries: int = 0


@dataclass(eq=False, slots=True)
class Pop(Call):
    """One call's BLPOP of its reply at ``key``, blocking until ``until`` (monotonic) at most.
    The asyncio shell may serve it with a BLPOP shared with other calls; then ``tries`` is 2
    when that BLPOP, or the sweep after it, needed a retry, and the answer may be None before
    ``until`` (a plan that loops on its pops does not mind).

    ``retry`` is the client's policy: a shell that runs this BLPOP itself retries it through
    ``bounded()``, within the time left before ``until`` (``limit`` names that bound in the
    error). It is built then, not here: a pop served by a shared BLPOP needs none."""

    key: bytes = b""
    until: float = 0.0
    limit: str = ""

    def bounded(self) -> RetryPolicy:
        """``retry`` within the time left before ``until``, so that an outage never holds the
        call past its timeout."""
        return self.retry.within(self.until - time.monotonic(), self.limit)


@dataclass(frozen=True, slots=True)
class Send:
    """Submit ``subs`` as ``plans.send`` does, giving up at ``until`` (monotonic; None: the
    client's retries only). The asyncio shell sends it with concurrent calls' submits."""

    subs: Sequence[Submission]
    until: float | None = None


@dataclass(eq=False, slots=True)
class Part:
    """One shard's commands in a ``Batch``: hand-packed (``packer``) on a client with an
    ordinary pool, else queued by ``queue`` on a redis-py pipeline. ``check`` turns its replies
    into its ``answer`` (raising the first error); ``items`` is what it carries (submissions,
    keys), for the plan. ``done`` once answered: a retry of the batch skips it."""

    tag: str
    queue: Callable[[Any], None]
    packer: resp.Packer | None = None
    check: Callable[[list[Any]], Any] = resp.raise_first_error
    items: Sequence[Any] = ()
    done: bool = False
    answer: Any = None
    count: int = 0  # replies it owes in the round trip under way


@dataclass(eq=False, slots=True)
class Batch:
    """Many commands, one ``Part`` per shard, tried through ``retry``; the answer is each
    part's, in order."""

    name: str
    retry: RetryPolicy
    parts: list[Part]
    tries: int = 0

    def answers(self) -> list[Any]:
        return [part.answer for part in self.parts]


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds`` before the next step (Redis has no event for a stream shrinking)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Aside:
    """Run ``plan`` on the side, its errors ignored: the asyncio shell starts it as a task of
    its own and goes on at once (an interrupted call's clean-up must not hold up its
    cancellation); the blocking shell runs it there and then. Answers None."""

    plan: Plan[None]


@dataclass(frozen=True, slots=True)
class Shared:
    """Run the plan ``start(retry)`` makes, once for all the calls that ask for ``name`` while
    it runs: the asyncio shell runs it in a task of its own (``close()`` ends it) with the
    client's retry policy, and each call waits for it until its own ``until`` (monotonic; None:
    no bound); the blocking shell runs it there and then, its retries ending at ``until``
    (``limit`` names that bound). Answers what the plan returns, or raises its error."""

    name: str
    start: Callable[[RetryPolicy], Plan[Any]]
    until: float | None = None
    limit: str = ""


#: What a shell runs: the steps a plan yields.
Step = Call | Batch | Sleep | Send | Aside | Shared


# ---------------------------------------------------------------------------------------------
# The commands

#: ``P:{T}:requests``, built (and checked) once per shard rather than once per send.
_stream = functools.lru_cache(maxsize=4096)(keys.request_stream)


def xadd(session: Session, by_tag: Mapping[str, list[Submission]], retry: RetryPolicy) -> Batch:
    return Batch("XADD", retry, [xadd_part(session, tag, subs) for tag, subs in by_tag.items()])


def xadd_part(session: Session, tag: str, subs: list[Submission]) -> Part:
    for sub in subs:
        if sub.lane is not None:  # not all to the default lane: each to its own
            return _lanes_xadd_part(session, tag, subs)
    stream = _stream(session.settings.prefix, tag)

    def queue(pipe: Any) -> None:
        for sub in subs:
            pipe.xadd(stream, sub.fields())

    if not session.packed:
        return Part(tag, queue, items=subs)
    xadds = pack_xadds(stream, subs)
    return Part(tag, queue, xadds.packer, lambda got: check_xadds(xadds, got), subs)


def _lanes_xadd_part(session: Session, tag: str, subs: list[Submission]) -> Part:
    """``xadd_part`` for submits of several lanes, or of one other than the default
    (``producer.client.lanes``: each lane's in transactions that add it to the lane set)."""
    sent = lanesend.lane_xadds(session.settings.prefix, tag, subs)
    packer = sent.xadds.packer if session.packed else None
    return Part(tag, sent.queue, packer, sent.check, subs)


def lpop(session: Session, by_tag: Mapping[str, list[bytes]], retry: RetryPolicy) -> Batch:
    return Batch("LPOP", retry, [lpop_part(session, tag, ks) for tag, ks in by_tag.items()])


def lpop_part(session: Session, tag: str, keys_: list[bytes]) -> Part:
    """``LPOP`` of each key; a key of another type answers its ``WRONGTYPE`` error in place,
    so that the replies popped beside it are kept (``ReplyWaiter`` makes it a failed Result)."""

    def queue(pipe: Any) -> None:
        for key in keys_:
            pipe.lpop(key)

    packer = pack_lpops(keys_) if session.packed else None
    return Part(tag, queue, packer, resp.raise_first_error_but_wrong_type, items=keys_)


def pack_lpops(keys_: Sequence[bytes]) -> resp.Packer:
    """``LPOP key`` for each key, for one round trip."""
    packer = resp.Packer()
    packed = [b"*2\r\n$4\r\nLPOP\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys_]
    packer.add_packed(b"".join(packed), len(keys_))
    return packer


def popped(by_tag: Mapping[str, list[bytes]], answers: list[Any]) -> tuple[list[bytes], list[Any]]:
    """The keys of an LPOP batch and their replies, each in one list, in the same order."""
    if len(answers) == 1:
        return next(iter(by_tag.values())), answers[0]
    return [k for ks in by_tag.values() for k in ks], [raw for got in answers for raw in got]


def blpop(session: Session, waiter: ReplyWaiter, retry: RetryPolicy) -> Call:
    """A BLPOP over one shard's awaited keys (shards take turns)."""
    # The block is worked out per try, so a retry after an outage blocks only what is left.
    cap_s = session.block_cap_s
    tag, keys_, shared = waiter.blpop_keys()
    return Call(
        "BLPOP",
        lambda r: r.blpop(keys_, waiter.block_s(time.monotonic(), cap_s, shared)),
        retry,
        tag,
    )


def pop_reply(session: Session, key: bytes, tag: str, until: float, limit: str) -> Pop:
    """The BLPOP of a call that awaits the one reply at ``key`` of shard ``tag`` until
    ``until`` (monotonic), as a ``Pop`` the asyncio shell may share."""
    cap_s = session.block_cap_s
    keys_ = [key]
    return Pop(
        "BLPOP",
        lambda r: r.blpop(keys_, block_s(until, time.monotonic(), cap_s)),
        session.retry,
        tag,
        key=key,
        until=until,
        limit=limit,
    )


def xlen(
    session: Session,
    tags: Sequence[str],
    retry: RetryPolicy,
    lanes_: Sequence[LaneChoice | None] = (None,),
) -> Batch:
    """``XLEN`` of each lane's stream (default: ``P:{T}:requests``) on each shard, lane by
    lane: the answers are those of ``lanes_[0]`` on every shard, then of ``lanes_[1]``..."""
    parts = [xlen_part(session, tag, lane) for lane in lanes_ for tag in tags]
    return Batch("XLEN", retry, parts)


def xlen_part(session: Session, tag: str, lane: LaneChoice | None = None) -> Part:
    prefix = session.settings.prefix
    stream = _stream(prefix, tag) if lane is None else lanes.stream_of(prefix, tag, lane)
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
