"""What ``XINFO STREAM`` and ``XINFO GROUPS`` tell of a request stream damaged under the workers.

Measured on Redis 7.0.15 (docs/operations.md, "A damaged stream"): a trim (``XADD ... MAXLEN``,
``MINID``, ``XTRIM``) leaves the group's ``lag`` as it was, but ``entries-added - entries-read``
then exceeds the stream's length by the undelivered entries it deleted; ``lag`` turning null is
no sign of it (acknowledgements out of order do that too). An entry with the largest id ends the
stream's id space. Workers (``worker.redisio.group``) and ``redbatch status``
(``producer.ops.damage``) read both the same way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_ID", "REPAIR", "is_exhausted", "undelivered_lost"]

#: The largest stream id: once a stream holds it, every ``XADD *`` fails.
MAX_ID = "18446744073709551615-18446744073709551615"
#: Where an operator reads what a damage means and how to repair it.
REPAIR = 'docs/operations.md, "A damaged stream"'


def undelivered_lost(stream: Any, group: Any) -> int | None:
    """Undelivered entries deleted from the stream (at least): ``entries-added - entries-read -
    length`` of ``XINFO STREAM`` and the group's ``XINFO GROUPS`` row; None when Redis does not
    know the group's ``entries-read`` (a group just created or moved, an AOF reload)."""
    if not isinstance(stream, dict) or not isinstance(group, dict):
        return None
    added, read, length = (
        stream.get("entries-added"),
        group.get("entries-read"),
        stream.get("length"),
    )
    if isinstance(added, int) and isinstance(read, int) and isinstance(length, int):
        return max(0, added - read - length)
    return None


def is_exhausted(stream: Any) -> bool:
    """Whether ``XINFO STREAM``'s answer says the stream holds the largest possible id."""
    if not isinstance(stream, dict):
        return False
    last = stream.get("last-generated-id")
    text = last.decode("ascii", "replace") if isinstance(last, bytes) else str(last)
    return text == MAX_ID
