"""Finishing a batch in Redis: each shard's finish steps in one script there, then the leases go.

A batch may mix shards' requests (``worker.intake.lanes``): each shard's finish steps go to that
shard's stream (``ShardMap``) as one script, all sent before any answer is read, so a batch
costs one round trip's time whatever the shards. Once they are in Redis their leases are
released. The writer (``worker.answer.writer``) calls this, on whichever thread writes.

A request whose reply Redis refused for good (its reply key holds another type) is finished all
the same: dead-lettered with the reason and acknowledged (contract v3, section 4). It is listed
in ``refusals`` after the write, so that metrics count it as a dead letter (``outcomes``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from worker.intake.shardmap import ShardMap
from worker.redisio.stream import Finish, FinishInFlight, RequestStream

__all__ = ["Finisher"]


class Finisher:
    """Finishes batches and releases their leases, one batch at a time.

    Not locked, as no two writes overlap: the writer's thread writes what is queued, and the
    serving thread writes a batch itself (``ReplyWriter.submit(here=True)``) only when the
    writer is idle, that is, when every batch put on its queue has been written. Only the
    serving thread puts batches there, and not while it writes one, so the writer's thread
    stays idle until that write is done. ``_partial`` is therefore touched by one write at a
    time, in the order submitted.
    """

    def __init__(self, shards: ShardMap) -> None:
        self.shards = shards
        # A mixed batch's finish that failed on some shard: (its finishes, the flags of the
        # shards that did finish), so that the writer's retry sends only the others
        self._partial: tuple[Sequence[Finish], dict[str, list[bool]]] | None = None
        # The last batch's requests whose reply Redis refused, and why; each was dead-lettered
        self.refusals: list[tuple[Finish, str]] = []
        self._refused: dict[str, list[tuple[Finish, str]]] = {}  # by shard, across a retry

    def finish_each(self, finishes: Sequence[Finish]) -> list[bool]:
        """Per finish, in the order given, whether it was finished here
        (``RequestStream.finish_each``).

        When one shard fails (its master failing over), the others' answers are still read
        (their steps ran) and kept, then the error is raised: the writer retries the batch, and
        the retry sends only the shards still to finish, so the others are neither run again
        nor miscounted as not finished here.
        """
        self.refusals = []
        by_shard: dict[str, list[int]] = {}
        for i, finish in enumerate(finishes):
            by_shard.setdefault(finish.shard or self.shards.model, []).append(i)
        if len(by_shard) == 1:
            [tag] = by_shard
            stream = self.shards.stream(tag)
            done = stream.finish_each(finishes)
            self.refusals = list(stream.refusals)
            return done
        kept = self._partial[1] if self._partial and self._partial[0] is finishes else {}
        if not kept:
            self._refused = {}
        self._partial = None
        sent: list[tuple[str, RequestStream, FinishInFlight]] = []
        failure: BaseException | None = None
        for tag, indexes in by_shard.items():
            if tag in kept:
                continue
            stream = self.shards.stream(tag)
            try:
                sent.append((tag, stream, stream.finish_start([finishes[i] for i in indexes])))
            except Exception as exc:
                failure = failure or exc
        for tag, stream, in_flight in sent:
            try:
                kept[tag] = stream.finish_end(in_flight)
                self._refused[tag] = list(stream.refusals)
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            self._partial = (finishes, kept)  # the writer's retry passes the same list
            raise failure
        done = [False] * len(finishes)
        for tag, indexes in by_shard.items():
            for i, flag in zip(indexes, kept[tag], strict=True):
                done[i] = flag
            self.refusals += self._refused.get(tag, [])
        self._refused = {}
        return done

    def outcomes(self, finishes: Sequence[Finish], finished: Sequence[bool]) -> list[str]:
        """The outcome code of each finish finished here, for metrics: its planned code, or
        ``DEAD_LETTER`` where the last write's Redis refused its reply (``refusals``)."""
        if not self.refusals:  # the common case
            return [finish.code for finish, done in zip(finishes, finished, strict=True) if done]
        refused = {id(finish) for finish, _ in self.refusals}
        return [
            "DEAD_LETTER" if id(finish) in refused else finish.code
            for finish, done in zip(finishes, finished, strict=True)
            if done
        ]

    def release(self, finishes: Iterable[Finish]) -> None:
        """Release the leases of written entries, each in its own shard's.

        The path's one edge back: the leases are the read side's (its keeper renews them, its
        reclaim skips them), and only here is it known that an entry is done, as dramatiq's
        ack goes back to the consumer that took the message. They are reached through the
        shared ``ShardMap``, not through the lanes."""
        by_shard: dict[str, list[bytes]] = {}
        for finish in finishes:
            by_shard.setdefault(finish.shard or self.shards.model, []).append(finish.entry_id)
        for tag, ids in by_shard.items():
            shard = self.shards.get(tag)
            if shard is not None:
                shard.leases.release(ids)
