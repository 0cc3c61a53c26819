"""``redbatch status --model NAME`` for a name this Redis knows nothing of: say so, and name the
models it does hold, as ``redbatch run`` does for a misspelled model.

A model is known by any key it leaves: a request stream, a shard list, a dead letter, a live
worker's record (the keys ``producer.ops.models`` scans for). Without any of them the full report
would be a page of zeros that reads like an idle queue, so the command prints this instead and
exits 1: nothing to show is not success. A model that has a live worker but no request yet is
known, and gets the full report.
"""

from __future__ import annotations

import difflib

from producer.ops.models import Found
from producer.ops.status import ModelStatus
from producer.ops.textformat import printable
from producer.ops.words import fit

__all__ = ["format_unknown", "is_unknown"]


def is_unknown(status: ModelStatus) -> bool:
    """True when the model leaves no key here: no request stream on any shard, no shard list,
    no dead letter, no live worker, no lane, and no damaged key under its name."""
    return (
        not status.requests.exists  # summed over the shards: any of them
        and not any(shard.lanes.lanes for shard in status.shards)
        and len(status.shards) <= 1
        and status.dead.count == 0
        and not status.workers
        and not status.damage
    )


def format_unknown(status: ModelStatus, found: Found | None, where: str | None = None) -> str:
    """What to say of an unknown model: that nothing here names it, the models that are here
    (when this user may ``SCAN``: ``found`` is None else), the nearest name, and what to check."""
    at = f" at {where}" if where else ""
    lines = [
        f"model {status.model!r} not found under prefix {status.prefix!r}{at}",
        "  no requests stream, shard list, dead letter or live worker has its name",
    ]
    if found is not None:
        names = sorted(found.models)
        more = "" if found.complete else " (the scan stopped early: there may be others)"
        listed = ", ".join(repr(n) for n in names) if names else "none"
        lines.append(f"  models here: {listed}{more}")
        near = difflib.get_close_matches(status.model, names, n=1)
        if near:
            lines.append(f"  did you mean {near[0]!r}?")
    lines.append("  check --model and --prefix; redbatch status without --model lists each model")
    return "\n".join(fit(map(printable, lines)))
