"""Second user's-eye audit: inputs, clients and configs the first audit (tests/test_bad_input_audit.py) did not try.
Each test is a defect found by sending what a user sends (other files, other clients), with its fix."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
import soundfile as sf
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image
from support.checkpoints import make_checkpoint
from support.service_harness import ServerThread
from support.whisper_checkpoints import make_whisper

from omnivox.codecs.audio_input import AudioInputError, decode_audio
from omnivox.codecs.image import ImageDecodeError, decode_image
from omnivox.services.cli.transcribe_stream import _to_linear16, _wav_header, audio_source
from omnivox.services.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc, transcription_pb2, transcription_pb2_grpc


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


KEY = "alice-key-0123456789"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit2")
    spec = ModelSpec(path=make_checkpoint(root / "text"), name="text")
    (root / "keys").write_text(f"alice:{KEY}\n")
    with ServerThread([spec], EngineOptions(kv_cache_gib=0.01), api_keys=root / "keys") as server:
        yield server


def _generate(server: ServerThread, metadata: tuple) -> list:
    stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
    request = generation_pb2.GenerateRequest(
        max_output_tokens=2, contents=[content_pb2.Content(parts=[content_pb2.Part(text="Hi")])]
    )
    return list(stub.Generate(request, metadata=metadata, timeout=30))


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer "])
def test_the_bearer_scheme_is_case_insensitive(served, scheme):
    """RFC 7235: the auth scheme is case-insensitive, and clients do send `authorization: bearer KEY`; it was refused
    as "missing API key"."""
    assert _generate(served, (("authorization", f"{scheme} {KEY}"),))[-1].HasField("summary")


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ((), "missing API key"),
        ((("authorization", KEY),), "the authorization header is not 'Bearer KEY'"),  # was "missing API key"
        ((("authorization", "Basic YWxpY2U6eA=="),), "the authorization header is not 'Bearer KEY'"),
        ((("authorization", "Bearer wrong"),), "invalid API key"),
    ],
    ids=["none", "no-scheme", "basic", "wrong"],
)
def test_a_refused_key_says_what_was_wrong(served, metadata, message):
    with pytest.raises(grpc.RpcError) as err:
        _generate(served, metadata)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert err.value.details() == f"{message}: send 'authorization: Bearer KEY'"


def test_health_list_answers_every_service(served, caplog):
    """grpc.health.v1 Health/List (in health.proto since 2024; grpcurl and Kubernetes tooling call it) answered
    UNIMPLEMENTED "Unexpected <class 'NotImplementedError'>" and logged a traceback per call."""
    stub = health_pb2_grpc.HealthStub(served.channel())
    statuses = stub.List(health_pb2.HealthListRequest(), timeout=10).statuses
    serving = health_pb2.HealthCheckResponse.SERVING
    assert statuses[""].status == serving
    assert statuses["omnivox.v1.GenerationService"].status == serving
    assert statuses["model/text"].status == serving
    for name, status in statuses.items():  # List says what Check says
        assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == status.status
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize("subtype", ["FLOAT", "DOUBLE", "PCM_24", "PCM_U8", "PCM_16"])
def test_transcribe_stream_sends_a_float_wav_as_its_samples(tmp_path, subtype):
    """`omnivox transcribe --stream take.wav` of a 32-bit float WAV (Audacity's and most DAWs' export) streamed
    silence: libsndfile reads float samples as int16 unscaled, so 0.84 became 0. The utterance was never heard."""
    t = np.arange(8000) / 16000
    x = (0.8 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)
    path = tmp_path / "take.wav"
    sf.write(path, np.stack([x, x], axis=1), 16000, subtype=subtype)  # stereo: mixed to mono by the CLI
    encoding, rate, chunks, paced = audio_source(path, 0)
    pcm = np.frombuffer(b"".join(chunks), "<i2")
    assert (encoding, rate, paced, len(pcm)) == ("LINEAR16", 16000, True, 8000)
    tolerance = {"PCM_U8": 256, "PCM_16": 1}.get(subtype, 1)
    assert np.abs(pcm.astype(np.int32) - np.round(x * 32768)).max() <= tolerance  # was max |pcm| = 0 for FLOAT


def test_cli_output_into_a_closed_pipe_exits_quietly(served):
    """`omnivox ... | head -1`: the reader leaves, the next write raises BrokenPipeError: a traceback (and another at
    exit's flush). Now exit status 141 (128 + SIGPIPE, as a shell reports it) and nothing on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write
    cli = [sys.executable, "-m", "omnivox.services.cli", "generate", "Hi", "--max-tokens", "4"]
    done = subprocess.run(
        [*cli, "--server", served.address, "--api-key", KEY, "--quiet"],
        stdout=write_end,
        stderr=subprocess.PIPE,
        timeout=120,
        text=True,
    )
    os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")


def test_start_up_does_not_list_a_model_that_failed_to_load(tmp_path):
    """`omnivox serve` with a model that failed to load (here Whisper asked for int8) logged the error, then
    "serving text, whisper on ..." as if both served. Now the failed one is named as not serving."""
    specs = [
        ModelSpec(path=make_checkpoint(tmp_path / "text"), name="text"),
        ModelSpec(path=make_whisper(tmp_path / "whisper"), name="whisper", engine_overrides={"quantization": "int8"}),
    ]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01)) as server:
        line = server.server.serving_line()
    assert line == f"serving text on {server.address}; not serving whisper (failed to load)"


