"""A model's shards: the tags producers send to and the tags workers serve.

``P:{M}:shards`` lists the tags in order, first ``M``; absent, the model has one shard, ``M``
(contract section 1). A shard being retired is taken off that list first, so producers stop
sending to it, and put in ``P:{M}:retiring``, so workers keep serving it until it is drained
(``redbatch shards retire``). Both keys are in the model's own slot, so one transaction changes
them together.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from producer.protocol import keys

__all__ = ["REFRESH_S", "Shards", "parse_shards", "read_shards", "read_shards_async"]

#: How often workers and clients read the shard list again: a change is picked up within it.
REFRESH_S = 5.0


@dataclass(frozen=True, slots=True)
class Shards:
    """``send``: where producers put new requests; ``serve``: what workers read (the send tags
    plus those retiring, which still hold requests)."""

    model: str
    send: tuple[str, ...]
    retiring: tuple[str, ...] = ()

    @property
    def serve(self) -> tuple[str, ...]:
        return self.send + tuple(t for t in self.retiring if t not in self.send)

    @classmethod
    def single(cls, model: str) -> Shards:
        return cls(model, (model,))


def _decode(values: Iterable[Any]) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values or ()]


def parse_shards(model: str, listed: Any, retiring: Any = ()) -> Shards:
    """The shards from ``LRANGE P:{M}:shards 0 -1`` and ``SMEMBERS P:{M}:retiring``; a tag of
    another model or a malformed one is skipped (it names no key of this model), and the
    model's own tag always comes first."""
    send: list[str] = [model]
    for tag in _decode(listed):
        if keys.is_valid_tag(tag) and keys.model_of(tag) == model and tag not in send:
            send.append(tag)
    retired = sorted(
        tag
        for tag in set(_decode(retiring))
        if keys.is_valid_tag(tag) and keys.model_of(tag) == model and tag not in send
    )
    return Shards(model, tuple(send), tuple(retired))


def read_shards(client: Any, prefix: str, model: str) -> Shards:
    """Read a model's shards from ``client`` (the model's own tag's client): one round trip."""
    pipe = client.pipeline(transaction=False)
    pipe.lrange(keys.shards_key(prefix, model), 0, -1)
    pipe.smembers(keys.retiring_key(prefix, model))
    listed, retiring = pipe.execute()
    return parse_shards(model, listed, retiring)


async def read_shards_async(client: Any, prefix: str, model: str) -> Shards:
    """As ``read_shards``, for ``redis.asyncio``."""
    pipe = client.pipeline(transaction=False)
    pipe.lrange(keys.shards_key(prefix, model), 0, -1)
    pipe.smembers(keys.retiring_key(prefix, model))
    listed, retiring = await pipe.execute()
    return parse_shards(model, listed, retiring)
