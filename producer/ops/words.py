"""Counted nouns and lines that fit a terminal: the small wording rules every report shares.

``count(1, "dead letter")`` is ``1 dead letter``, never ``1 dead letters``; ``fit`` folds the
lines of a view to 80 columns, so a frame of ``redbatch status --watch`` (and the plain report)
never wraps at the terminal's edge, where a wrapped line loses its indentation and its place in
a table; ``under`` folds one labelled value so that it goes on under its label.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable

__all__ = ["LABEL", "WIDTH", "clip", "count", "fit", "under"]

#: The terminal width the views are laid out for.
WIDTH = 80
#: The width of a view's label column (``queue    ``): where a folded label line goes on.
LABEL = 9


def count(n: int | float, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, the noun in the plural unless ``n`` is 1: ``1 row``, ``2 rows``,
    ``1,204 entries`` (``plural`` for nouns not made by adding an s)."""
    word = noun if n == 1 else (plural or noun + "s")
    number = f"{n:,}" if isinstance(n, int) else f"{n:,g}"
    return f"{number} {word}"


def clip(text: str, width: int) -> str:
    """``text`` at most ``width`` characters, cut in the middle (``redbatch-..5-x2k4p``), so
    that names that differ at the end (pods of one deployment) stay told apart."""
    if len(text) <= width:
        return text
    if width <= 4:
        return text[:width]
    head = (width - 2) // 2
    tail = width - 2 - head
    return f"{text[:head]}..{text[-tail:]}"


def fit(lines: Iterable[str], width: int = WIDTH) -> list[str]:
    """Each line longer than ``width`` folded at spaces (a word longer than a line is cut), its
    continuation indented under the text: a label line's under the label column, an indented
    line's two further in."""
    out: list[str] = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        lead = len(line) - len(line.lstrip(" "))
        if lead == 0:
            more = LABEL
        elif lead >= LABEL:
            more = lead
        else:
            more = lead + 2
        out += textwrap.wrap(
            line.strip(),
            width,
            initial_indent=" " * lead,
            subsequent_indent=" " * min(more, width // 2),
            break_long_words=True,
            break_on_hyphens=False,
        )
    return out


def under(label: str, text: str, width: int = WIDTH, *, hang: int = 0) -> list[str]:
    """``label + text`` folded to ``width``, each further line starting under the text's first
    character, ``hang`` further in (a label wider than half the line: under half of it), so
    that a long value keeps its label's column. It folds after a comma
    where it can, so that a figure keeps its unit (``timeout 30.0 s``), and at spaces within a
    part too long for a line (a word longer than a line is cut)."""
    indent = " " * min(len(label) + hang, width // 2)
    parts = text.split(", ")
    pieces = [p + "," for p in parts[:-1]] + parts[-1:]
    lines: list[str] = []
    line = label
    for piece in pieces:
        if line not in (label, indent):
            if len(line) + 1 + len(piece) <= width:
                line += " " + piece
                continue
            lines.append(line)
            line = indent
        if len(line) + len(piece) <= width:
            line += piece
            continue
        folded = textwrap.wrap(
            piece,
            width,
            initial_indent=line,
            subsequent_indent=indent,
            break_long_words=True,
            break_on_hyphens=False,
        )
        lines += folded[:-1]
        line = folded[-1]
    return [*lines, line.rstrip()]