def test_float_audio_far_outside_its_range_is_refused():
    """A float WAV whose samples reach 1e20 (a broken writer) decoded "fine", then the log-mel power overflowed
    float32: Whisper answered "!!!!..." (token 0) and audio-LLMs token 0, for any such file. Integer PCM written as
    float unscaled (up to 2**31) still decodes: the features are level-invariant enough."""
    t = np.arange(1600) / 16000
    tone = np.sin(2 * np.pi * 440 * t)
    for scale, ok in ((32768.0, True), (2.0**31, True), (1e20, False), (3e38, False)):
        buf = io.BytesIO()
        sf.write(buf, (scale * tone).astype(np.float32), 16000, format="WAV", subtype="FLOAT")
        if ok:
            assert decode_audio(buf.getvalue()).samples.shape == (1600,)
            continue
        with pytest.raises(AudioInputError, match=r"samples reach .*; float audio is expected within \[-1, 1\]") as e:
            decode_audio(buf.getvalue())
        assert e.value.field == "data"


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


def test_a_file_declared_headerless_is_read_by_its_header_or_refused():
    """encoding LINEAR16 (or MULAW) on a file's bytes decoded the container as samples: FLAC, Ogg and MP3 became
    noise and a confident wrong transcript; a WAV's header became a click and its own rate was ignored. A WAV is now
    read by its header (as Google's API takes LINEAR16 WAVs; a different sample_rate_hertz is refused), the
    compressed containers are refused naming `encoding`. Raw samples that open like an MPEG frame sync still
    decode as samples."""
    t = np.arange(4410) / 44100
    stereo = np.stack([np.sin(2 * np.pi * 440 * t)] * 2, axis=1).astype(np.float32) * 0.5
    buf = io.BytesIO()
    sf.write(buf, stereo, 44100, format="WAV")
    wav = decode_audio(buf.getvalue(), "LINEAR16", 0)
    assert (wav.source_format, wav.source_rate, wav.source_channels, len(wav.samples)) == ("WAV", 44100, 2, 1600)
    with pytest.raises(AudioInputError, match="sample_rate_hertz=16000 but the WAV header says 44100 Hz"):
        decode_audio(buf.getvalue(), "LINEAR16", 16000)
    for fmt, name in (("FLAC", "FLAC"), ("OGG", "OGG")):
        buf = io.BytesIO()
        sf.write(buf, stereo, 44100, format=fmt)
        with pytest.raises(AudioInputError, match=f"encoding is MULAW .* but the bytes hold {name} audio") as err:
            decode_audio(buf.getvalue(), "MULAW", 8000)
        assert err.value.field == "encoding"
    raw = np.full(800, -1, "<i2").tobytes()  # b"\xff\xff...": an MPEG sync pattern, but declared raw: samples
    assert decode_audio(raw, "LINEAR16", 16000).source_format == "LINEAR16"


