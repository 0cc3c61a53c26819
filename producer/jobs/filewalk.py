"""Files in path order, found lazily: every file under a directory, or the files a glob matches.

``redbatch run`` sends a folder of a million images a file at a time, so the paths are not
gathered and sorted up front (a million of them hold some 100 MiB): each directory is listed
and sorted on its own, and walked depth first. Sorting a directory's entries by name, with a
'/' after a folder's, gives the order of the full path strings (``sorted()`` of them), because
two paths first differ inside one directory's entry names, where the '/' after a folder's name
is what the path string has there too.

A glob is matched segment by segment while walking from its fixed leading folders (``*``,
``?`` and ``[...]`` within a name, ``**`` for any number of folders), as ``glob.glob(...,
recursive=True)`` does, so only the folders it can match are entered. Hidden entries (names
starting with '.') are left out, unless a glob segment names them ('.cache/*'); symbolic links
to files are followed, to folders not (a link cycle cannot loop).
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["has_glob", "iter_files"]

_GLOB_CHARS = frozenset("*?[")


def has_glob(text: str) -> bool:
    """True when ``text`` holds a glob character."""
    return bool(_GLOB_CHARS & set(text))


def iter_files(text: str, exclude: tuple[Path, ...] = ()) -> Iterator[str]:
    """The regular files under directory ``text``, or those glob ``text`` matches, in path
    order, without the ``exclude`` files (the run's own output and errors file)."""
    if Path(text).is_dir():
        root, pattern = text, None
    else:
        root, pattern = _split(text)
    names = {p.name for p in exclude}
    excluded = {p.resolve() for p in exclude}
    for path in _walk(root, "" if root == "." and pattern is not None else root, pattern, {0}):
        if os.path.basename(path) in names and Path(path).resolve() in excluded:
            continue
        yield path


def _split(pattern: str) -> tuple[str, list[str]]:
    """A glob's fixed leading folders (where the walk starts) and its remaining segments."""
    parts = pattern.split(os.sep)
    fixed = 0
    while fixed < len(parts) - 1 and not has_glob(parts[fixed]):
        fixed += 1
    root = os.sep.join(parts[:fixed]) or ("." if not pattern.startswith(os.sep) else os.sep)
    return root, [p for p in parts[fixed:] if p]


def _walk(folder: str, shown: str, pattern: list[str] | None, states: set[int]) -> Iterator[str]:
    """Depth first, each folder's entries in path order; ``shown`` is how paths start,
    ``states`` the glob segments the folder's entries may match next."""
    try:
        with os.scandir(folder) as listing:
            entries = [(e.name + "/" if _is_folder(e) else e.name) for e in listing]
    except OSError:  # gone, or not ours to read: nothing under it is sent
        return
    for key in sorted(entries):
        name = key.rstrip("/")
        path = os.path.join(shown, name) if shown else name
        after = _step(pattern, states, name)
        if not after:
            continue
        if key.endswith("/"):
            if pattern is None or any(i < len(pattern) for i in after):
                yield from _walk(os.path.join(folder, name), path, pattern, after)
        elif (pattern is None or len(pattern) in _closure(pattern, after)) and os.path.isfile(
            os.path.join(folder, name)
        ):
            yield path


def _is_folder(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _closure(pattern: list[str], states: set[int]) -> set[int]:
    """``states`` and those reached through ``**`` segments matching no folder."""
    out, todo = set(), list(states)
    while todo:
        i = todo.pop()
        if i in out:
            continue
        out.add(i)
        if i < len(pattern) and pattern[i] == "**":
            todo.append(i + 1)
    return out


def _step(pattern: list[str] | None, states: set[int], name: str) -> set[int]:
    """The glob segments that may come after an entry called ``name`` (empty: no match)."""
    if pattern is None:
        return set() if name.startswith(".") else {0}
    after = set()
    for i in _closure(pattern, states):
        if i >= len(pattern):
            continue
        segment = pattern[i]
        hidden_ok = segment.startswith(".")
        if name.startswith(".") and not hidden_ok:
            continue
        if segment == "**":
            after.add(i)
        elif fnmatch.fnmatchcase(name, segment):
            after.add(i + 1)
    return after
