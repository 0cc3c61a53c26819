"""The lanes presets' sizes on the command line (``--lane-*``, ``--tenant-*``, ``--min-share-*``),
kept apart from ``cli.py``: what ``lanes.py`` and ``tenants.py`` read from ``Options``."""

from __future__ import annotations

import argparse
from typing import Any

from producer.cli import argtypes

__all__ = ["add_lanes_arguments", "lanes_options"]

_MAX_S = 3600.0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= _MAX_S:
        raise argparse.ArgumentTypeError(f"{text} must be > 0 and <= {_MAX_S:g} seconds")
    return value


def _weight_pairs(text: str) -> tuple[tuple[int, int], ...]:
    """``A:B[,A:B]``: the two tenants' weights for each part of lanes-tenants."""
    try:
        pairs = tuple(
            (int(a), int(b)) for a, _, b in (p.strip().partition(":") for p in text.split(","))
        )
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give weight pairs, e.g. 1:1,3:1") from None
    if not pairs or min(min(p) for p in pairs) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive weight pairs, e.g. 1:1,3:1")
    return pairs


def add_lanes_arguments(parser: argparse.ArgumentParser) -> None:
    """The sizes of the lanes-backlog and lanes-tenants presets."""
    group = parser.add_argument_group("lanes-backlog and lanes-tenants sizes")
    add = group.add_argument
    count = argtypes.positive_int
    add("--lane-low-rows", type=count, default=1_000_000, metavar="N", help="low backlog rows")
    add("--lane-normal-rows", type=count, default=100_000, metavar="N", help="normal backlog")
    add("--lane-request-rows", type=count, default=32, metavar="N", help="rows per request")
    add(
        "--lane-caller-s",
        type=_seconds,
        default=10.0,
        metavar="S",
        help="each window: the caller alone, the backlog alone, the backlog with the caller",
    )
    add("--lane-rounds", type=count, default=2, metavar="N", help="pairs of backlog windows")
    add("--tenant-rows", type=count, default=100_000, metavar="N", help="each tenant's backlog")
    add("--tenant-request-rows", type=count, default=4, metavar="N", help="rows per request")
    add(
        "--tenant-weights",
        type=_weight_pairs,
        default=((1, 1), (3, 1)),
        metavar="A:B[,A:B]",
        help="the two tenants' weights, one part each (default 1:1,3:1)",
    )
    add("--min-share-s", type=_seconds, default=15.0, metavar="S", help="min share window")
    add("--min-share-high-rows", type=count, default=150_000, metavar="N", help="high backlog")
    add("--min-share-low-rows", type=count, default=30_000, metavar="N", help="low backlog")


_NAMES = (
    "lane_low_rows",
    "lane_normal_rows",
    "lane_request_rows",
    "lane_caller_s",
    "lane_rounds",
    "tenant_rows",
    "tenant_request_rows",
    "tenant_weights",
    "min_share_s",
    "min_share_high_rows",
    "min_share_low_rows",
)


def lanes_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``Options`` fields of the lanes presets, from the parsed arguments."""
    return {name: getattr(args, name) for name in _NAMES}
