"""The README's map of the code matches the tree: one row per folder of the installed packages
(a newcomer reads the architecture from it), every folder it names exists, and every top-level
worker module is named in its row."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("producer", "worker")


def _rows() -> dict[str, str]:
    """The README's map: first cell (a folder, or ``worker/*.py``) to the second."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("| folder | what it holds |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        _, first, second, *_ = line.split("|")
        (name,) = re.findall(r"`([^`]+)`", first)
        rows[name] = second
    return rows


def _folders() -> set[str]:
    return {
        f"{path.parent.relative_to(ROOT)}/"
        for package in PACKAGES
        for path in (ROOT / package).glob("*/__init__.py")
    }


def test_every_folder_the_readme_names_exists() -> None:
    missing = sorted(n for n in _rows() if n.endswith("/") and not (ROOT / n).is_dir())
    assert not missing, f"the README's map names folders that are gone: {missing}"


def test_every_folder_of_the_packages_has_its_row() -> None:
    unnamed = sorted(_folders() - set(_rows()))
    assert not unnamed, f"folders missing from the README's map: {unnamed}"


def test_every_top_level_worker_module_is_named() -> None:
    row = _rows()["worker/*.py"]
    modules = {p.name for p in (ROOT / "worker").glob("*.py")} - {"__init__.py", "__main__.py"}
    unnamed = sorted(m for m in modules if f"`{m}`" not in row)
    assert not unnamed, f"top-level worker modules missing from the README's map: {unnamed}"


def test_the_producer_keeps_no_modules_outside_its_folders() -> None:
    loose = {p.name for p in (ROOT / "producer").glob("*.py")} - {"__init__.py", "__main__.py"}
    assert not loose, f"producer modules outside a folder: {sorted(loose)}"
