"""The producer package stays light: it imports without onnxruntime, onnx or the worker package."""

from __future__ import annotations
import __future__

import ast
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from producer import codec, errors, keys

ROOT = Path(__file__).resolve().parent.parent
PRODUCER = ROOT / "producer"
HEAVY = ("onnxruntime", "onnx", "worker")

# Run in a fresh interpreter: a meta path finder makes the heavy packages unimportable, then
# every producer module found on disk is imported and the heavy names left in sys.modules listed.
_PROBE = """
import importlib, importlib.abc, json, pkgutil, sys

BLOCKED = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, Block())
for name in BLOCKED:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit(f"the blocker let {name} through")

import producer
names = ["producer"] + sorted(
    m.name for m in pkgutil.walk_packages(producer.__path__, "producer.")
    if m.name != "producer.__main__"
)
for name in names:
    importlib.import_module(name)
heavy = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
print(json.dumps({"imported": names, "heavy": heavy}))
"""


def _producer_modules() -> list[str]:
    names = []
    for path in PRODUCER.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


def test_producer_imports_without_onnxruntime_or_worker() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(HEAVY)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(report["imported"]) >= {"producer", "producer.codec", "producer.keys"}
    assert report["imported"] == _producer_modules()
    assert report["heavy"] == []


@pytest.mark.parametrize(
    "path", sorted(PRODUCER.rglob("*.py")), ids=lambda p: str(p.relative_to(PRODUCER))
)
def test_no_producer_module_imports_worker_anywhere(path: Path) -> None:
    # Lazy imports inside functions count too: the producer never depends on the worker.
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.partition(".")[0])
    never = {"worker", "onnxruntime"}
    assert not imported & never, f"{path.name} imports {sorted(imported & never)}"


def _public_names(module: ModuleType) -> set[str]:
    """Names a reader would take as public: defined here (or constants), not underscored."""
    names = set()
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, ModuleType) or value is __future__.annotations:
            continue
        defined_in = getattr(value, "__module__", module.__name__)
        if callable(value) and defined_in != module.__name__:
            continue  # imported helpers such as dataclass or Mapping
        names.add(name)
    return names


@pytest.mark.parametrize("module", [errors, keys, codec], ids=lambda m: m.__name__)
def test_all_lists_exactly_the_public_names(module: ModuleType) -> None:
    assert len(module.__all__) == len(set(module.__all__)), "a name is listed twice"
    assert sorted(module.__all__) == sorted(_public_names(module))


def test_every_error_class_descends_from_the_root() -> None:
    for name in errors.__all__:
        value = getattr(errors, name)
        if isinstance(value, type):
            assert issubclass(value, errors.RedbatchError), name
