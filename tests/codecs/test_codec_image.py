"""Guarded image decoding (codecs/image.py) on real images generated here with Pillow."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib

import numpy as np
import pytest
import soundfile as sf
from PIL import Image, ImageFile

from omnivox.codecs.audio_input import AudioInputError, decode_audio
from omnivox.codecs.image import (
    ImageDecodeError,
    ImageLimits,
    RequestPixelsError,
    decode_image,
    image_content_key,
    sniff_format,
)


def _encode(im: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _gradient(w: int = 40, h: int = 30, mode: str = "RGB") -> Image.Image:
    im = Image.new("RGB", (w, h))
    im.putdata([((x * 6) % 256, (y * 8) % 256, (x + y) % 256) for y in range(h) for x in range(w)])
    return im.convert(mode)


@pytest.mark.parametrize(
    ("fmt", "kwargs"),
    [("JPEG", {"quality": 95}), ("PNG", {}), ("WEBP", {"lossless": True}), ("GIF", {}), ("BMP", {})],
)
def test_each_format_decodes_to_rgb(fmt, kwargs):
    src = _gradient()
    data = _encode(src, fmt, **kwargs)
    out = decode_image(data, mime_type="application/octet-stream")  # the hint is wrong: the bytes decide
    assert out.format == fmt
    assert out.image.mode == "RGB"
    assert (out.width, out.height) == (40, 30) == out.image.size
    if fmt in ("PNG", "WEBP", "BMP"):  # lossless: the very pixels
        assert list(out.image.getdata()) == list(src.getdata())


def test_modes_convert_to_rgb():
    # Grayscale and palette convert directly.
    assert (
        decode_image(_encode(_gradient(mode="L"), "PNG")).image.getpixel((3, 2))
        == (_gradient(mode="L").getpixel((3, 2)),) * 3
    )
    pal = _gradient().convert("P")
    assert decode_image(_encode(pal, "PNG")).image.getpixel((5, 5)) == pal.convert("RGB").getpixel((5, 5))
    # RGBA: a fully transparent pixel becomes white, an opaque one keeps its colour (as transformers' convert_to_rgb).
    rgba = Image.new("RGBA", (8, 8), (10, 20, 30, 255))
    rgba.putpixel((0, 0), (200, 0, 0, 0))
    rgba.putpixel((1, 0), (0, 0, 0, 128))
    out = decode_image(_encode(rgba, "PNG")).image
    assert out.getpixel((0, 0)) == (255, 255, 255)
    assert out.getpixel((2, 2)) == (10, 20, 30)
    assert out.getpixel((1, 0)) in ((127, 127, 127), (126, 126, 126))
    # CMYK JPEG.
    cmyk = Image.new("CMYK", (16, 16), (0, 255, 255, 0))  # pure red in CMYK
    r, g, b = decode_image(_encode(cmyk, "JPEG", quality=95)).image.getpixel((8, 8))
    assert r > 240 and g < 15 and b < 15


def test_exif_orientation_is_applied():
    src = _gradient(40, 30)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to view"
    data = _encode(src, "JPEG", quality=95, exif=exif.tobytes())
    out = decode_image(data)
    assert (out.width, out.height) == (30, 40)
    ref = src.transpose(Image.Transpose.ROTATE_270)
    # JPEG is lossy: compare a corner colour loosely.
    assert all(abs(a - b) < 12 for a, b in zip(out.image.getpixel((29, 39)), ref.getpixel((29, 39)), strict=True))


def _animation(n: int) -> bytes:
    # Frame 0 is red; frame i > 0 is black with one white pixel moving, so no two neighbours merge on save.
    frames = [Image.new("RGB", (4, 4), (255, 0, 0))]
    for i in range(1, n):
        f = Image.new("RGB", (4, 4))
        f.putpixel((i % 4, (i // 4) % 4), (255, 255, 255))
        frames.append(f)
    data = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=10)
    assert data.count(b"\x21\xf9\x04") >= n  # one graphic control block per frame: n frames stored
    return data


def test_gif_first_frame_of_a_short_animation():
    out = decode_image(_animation(100))  # exactly max_frames: accepted
    assert out.format == "GIF" and out.image.size == (4, 4)
    assert out.image.getpixel((1, 1)) == (255, 0, 0)


def test_gif_of_10000_frames_is_refused_fast():
    data = _animation(10_000)
    t0 = time.perf_counter()
    with pytest.raises(ImageDecodeError, match="more than 100 frames"):
        decode_image(data)
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.2, f"refusing took {elapsed:.2f} s: more frames were read than the limit"
    assert decode_image(data, ImageLimits(max_frames=10_000)).image.getpixel((1, 1)) == (255, 0, 0)


def _png_with_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height (valid CRC) followed by a tiny IDAT: a decompression bomb's header."""
    data = bytearray(_encode(Image.new("RGB", (2, 2)), "PNG"))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr) & 0xFFFFFFFF)
    return bytes(data)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow warns past 89 MP, then we refuse
