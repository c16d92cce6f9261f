"""Guarded image decoding: raw bytes of an image part in, one RGB `PIL.Image` out, or an `ImageDecodeError`.

The format is sniffed from the bytes (magic numbers); a `mime_type` from the client is only a hint and never decides.
Everything that can be checked from the header is checked before any pixel is decoded: Pillow's `Image.open` reads
only the header, so a 30000x30000 PNG is refused with its size known and nothing allocated. Only the first frame of a
GIF or animated WebP is decoded; the frame count is never asked for (`n_frames` would walk every frame of a
10,000-frame GIF): an animation is refused once it shows a frame past `max_frames`, found by seeking that far only.

Transparency is composited on white, as transformers' `convert_to_rgb` does before every image processor of the
families we serve, so that an RGBA image preprocesses the same here as in the reference.

This module knows nothing of gRPC: the service maps `ImageDecodeError.reason` to INVALID_ARGUMENT on
`contents[i].parts[j].image`.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from omnivox.codecs.text_payload import decoded_head

# Magic numbers -> our format name (also Pillow's plugin name). TIFF is recognised only to name it in the error.
_JPEG, _PNG, _GIF, _WEBP, _BMP, _TIFF = "JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF"
SUPPORTED_FORMATS = frozenset({_JPEG, _PNG, _GIF, _WEBP, _BMP})
# Image modes holding more than 8 bits per sample (16-bit grayscale PNG opens as I;16); Pillow's own convert("RGB")
# clips them at 255, so almost any 16-bit image came out white.
_WIDE_GRAY_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})


class ImageDecodeError(ValueError):
    """The bytes are not an image we accept. `reason` is one line, fit to show the client."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RequestPixelsError(ImageDecodeError):
    """The image takes its request past `ImageLimits.max_request_pixels`: the request's later images go undecoded."""


@dataclass(frozen=True)
class ImageLimits:
    """What the server accepts. Pixel counts are read from the header and checked before decoding."""

    max_bytes: int = 20 * 1024 * 1024
    # 40 MP (a 7300x5500 photo): below Pillow's own bomb threshold (89.5 MP warns, 179 MP raises), so Pillow never
    # warns about an image we go on to accept. Decoding 40 MP to RGB takes 120 MB.
    max_pixels: int = 40_000_000
    max_aspect_ratio: float = 200.0  # longer side / shorter side; Qwen2.5-VL's processor refuses more than 200
    min_side: int = 2  # a 1x1 image carries nothing and breaks some resizers
    max_images: int = 16  # per request; counted by the service before decoding any of them
    # Pixels of all the images of one request together (`serve --max-request-megapixels`), checked on each header
    # before that image is decoded. The per-image and count limits alone let a request hold 16 x 40 MP; what it holds
    # is each image's processor output, kept until encoded: Qwen2.5-VL keeps up to 12.8 MP of an image as float32
    # patches of 2 frames (24 bytes a pixel, 308 MB), so 16 large photos held 4.9 GB. 48 MP: one image at the
    # per-image limit still fits, or four 12 MP phone photos; at most 1.15 GB of Qwen2.5-VL pixels a request. vLLM
    # bounds only the count (`limit_mm_per_prompt`), llama.cpp scales each image down to the model's own maximum,
    # TGI bounds the bytes a request fetches (`max_image_fetch_size`).
    max_request_pixels: int = 48_000_000
    # An animation with more frames is refused (a question about a picture is about one frame; a 10,000-frame GIF
    # is an attack on the decoder): at most this many frames are parsed to find out.
    max_frames: int = 100
    formats: frozenset[str] = field(default=SUPPORTED_FORMATS)

    def __post_init__(self) -> None:
        unknown = set(self.formats) - SUPPORTED_FORMATS
        if unknown:
            raise ValueError(f"unsupported image formats {sorted(unknown)}; choose among {sorted(SUPPORTED_FORMATS)}")
        smallest = min(self.max_bytes, self.max_pixels, self.min_side, self.max_images, self.max_request_pixels)
        if smallest < 1 or self.max_aspect_ratio < 1:
            raise ValueError(f"image limits must be positive (aspect >= 1): {self}")


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # mode "RGB", EXIF orientation applied
    format: str  # one of SUPPORTED_FORMATS, sniffed from the bytes
    width: int  # after orientation
    height: int


