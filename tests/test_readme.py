"""The README's module table matches the tree: every module it names exists, and every module of
the installed packages is named (a newcomer reads the architecture there)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("producer", "worker")


def _table_paths() -> set[str]:
    """The module paths in the first cells of the README's module table."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("| module | its one job |")
    rows = [line for line in text[start:].splitlines()[2:] if line.startswith("|")]
    paths: set[str] = set()
    for row in rows:
        cell = row.split("|")[1]
        folder = ""
        for name in re.findall(r"`([^`]+)`", cell):
            if "/" in name:
                folder, _, leaf = name.rpartition("/")
                paths.add(f"{folder}/{leaf}" if leaf else f"{folder}/")
            elif folder:
                paths.add(f"{folder}/{name}")
    return paths


def test_every_module_the_readme_names_exists() -> None:
    missing = sorted(p for p in _table_paths() if not (ROOT / p).exists())
    assert not missing, f"the README's module table names modules that are gone: {missing}"


def test_every_module_of_the_packages_is_in_the_readme() -> None:
    named = _table_paths()
    modules = {
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in (ROOT / package).glob("*.py")
        if path.stem not in ("__init__", "__main__")
    }
    unnamed = sorted(modules - named)
    assert not unnamed, f"modules missing from the README's module table: {unnamed}"