def test_png_bomb_refused_from_the_header(monkeypatch):
    def no_decoding(self):
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    for size in (30_000, 10_000):  # 900 MP (Pillow's own bomb error) and 100 MP (ours)
        with pytest.raises(ImageDecodeError, match="pixels"):
            decode_image(_png_with_header(size, size))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty"),
        (b"What is in this picture? Plain text, not an image at all.", "not an image"),
        (_encode(_gradient(), "TIFF"), "TIFF images are not accepted"),
        (b"\x00\x01\x02\x03" * 20, "not an image"),
        (_encode(Image.new("RGB", (1, 1)), "PNG"), "at least"),
        (_encode(Image.new("RGB", (500, 2)), "PNG"), "aspect ratio 250:1"),
        (_encode(Image.new("RGB", (2, 500)), "BMP"), "aspect ratio 250:1"),
        (_encode(_gradient(), "PNG")[:60], "truncated or corrupt"),
        (_encode(_gradient(200, 150), "JPEG", quality=95)[:2000], "truncated or corrupt"),
        (_encode(_gradient(), "PNG")[:20], "corrupt"),
    ],
    ids=["empty", "text", "tiff", "unknown", "1x1", "250:1", "1:250", "truncated-png", "truncated-jpeg", "short"],
)
def test_bad_inputs_raise_a_reason(data, match):
    with pytest.raises(ImageDecodeError, match=match) as info:
        decode_image(data, mime_type="image/png")
    assert info.value.reason == str(info.value)
    assert "\n" not in info.value.reason


def test_limits():
    data = _encode(_gradient(), "PNG")
    with pytest.raises(ImageDecodeError, match="bytes"):
        decode_image(data, ImageLimits(max_bytes=len(data) - 1))
    with pytest.raises(ImageDecodeError, match="not accepted"):
        decode_image(data, ImageLimits(formats=frozenset({"JPEG"})))
    with pytest.raises(ValueError, match="unsupported"):
        ImageLimits(formats=frozenset({"TIFF"}))
    assert decode_image(data, ImageLimits(max_pixels=1200)).image.size == (40, 30)
    with pytest.raises(ImageDecodeError, match="1200 pixels"):
        decode_image(data, ImageLimits(max_pixels=1199))


def test_request_pixel_budget_is_checked_on_the_header():
    data = _encode(_gradient(), "PNG")  # 40x30 = 1200 pixels
    limits = ImageLimits(max_request_pixels=3000)
    assert decode_image(data, limits, pixels_before=1800).image.size == (40, 30)  # exactly the budget
    with pytest.raises(RequestPixelsError, match="are 3001 pixels; the limit is 3000 per request"):
        decode_image(data, limits, pixels_before=1801)
    with pytest.raises(RequestPixelsError):  # refused from the header: the truncated pixel data is never read
        decode_image(data[:60], limits, pixels_before=2000)
    with pytest.raises(ValueError, match="positive"):
        ImageLimits(max_request_pixels=0)


