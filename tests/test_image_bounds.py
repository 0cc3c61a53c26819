"""The image example bounds what a decode may cost (issue 26, point 4): hostile files are refused
from their header, quickly and with a message naming the row and the limit; ordinary ones still
become the model's input. No model is needed: these call the handler's preprocess directly."""

from __future__ import annotations

import io
import time
import zlib

import numpy as np
import pytest

Image = pytest.importorskip("PIL.Image")

from examples.image.handler import OrientationPipeline, sample_page  # noqa: E402


def _images(*blobs: bytes) -> dict[str, np.ndarray]:
    return {"image": np.array(list(blobs), dtype=object)}


def _png(img: Image.Image, **options: object) -> bytes:
    out = io.BytesIO()
    img.save(out, "PNG", **options)
    return out.getvalue()


def _refused(handler: OrientationPipeline, data: bytes, match: str) -> float:
    """Preprocess a good page and ``data``; ``data`` (row 1) must be refused. Returns seconds."""
    good = sample_page(300, 400, "JPEG")
    started = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        handler.preprocess(_images(good, data))
    return time.perf_counter() - started


def test_a_small_16_bit_png_of_large_dimensions_is_refused_before_decoding() -> None:
    # 36 million 16-bit pixels in 70 KB: decoding and converting it took 616 MiB and 1.6 s
    hostile = _png(Image.fromarray(np.zeros((6000, 6000), np.uint16)), optimize=True)
    assert len(hostile) < 100_000
    took = _refused(
        OrientationPipeline(),
        hostile,
        r"image\[1\] would decode to 6000x6000 pixels \(36,000,000\); at most 16,777,216",
    )
    assert took < 2  # a decode took 1.6 s and 616 MiB; a header check, milliseconds


def test_a_large_png_is_refused_but_a_jpeg_as_large_decodes_scaled_down() -> None:
    handler = OrientationPipeline(max_decode_pixels=1_000_000)
    _refused(handler, sample_page(1200, 1600, "PNG"), r"image\[1\] would decode to 1200x1600")
    # The JPEG decodes at a quarter of its sides (draft mode): 300 x 400 pixels
    x = handler.preprocess(_images(sample_page(1200, 1600, "JPEG")))["x"]
    assert x.shape == (1, 3, 224, 224)


def test_wide_pixel_modes_are_refused() -> None:
    handler = OrientationPipeline(formats=("TIFF",))
    out = io.BytesIO()
    Image.fromarray(np.zeros((300, 400), np.float32), "F").save(out, "TIFF")
    with pytest.raises(ValueError, match=r"image\[0\] has 'F' pixels, which are not taken"):
        handler.preprocess(_images(out.getvalue()))


def test_an_animated_png_is_refused() -> None:
    frames = [Image.new("RGB", (300, 400), c) for c in ("white", "black", "white")]
    out = io.BytesIO()
    frames[0].save(out, "PNG", save_all=True, append_images=frames[1:])
    _refused(OrientationPipeline(), out.getvalue(), r"image\[1\] is animated \(3 frames\)")


def test_a_jpeg_of_several_pictures_decodes_its_first_scaled_down() -> None:
    # As phones write a photo with its gain map (an MPO file, to Pillow)
    photo = Image.open(io.BytesIO(sample_page(3000, 4000, "JPEG")))
    out = io.BytesIO()
    photo.save(out, "MPO", save_all=True, append_images=[photo.resize((300, 400))])
    handler = OrientationPipeline(max_decode_pixels=1_000_000)  # 1/8 scale: 375 x 500
    x = handler.preprocess(_images(out.getvalue()))["x"]
    assert x.shape == (1, 3, 224, 224)


@pytest.mark.parametrize(
    ("width", "height", "match"),
    [
        (8000, 6000, "declares 8000x6000 pixels"),  # over max_pixels
        (100_000, 100_000, "decompression bomb"),  # over twice Pillow's own limit
        (1, 1_000_000, "further apart"),  # a strip
    ],
)
def test_declared_sizes_over_the_limits_are_refused(width: int, height: int, match: str) -> None:
    data = _png(Image.new("L", (1, 1)))
    # The header's dimensions patched (IHDR, the first chunk: width and height at bytes 16-24)
    header = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    ihdr = b"IHDR" + header + data[24:29]
    patched = data[:16] + header + data[24:29] + zlib.crc32(ihdr).to_bytes(4, "big") + data[33:]
    assert _refused(OrientationPipeline(), patched, rf"image\[1\] .*{match}") < 2


def test_ordinary_images_of_every_mode_still_become_the_model_input() -> None:
    handler = OrientationPipeline()
    page = Image.open(io.BytesIO(sample_page(300, 400)))
    grey = page.convert("L")
    wide = Image.fromarray(np.asarray(grey).astype(np.uint16) * 257)  # 16-bit grey
    clear = page.convert("RGBA")
    clear.putalpha(0)  # fully transparent: flattened onto white
    blobs = [_png(img) for img in (page, grey, page.convert("RGBA"), page.convert("P"), wide)]
    white = Image.new("RGB", (300, 400), "white")
    blobs += [sample_page(1200, 1600, "JPEG"), _png(clear), _png(white)]
    x = handler.preprocess(_images(*blobs))["x"]
    assert x.shape == (8, 3, 224, 224)
    assert x.dtype == np.float32
    assert np.isfinite(x).all()
    assert np.array_equal(x[4], x[1])  # 16-bit grey scaled to its high byte: as 8-bit grey
    assert np.abs(x[1:4] - x[0]).mean() < 0.05
    assert np.abs(x[6] - x[7]).max() < 1e-6  # transparent is white


def test_a_file_that_is_no_image_is_named_by_its_first_bytes_not_pillows_stream() -> None:
    """Pillow's own message names its stream (``<_io.BytesIO object at 0x...>``), which tells
    the caller nothing; the reply shows how the data starts instead."""
    handler = OrientationPipeline()
    with pytest.raises(ValueError, match="it starts with") as refused:
        handler.preprocess(_images(b"notanimage"))
    assert "BytesIO" not in str(refused.value)
    assert "image[0] is not a readable JPEG or PNG file (10 bytes): it starts with b'notanima'" in (
        str(refused.value)
    )
