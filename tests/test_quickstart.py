"""The README's quick start, walked from a fresh clone, so the front page cannot drift from the
code: its block is exactly the two commands, and the first (the main job end to end on the demo
model, with no Redis answering at REDIS_URL, so it starts a throwaway one) runs in a clone of
this checkout and checks every answer. The second, the test command, is what CI runs (``.ci/run``)
on its own fresh clone. (``tests/test_readme_runs.py`` walks the README's ``redbatch run``
examples.)"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _quick_start() -> list[str]:
    """The commands of the README's quick start block, comments dropped."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Quick start") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "the quick start has no bash block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_quick_start_is_two_commands_and_ci_runs_the_second() -> None:
    assert _quick_start() == ["./scripts/demo.sh", "./scripts/test.sh"]
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert os.access(ROOT / script, os.X_OK), f"{script} is not executable"
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_the_dev_extra_holds_the_demo_and_examples_extras() -> None:
    """scripts/bootstrap.sh takes a fresh dev install for any extra: true only while dev holds
    what each of the others brings."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]

    def expand(names: list[str]) -> set[str]:
        out: set[str] = set()
        for requirement in names:
            nested = re.fullmatch(r"redbatch\[(.+)\]", requirement)
            if nested:
                out |= expand([r for e in nested.group(1).split(",") for r in extras[e]])
            else:
                out.add(requirement)
        return out

    dev = expand(extras["dev"])
    for name in ("demo", "examples", "worker", "cli", "parquet"):
        assert expand(extras[name]) <= dev, name


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_demo_runs_end_to_end_from_a_fresh_clone(tmp_path: Path) -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    # The checkout's .venv, installed already by scripts/bootstrap.sh (test.sh). The clone's
    # pyproject.toml gets the install stamp's time, so bootstrap.sh finds the install fresh and
    # never reinstalls: a reinstall from the clone would point the shared .venv's editable
    # install at a folder this test deletes. The clone's own code runs (`python -m` from it).
    stamps = [ROOT / ".venv" / f".redbatch-{extra}" for extra in ("dev", "demo")]
    stamp = next((s for s in stamps if s.is_file()), None)
    if stamp is None:
        pytest.skip("the checkout's .venv was not made by scripts/bootstrap.sh")
    (clone / ".venv").symlink_to(ROOT / ".venv")
    made = stamp.stat().st_mtime_ns - 1_000_000_000  # older, not a rounding error newer
    os.utime(clone / "pyproject.toml", ns=(made, made))
    scripts_before = (ROOT / ".venv" / "bin" / "redbatch").read_bytes()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(
        os.environ,
        REDIS_URL=f"redis://127.0.0.1:{_closed_port()}/0",  # nothing answers: a throwaway Redis
        TMPDIR=str(scratch),
        PIP_NO_INDEX="1",  # and should bootstrap.sh try to install all the same, it fails first
    )
    command = _quick_start()[0]
    done = subprocess.run(
        [command],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = done.stdout + done.stderr
    assert (ROOT / ".venv" / "bin" / "redbatch").read_bytes() == scripts_before, "reinstalled"
    assert done.returncode == 0, out[-4000:]
    assert "REDIS_URL does not answer; started a throwaway redis-server" in out, out[-4000:]
    assert "stopped the throwaway redis-server" in out, out[-4000:]
    assert "served outputs match a direct onnxruntime run on all 5000 rows" in out, out[-4000:]
    assert re.search(r"rows\s+5000 ok, 0 failed", out), out[-4000:]
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("redbatch-demo-")]