def sniff_format(data: bytes) -> str | None:
    """The image format named by the first bytes, or None when no known signature matches."""
    if data.startswith(b"\xff\xd8\xff"):
        return _JPEG
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return _PNG
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return _GIF
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _WEBP
    if data.startswith(b"BM") and len(data) >= 26:
        return _BMP
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return _TIFF
    return None


def refused_format_name(data: bytes) -> str | None:
    """The name of an image format we recognise only to refuse it by name (SVG, HEIC/HEIF, AVIF, JPEG XL), else
    None. Phones send HEIC and web pages SVG: "not an image in a known format" would leave the user guessing."""
    head = data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if head.startswith((b"<svg", b"<?xml", b"<!doctype svg")) and b"<svg" in head:
        return "SVG"
    if data[4:8] == b"ftyp":  # an ISO base media file: its major brand says which
        brand = data[8:12]
        if brand in (b"avif", b"avis"):
            return "AVIF"
        if brand in (b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1"):
            return "HEIC/HEIF"
    if data.startswith(b"\xff\x0a") or data[:12] == b"\x00\x00\x00\x0cJXL \r\n\x87\n":
        return "JPEG XL"
    return None


def decode_image(
    data: bytes, limits: ImageLimits = ImageLimits(), mime_type: str | None = None, pixels_before: int = 0
) -> DecodedImage:
    """Decode `data` to RGB under `limits`; raise ImageDecodeError naming the first problem.

    `pixels_before`: the pixels of the request's images decoded before this one; an image that takes the request past
    `limits.max_request_pixels` is refused from its header, before its pixels are decoded. `mime_type` is only used
    to word the error when the bytes are not an image. Safe to call from worker threads (no global Pillow state is
    changed).
    """
    if not data:
        raise ImageDecodeError("the image is empty (0 bytes)")
    if len(data) > limits.max_bytes:
        raise ImageDecodeError(f"the image is {len(data)} bytes; the limit is {limits.max_bytes}")
    fmt = sniff_format(data)
    if fmt is None:
        named = refused_format_name(data)
        if named:
            raise ImageDecodeError(f"{named} images are not accepted; send {_format_list(limits)}")
        as_text = decoded_head(data)
        if as_text is not None and (sniff_format(as_text[1]) or refused_format_name(as_text[1])):
            inner = sniff_format(as_text[1]) or refused_format_name(as_text[1])
            raise ImageDecodeError(
                f"the bytes are {as_text[0]} of a {inner} image, not the image: send the file's raw bytes "
                "(JSON clients base64-encode them once themselves)"
            )
        hint = f" (mime_type says {mime_type!r})" if mime_type else ""
        raise ImageDecodeError(f"the bytes are not an image in a known format{hint}; send {_format_list(limits)}")
    if fmt not in limits.formats:
        raise ImageDecodeError(f"{fmt} images are not accepted; send {_format_list(limits)}")
    try:
        # formats=[fmt]: only that plugin may claim the bytes, so a sniffed PNG is never parsed by another decoder.
        im = Image.open(io.BytesIO(data), formats=[fmt])
    except Image.DecompressionBombError:
        raise ImageDecodeError(f"the image has too many pixels; the limit is {limits.max_pixels}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageDecodeError(f"the {fmt} header is corrupt: {_one_line(e)}") from None
    width, height = im.size
    _check_size(width, height, limits)
    if pixels_before + width * height > limits.max_request_pixels:
        raise RequestPixelsError(
            f"the request's images up to this one ({width}x{height}) are {pixels_before + width * height} pixels; "
            f"the limit is {limits.max_request_pixels} per request (the images after it are not decoded)"
        )
    try:
        if getattr(im, "is_animated", False):  # GIF / WebP: read up to frame max_frames, never all of them
            try:
                im.seek(limits.max_frames)
            except EOFError:
                pass
            else:
                raise ImageDecodeError(f"the animation has more than {limits.max_frames} frames; send one image")
        im.seek(0)  # the first frame is the image
        im.load()
    except ImageDecodeError:  # a ValueError too: the frame-count refusal must not read as "corrupt" data
        raise
    except Image.DecompressionBombError:
        raise ImageDecodeError(f"the image has too many pixels; the limit is {limits.max_pixels}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageDecodeError(f"the {fmt} data is truncated or corrupt: {_one_line(e)}") from None
    im = _apply_exif_orientation(im)
    rgb = to_rgb(im)
    return DecodedImage(image=rgb, format=fmt, width=rgb.width, height=rgb.height)


def to_rgb(im: Image.Image) -> Image.Image:
    """Any Pillow mode to RGB. Transparency (alpha band or palette/grayscale transparency) is composited on white,
    exactly as transformers' `convert_to_rgb`; CMYK, YCbCr, grayscale and palette images convert as Pillow does."""
    if im.mode == "RGB":
        return im
    if im.mode in _WIDE_GRAY_MODES:
        im = _wide_gray_to_8_bit(im)
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB")


def _wide_gray_to_8_bit(im: Image.Image) -> Image.Image:
    """16-bit (or 32-bit integer) grayscale -> 8-bit L by its high byte, as Pillow reads 16-bit RGB and LA PNGs; a
    tRNS gray value becomes an alpha band (compared at full depth, before two values can share a high byte)."""
    values = np.asarray(im).astype(np.int64)  # [H, W]
    gray = Image.fromarray((np.clip(values, 0, 65535) >> 8).astype(np.uint8), "L")
    transparent = im.info.get("transparency")
    if not isinstance(transparent, int):
        return gray
    alpha = Image.fromarray(np.where(values == transparent, 0, 255).astype(np.uint8), "L")
    return Image.merge("LA", (gray, alpha))


def image_content_key(data: bytes, model: str, settings: Mapping[str, Any]) -> str:
    """The encoder-cache and prefix-cache key of one image: sha256 over the raw bytes, the model name and the
    preprocessing settings (e.g. `VisionEncoder.feature_settings()` plus a per-request `max_pixels`).

    Same bytes under different settings (another max_pixels, another model) give different keys; transposing an image
    changes its bytes and so its key. Settings must be JSON-serialisable; their key order does not matter.
    """
    h = hashlib.sha256()
    h.update(b"omnivox-image-v1\0")
    h.update(model.encode())
    h.update(b"\0")
    h.update(json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str).encode())
    h.update(b"\0")
    h.update(hashlib.sha256(data).digest())
    return h.hexdigest()


def _check_size(width: int, height: int, limits: ImageLimits) -> None:
    if width < limits.min_side or height < limits.min_side:
        raise ImageDecodeError(f"the image is {width}x{height}; each side must be at least {limits.min_side} pixels")
    if width * height > limits.max_pixels:
        raise ImageDecodeError(
            f"the image is {width}x{height} = {width * height} pixels; the limit is {limits.max_pixels}"
        )
    ratio = max(width, height) / min(width, height)
    if ratio > limits.max_aspect_ratio:
        raise ImageDecodeError(
            f"the image is {width}x{height}, aspect ratio {ratio:.0f}:1; the limit is {limits.max_aspect_ratio:g}:1"
        )


def _apply_exif_orientation(im: Image.Image) -> Image.Image:
    try:
        return ImageOps.exif_transpose(im)
    except (OSError, SyntaxError, ValueError, KeyError, TypeError, struct.error):
        return im  # an unreadable EXIF block does not make the pixels wrong: keep them as stored


def _format_list(limits: ImageLimits) -> str:
    return ", ".join(sorted(limits.formats))


def _one_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:200]