def test_sniff():
    assert sniff_format(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "WEBP"
    assert sniff_format(b"GIF89a....") == "GIF"
    assert sniff_format(b"<svg") is None


def test_content_key():
    a = _encode(_gradient(40, 30), "PNG")
    b = _encode(_gradient(40, 30).transpose(Image.Transpose.TRANSPOSE), "PNG")
    settings = {"processor": "x", "max_pixels": 1000}
    k = image_content_key(a, "m", settings)
    assert k == image_content_key(a, "m", dict(reversed(list(settings.items()))))  # key order does not matter
    assert len({k, image_content_key(b, "m", settings), image_content_key(a, "m2", settings)}) == 3
    assert k != image_content_key(a, "m", {**settings, "max_pixels": 2000})


def _png(im: Image.Image, **kwargs) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG", **kwargs)
    return buf.getvalue()


def test_a_16_bit_grayscale_png_keeps_its_shades():
    """A 16-bit grayscale PNG (scans, medical and scientific images) opens as mode I;16, and Pillow's convert("RGB")
    clips at 255: every pixel above 255 of 65535 came out white. Now its high byte, as Pillow reads 16-bit RGB."""
    values = (np.arange(32 * 48).reshape(32, 48) * 40).astype(np.uint16)  # 0 .. 61400
    out = np.asarray(decode_image(_png(Image.fromarray(values))).image)
    assert out.shape == (32, 48, 3)
    assert (out == (values >> 8)[..., None]).all()  # was 255 wherever values > 255 (all but 7 pixels)
    # A tRNS gray value is transparency at full depth: composited on white, its neighbours (same high byte) kept.
    keyed = int(values[0, 5])  # 200: high byte 0, as its neighbours 160 and 240
    out = np.asarray(decode_image(_png(Image.fromarray(values), transparency=keyed)).image)
    assert out[0, 5].tolist() == [255, 255, 255] and out[0, 4].tolist() == out[0, 6].tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    ("data", "name"),
    [
        (b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="9" height="9"/>', "SVG"),
        (b"\xef\xbb\xbf  <svg xmlns='http://www.w3.org/2000/svg'></svg>", "SVG"),
        (b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(64), "HEIC/HEIF"),
        (b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00avifmif1miaf" + bytes(64), "AVIF"),
        (b"\xff\x0a\xfa\x7f" + bytes(64), "JPEG XL"),
    ],
    ids=["svg-xml", "svg-bom", "heic", "avif", "jxl"],
)
def test_formats_phones_and_web_pages_send_are_refused_by_name(data, name):
    """An iPhone's HEIC or a web page's SVG got "the bytes are not an image in a known format": now named."""
    with pytest.raises(ImageDecodeError, match=rf"^{name} images are not accepted; send BMP, GIF, JPEG, PNG, WEBP$"):
        decode_image(data, mime_type="image/heic")
    with pytest.raises(ImageDecodeError, match="not an image in a known format"):
        decode_image(b"<html><body>not an image</body></html>")  # XML-ish but no <svg: not named


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])  # PNG: an APNG
def test_a_long_animation_is_refused_as_long_not_as_corrupt(fmt):
    """More than 100 frames was refused as "the GIF data is truncated or corrupt: the animation has more than 100
    frames" (the refusal, a ValueError, went through the corrupt-data handler). APNG and WebP animations too."""
    frames = [Image.new("RGB", (8, 8), (i * 37 % 256, i * 11 % 256, 0)) for i in range(102)]
    buf = io.BytesIO()
    frames[0].save(buf, fmt, save_all=True, append_images=frames[1:], lossless=True)  # lossy WebP merges frames
    with pytest.raises(ImageDecodeError) as err:
        decode_image(buf.getvalue())
    assert err.value.reason == "the animation has more than 100 frames; send one image"
    buf = io.BytesIO()
    frames[0].save(buf, fmt, save_all=True, append_images=frames[1:3], lossless=True)
    assert decode_image(buf.getvalue()).image.getpixel((0, 0)) == (0, 0, 0)  # the first frame of a short one


def test_media_sent_as_base64_text_says_so():
    """`ImagePart(data=base64.b64encode(raw))` (or a web page's data: URL) sends the text, not the file: the answer
    was "not an image in a known format" / "unrecognised audio". Now the part names what it holds."""
    png = _png(Image.new("RGB", (4, 4), (1, 2, 3)))
    for data, what in ((base64.b64encode(png), "base64 text"), (b"data:image/png;base64," + base64.b64encode(png), "a data: URL")):  # fmt: skip
        with pytest.raises(ImageDecodeError, match=f"^the bytes are {what} of a PNG image, not the image: send"):
            decode_image(data)
    buf = io.BytesIO()
    sf.write(buf, np.zeros(160, np.float32), 16000, format="WAV")
    with pytest.raises(AudioInputError, match="^data: the bytes are base64 text of WAV audio, not the audio") as err:
        decode_audio(base64.b64encode(buf.getvalue()))
    assert err.value.field == "data"
    with pytest.raises(ImageDecodeError, match="not an image in a known format"):  # text that is not base64 media
        decode_image(b"QUJDREVGR0hJSktMTU5PUFFSU1RVVldY")
