"""The producer package stays light: it imports without onnxruntime, onnx or the worker package."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from producer.protocol import bounded, codec, errors, keys, replies, tensors, text

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


def _blocked_run(code: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run ``code`` after the probe's blocker (its first half) has made the heavy packages
    unimportable, as on a producer-only install."""
    blocker = _PROBE.split("import producer\n", 1)[0]
    return subprocess.run(
        [sys.executable, "-c", blocker + code, ",".join(HEAVY[:2]), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


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
    assert set(report["imported"]) >= {
        "producer",
        "producer.protocol.codec",
        "producer.protocol.keys",
    }
    assert report["imported"] == _producer_modules()
    assert report["heavy"] == []


def test_a_plain_install_is_the_producer_and_the_worker_extra_brings_the_runtime() -> None:
    # A web back end that installs the client must not pull onnxruntime-gpu (hundreds of MB).
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    runtimes = {"onnxruntime", "onnxruntime-gpu"}

    def names(requirements: list[str]) -> set[str]:
        return {r.split(";")[0].split(">")[0].split("[")[0].strip() for r in requirements}

    assert not names(project["dependencies"]) & runtimes
    extras = project["optional-dependencies"]
    assert names(extras["worker"]) - {"prometheus-client"} == runtimes  # one, by platform marker
    for extra in ("demo", "dev"):
        assert any(
            r.startswith("redbatch[") and "worker" in r.split("[")[1].rstrip("]").split(",")
            for r in extras[extra]
        ), extra


def test_the_cli_packages_are_an_extra_that_the_tool_extras_pull_in() -> None:
    # The library needs neither the progress bar nor the metrics parser: only the CLI does
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    cli_only = {"tqdm", "prometheus-client"}
    assert not {r.split(">")[0].split("[")[0] for r in project["dependencies"]} & cli_only
    extras = project["optional-dependencies"]
    assert {r.split(">")[0] for r in extras["cli"]} == cli_only
    assert any(r.startswith("prometheus-client") for r in extras["worker"])  # its /metrics
    for extra in ("demo", "dev", "examples"):
        assert any(
            r.startswith("redbatch[") and "cli" in r.split("[")[1].rstrip("]").split(",")
            for r in extras[extra]
        ), extra


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh interpreter from the checkout; it must succeed."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_the_blocking_client_loads_neither_the_asyncio_shell_nor_the_cli_packages() -> None:
    # A fresh interpreter, as a script that only wants Client starts
    code = (
        "import json, sys\n"
        "import redis\n"
        "with_redis = 'redis.asyncio' in sys.modules\n"
        "import producer\n"
        "from producer import Client\n"
        "print(json.dumps({'with_redis': with_redis, 'modules': sorted(sys.modules)}))\n"
    )
    done = _fresh_python(code)
    report = json.loads(done.stdout)
    loaded = set(report["modules"])
    unwanted = {"producer.client.aio", "producer.client.coalesce", "tqdm", "prometheus_client"}
    if not report["with_redis"]:  # redis-py 8 imports redis.asyncio in its own __init__
        unwanted.add("redis.asyncio")
    assert not loaded & unwanted
    assert "producer.client.blocking" in loaded


def test_async_client_is_imported_at_first_use() -> None:
    code = (
        "import sys\n"
        "import producer\n"
        "assert 'producer.client.aio' not in sys.modules\n"
        "from producer import AsyncClient\n"
        "from producer.client.aio import AsyncClient as Defined\n"
        "assert AsyncClient is Defined and 'AsyncClient' in dir(producer)\n"
    )
    _fresh_python(code)


def test_a_worker_without_onnxruntime_says_what_to_install(tmp_path: Path) -> None:
    from tools.synthetic import save

    save("demo", tmp_path / "demo.onnx")
    (tmp_path / "w.toml").write_text(
        '[model]\nname = "demo"\npath = "demo.onnx"\n', encoding="utf-8"
    )
    code = "from worker.cli import main\nraise SystemExit(main(sys.argv[2:]))\n"
    result = _blocked_run(code, "--config", str(tmp_path / "w.toml"), "--check")
    assert result.returncode == 2, result.stderr
    assert "onnxruntime cannot be imported" in result.stderr
    assert "'redbatch[worker]'" in result.stderr
    assert "Traceback" not in result.stderr


def _top_level_imports(path: Path) -> set[str]:
    """Every package a module imports, lazy imports inside functions included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.partition(".")[0])
    return imported


@pytest.mark.parametrize(
    "path", sorted(PRODUCER.rglob("*.py")), ids=lambda p: str(p.relative_to(PRODUCER))
)
def test_no_producer_module_imports_worker_anywhere(path: Path) -> None:
    # The producer never depends on the worker, nor on the checkout's tools.
    never = {"worker", "onnxruntime", "tools"}
    imported = _top_level_imports(path)
    assert not imported & never, f"{path.name} imports {sorted(imported & never)}"


@pytest.mark.parametrize("path", sorted((ROOT / "worker").rglob("*.py")), ids=lambda p: p.name)
def test_no_worker_module_imports_the_tools(path: Path) -> None:
    assert "tools" not in _top_level_imports(path), f"{path.name} imports tools"


def test_the_wheel_holds_the_client_and_the_worker_and_no_tooling(tmp_path: Path) -> None:
    # Given the wheel a plain `pip install redbatch` would install, built from a clean copy of
    # the checkout's files (setuptools reuses ./build, which may hold deleted modules)
    source = tmp_path / "src"
    tracked = subprocess.run(
        [
            "git",
            "ls-files",
            "--cached",
            "--others",
            "--exclude-standard",
            "--",
            "pyproject.toml",
            "README.md",
            "producer",
            "worker",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in (n for n in tracked if (ROOT / n).is_file()):  # deleted, not yet committed
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    [wheel] = tmp_path.glob("redbatch-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        modules = {n for n in zf.namelist() if n.endswith(".py")}
    # Then it holds producer and worker, every module of each, and nothing else of the checkout
    packages = {m.split("/", 1)[0] for m in modules}
    assert packages == {"producer", "worker"}
    on_disk = {
        str(p.relative_to(ROOT))
        for top in ("producer", "worker")
        for p in (ROOT / top).rglob("*.py")
    }
    assert modules == on_disk
    # And no load test, demo runner, model builder or throwaway Redis among them
    tooling = ("bench", "benchkit", "demo", "synthetic", "localredis")
    assert not [m for m in modules if any(t in Path(m).stem for t in tooling)]


def _public_names(module: ModuleType) -> set[str]:
    """Names a reader would take as public: defined at the module's top level (classes,
    functions, constants), not underscored. Imported names are not the module's own."""
    tree = ast.parse(Path(module.__file__ or "").read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if not name.startswith("_")}


#: Modules that re-export their siblings' names, so callers import the wire format from one place.
_FACADES: dict[str, tuple[ModuleType, ...]] = {codec.__name__: (bounded, replies, tensors, text)}


@pytest.mark.parametrize(
    "module", [errors, keys, codec, replies, tensors, bounded, text], ids=lambda m: m.__name__
)
def test_all_lists_exactly_the_public_names(module: ModuleType) -> None:
    assert len(module.__all__) == len(set(module.__all__)), "a name is listed twice"
    siblings = _FACADES.get(module.__name__, ())
    reexported = {
        name
        for name in module.__all__
        if any(getattr(sib, name, None) is getattr(module, name) for sib in siblings)
        and any(name in sib.__all__ for sib in siblings)
    }
    assert sorted(set(module.__all__) - reexported) == sorted(_public_names(module))


def test_every_error_class_descends_from_the_root() -> None:
    for name in errors.__all__:
        value = getattr(errors, name)
        if isinstance(value, type):
            assert issubclass(value, errors.RedbatchError), name