@pytest.fixture(scope="module")
def whisper_served(tmp_path_factory):
    spec = ModelSpec(path=make_whisper(tmp_path_factory.mktemp("audit2-whisper") / "whisper"), name="whisper")
    with ServerThread([spec], EngineOptions(kv_cache_gib=0.01)) as server:
        yield server


def _stream_file(server: ServerThread, data: bytes, rate: int) -> list:
    stub = transcription_pb2_grpc.TranscriptionServiceStub(server.channel())
    config = transcription_pb2.StreamingTranscriptionConfig(model="whisper", sample_rate_hertz=rate, language="en")
    requests = [transcription_pb2.StreamingTranscribeRequest(config=config)]
    requests += [transcription_pb2.StreamingTranscribeRequest(audio=data[i : i + 4000]) for i in range(0, len(data), 4000)]  # fmt: skip
    return list(stub.StreamingTranscribe(iter(requests), timeout=60))


def test_a_wav_file_streamed_as_it_is(whisper_served):
    """Clients stream a WAV file's bytes as they are. Its header was decoded as 22 samples (a click); a 44.1 kHz
    stereo file under a 16 kHz config streamed garbled audio for the whole call, FLAC bytes noise. Now a matching
    header is skipped, a contradicting one or another container is INVALID_ARGUMENT naming what to change."""
    x = (0.3 * np.sin(2 * np.pi * 300 * np.arange(8000) / 16000)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, x, 16000, format="WAV")
    summary = _stream_file(whisper_served, buf.getvalue(), 16000)[-1].summary
    assert summary.audio_seconds == 0.5  # 8000 samples: the 44 header bytes are not audio (was 0.501375)
    for (channels, rate, fmt, config_rate), (field, message) in [
        ((2, 44100, "WAV", 44100), ("audio", "WAV file of 2-channel 16-bit audio")),
        ((1, 44100, "WAV", 16000), ("config.sample_rate_hertz", "WAV file at 44100 Hz; the config says 16000")),
        ((1, 16000, "FLAC", 16000), ("audio", "the stream holds FLAC audio")),
    ]:
        buf = io.BytesIO()
        sf.write(buf, np.stack([x] * channels, axis=1), rate, format=fmt)
        with pytest.raises(grpc.RpcError) as err:
            _stream_file(whisper_served, buf.getvalue(), config_rate)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
        assert err.value.details().startswith(f"{field}: ")
    free, total = whisper_served.wait_kv_free("whisper", timeout=5.0)
    assert free == total


@pytest.mark.parametrize("subtype", ["PCM_U8", "PCM_16", "PCM_24", "PCM_32", "FLOAT", "DOUBLE"])
@pytest.mark.parametrize("fmt", ["WAV", "WAVEX"])
def test_transcribe_stream_reads_any_pcm_or_float_wav_on_stdin(subtype, fmt):
    """`sox talk.flac -t wav - | omnivox transcribe --stream -` (the README's line) keeps the FLAC's bit depth: a
    24-bit FLAC arrived as 24-bit PCM and was refused ("16-bit PCM only"), as were float, 8- and 32-bit WAVs."""
    t = np.arange(2400) / 48000
    x = np.stack([0.7 * np.sin(2 * np.pi * 300 * t), -0.2 * np.sin(2 * np.pi * 300 * t)], axis=1)
    buf = io.BytesIO()
    sf.write(buf, x, 48000, format=fmt, subtype=subtype)
    buf.seek(0)
    rate, channels, layout = _wav_header(buf)
    assert (rate, channels) == (48000, 2)
    got = np.frombuffer(_to_linear16(buf.read(), channels, layout), "<i2").astype(np.int32)
    want = np.round(sf.read(io.BytesIO(buf.getvalue()), dtype="float64")[0].mean(axis=1) * 32768)
    assert len(got) == 2400 and np.abs(got - want).max() <= 1
