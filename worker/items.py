"""The item: one stream entry on its way through the worker, as admission left it.

Admission (``worker.intake.admit``) turns each entry into one of three variants, and every later
stage switches on the variant rather than on which optional fields are set:

- ``Admitted``: a valid request that may run, with what its reply needs.
- ``Refused``: answered with an error code without running (MALFORMED, INVALID_INPUT, ...).
- ``DeadLetter``: copied to the dead-letter stream; answered too when its rid names a reply key.

An ``Admitted`` item that ran becomes an ``Outcome``: its output rows, or its own error.

Every variant knows its entry, how many times it was delivered (a redelivered entry runs in a
batch of its own, since it may be what killed a worker) and how long admitting it took. Only an
``Admitted`` entry keeps its fields (its ``rid`` and ``body``, within ``max_request_bytes``): a
``Refused`` or ``DeadLetter`` one keeps its id and shard alone, so what a hostile producer sent is
freed once its read is admitted (``worker.intake.admit``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from worker.errors import Rejected
from worker.model.schema import ValidRequest
from worker.redisio.cancels import CancelCheck
from worker.redisio.stream import RawEntry

__all__ = ["Admitted", "DeadLetter", "Item", "Outcome", "Part", "Refused", "Whole"]


class _Delivered:
    """The rule every variant shares: one delivered more than once is ``alone``."""

    __slots__ = ()
    deliveries: int

    @property
    def alone(self) -> bool:
        """Redelivered: it runs in a batch of its own."""
        return self.deliveries > 1


# Not frozen: every request is built as one on the hot path, and a frozen dataclass's __init__
# cost about five times a plain slotted one's (docs/design.md, "The worker's path"). Nothing
# assigns to one after admission.
@dataclass(slots=True)
class Admitted(_Delivered):
    """A request that passed admission and may run: its rows join a batch."""

    entry: RawEntry
    rid: str
    request: ValidRequest
    cancel: CancelCheck  # its read's cancel check (worker/redisio/cancels.py)
    deadline_ms: int | None = None
    meta_raw: bytes | None = None  # echoed byte for byte in the reply
    reply_ttl_s: int | None = None
    decode_ms: float = 0.0
    deliveries: int = 1
    # With a pipeline (worker/pipeline/hooks.py): the raw inputs the request sent (``request`` is
    # then what preprocess made of them), the reply outputs it asked for (None: all) and how
    # long its preprocessing took.
    raw: dict[str, np.ndarray] | None = None
    wanted: tuple[str, ...] | None = None
    preprocess_ms: float = 0.0
    # Set when the batcher split its rows across batches (worker/answer/parts.py): which rows
    # of the whole request this item holds, and where the parts are joined again.
    part: Part | None = None

    @property
    def rows(self) -> int:
        return self.request.rows

    @property
    def counted(self) -> bool:
        """True once per request: a whole one, or its first part (queue wait, the exec log)."""
        return self.part is None or self.part.start == 0

    @property
    def shard(self) -> str:
        """The shard whose stream it came from."""
        return self.entry.shard


@dataclass(frozen=True, slots=True)
class Refused(_Delivered):
    """A request answered with ``error`` instead of running; it adds no rows to a batch."""

    entry: RawEntry
    rid: str
    error: Rejected
    meta_raw: bytes | None = None
    reply_ttl_s: int | None = None
    decode_ms: float = 0.0
    deliveries: int = 1

    rows: ClassVar[int] = 0


@dataclass(frozen=True, slots=True)
class DeadLetter(_Delivered):
    """An entry moved to the dead-letter stream for ``reason``. With a rid it is answered with
    ``error`` as well (a poisoned request); without one no reply key can be named."""

    entry: RawEntry
    rid: str | None
    reason: str
    error: Rejected | None = None  # set exactly when ``rid`` is
    decode_ms: float = 0.0
    deliveries: int = 1

    rows: ClassVar[int] = 0


Item = Admitted | Refused | DeadLetter


@dataclass(slots=True, eq=False)
class Whole:
    """A request split into parts: as admitted, and the outcomes of its parts that ran."""

    item: Admitted
    outcomes: dict[int, Outcome]  # by the part's first row
    rows_done: int = 0


@dataclass(frozen=True, slots=True)
class Part:
    """An item that holds rows ``start`` onward of ``whole``'s request (as many as it has)."""

    whole: Whole
    start: int


@dataclass(slots=True)
class Outcome:
    """The result of one request: its output rows, or the error it alone caused."""

    item: Admitted
    outputs: dict[str, np.ndarray] | None
    error: Rejected | None
    batch_rows: int
    inference_ms: float
