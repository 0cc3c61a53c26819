"""Reading ahead: a read's cancel check, then the stream's next read behind it, in one round trip.

The reading thread sends the MGET of a read's cancel keys before it hands the read over, and the
next ``XREADGROUP`` on the same connection once the queue has taken it; both replies come back
in the order sent, so a read costs one round trip, not two (docs/design.md, "The read's cancel
check is not waited for"). The check's answer goes to the cancel steps
(``worker.redisio.cancels.ReadCheck``); the entries go back to the reader.
"""

from __future__ import annotations

from collections.abc import Sequence

from producer.redisio.retry import is_transient
from worker.redisio import cancels
from worker.redisio.cancels import CancelQuery
from worker.redisio.stream import RawEntry, RequestStream

__all__ = ["CheckThenRead"]


class CheckThenRead:
    """One read's cancel check on the wire, and maybe the next read behind it.

    ``lost`` is set when a call on the connection failed after an XREADGROUP may have gone out
    on it: entries may then be pending here unheld, and the reader lets reclaim look.
    """

    def __init__(self, stream: RequestStream, rids: Sequence[str]) -> None:
        self.stream = stream
        self.lost = False
        self._answered = False
        try:
            self._query: CancelQuery | None = cancels.ask(stream, rids)
        except Exception:
            self._query = None  # the check is asked again after the hand-over
        self.asked = self._query is not None  # the MGET went out, before the hand-over

    def read_next(self, count: int, block_ms: int) -> None:
        """Send ``RequestStream.read``'s XREADGROUP behind the check; if that fails, the check
        is lost with it (asked again; the reader then reads as usual)."""
        if self._query is None:
            return
        try:
            self._query.connection.send(self.stream.read_command(count, block_ms))
        except Exception:
            self._query = None
            self.lost = True

    def cancelled(self) -> set[str] | None:
        """The rids whose cancel key existed; None when the MGET was not sent or its answer was
        lost (the connection is dropped, with the read behind it)."""
        query = self._query
        if query is None:
            return None
        self._answered = True
        try:
            return query.receive()
        except Exception:
            query.abandon()
            self._query = None
            self.lost = True
            return None

    @property
    def read_owed(self) -> bool:
        """True while the read sent behind the check is still to be taken."""
        return self._query is not None and self._query.connection.owed > 0

    def entries(self) -> list[RawEntry] | None:
        """The entries of the read sent behind the check, as ``RequestStream.read`` returns
        them; after ``cancelled()``, whose reply comes first. None when there is none to take
        (the reader then reads as usual); a transient failure sets ``lost``."""
        if not self.read_owed:
            return None
        if not self._answered:
            raise RuntimeError("take the check's answer (cancelled()) before the read behind it")
        assert self._query is not None
        try:
            [reply] = self._query.connection.receive(1)
            return self.stream.read_reply(reply)
        except Exception as exc:
            if not is_transient(exc):
                raise
            self.lost = True
            return None
