"""`omnivox transcribe --stream`: live transcription through TranscriptionService/StreamingTranscribe.

    omnivox transcribe --stream talk.wav                  # sent in 100 ms chunks at real-time pace (--pace 0: flat out)
    arecord -f S16_LE -r 16000 -c 1 | omnivox transcribe --stream - --sample-rate 16000
    sox talk.flac -t wav - | omnivox transcribe --stream -  # a WAV stream on stdin: its header gives the rate

A file is decoded here (WAV, FLAC, Ogg, MP3 through soundfile; `.raw`/`.pcm` LINEAR16 and `.ulaw`/`.mulaw` MULAW
with --sample-rate), mixed to mono and sent at its own rate (the server resamples). stdin is read as it comes: a
WAV stream (8/16/24/32-bit PCM or float, mixed to mono 16-bit here), or headerless LINEAR16 with --sample-rate.
Output: each utterance's final text on its own line (interim text redrawn on stderr when it is a terminal and
--interim is on); `--format json` writes every response as one JSON line (events, interim and final results, the
summary); srt / vtt cue each final.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from omnivox.services.cli._common import CliError, connect, open_output, rpc_error_line

CHUNK_S = 0.1


# WAV sample layouts a stdin stream may carry: (format tag, bits) -> numpy dtype (24-bit is unpacked by hand).
# `sox talk.flac -t wav -` keeps the FLAC's depth, so a 24-bit FLAC arrives as 24-bit PCM (it was refused).
_WAV_SAMPLES = {(1, 8): "u1", (1, 16): "<i2", (1, 24): "i3", (1, 32): "<i4", (3, 32): "<f4", (3, 64): "<f8"}


class _StdinReader:
    """stdin's file descriptor read directly, `read(n)` returning n bytes unless the stream ends first.

    Not sys.stdin.buffer: gRPC pulls the request iterator on its own (daemon) thread, which sits in a read while a
    microphone pipe stays open. When the call fails meanwhile (an idle timeout, a refused config) the main thread
    exits, and the interpreter's shutdown could not take the BufferedReader's lock that thread holds: "Fatal Python
    error: _enter_buffered_busy", SIGABRT (exit 134) after the one-line error, instead of exit status 1."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read(self, size: int) -> bytes:
        parts, got = [], 0
        while got < size:
            part = os.read(self.fd, size - got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        return b"".join(parts)


def _wav_header(stream) -> tuple[int, int, str]:
    """Read a RIFF/WAV header off `stream` up to its data; (rate, channels, sample layout: a _WAV_SAMPLES value)."""
    head = stream.read(12)
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        raise CliError("stdin is not a WAV stream: pipe headerless LINEAR16 with --sample-rate instead")
    rate = channels = 0
    layout = ""
    while True:
        chunk = stream.read(8)
        if len(chunk) < 8:
            raise CliError("the WAV stream on stdin ended before its data")
        kind, size = chunk[:4], struct.unpack("<I", chunk[4:])[0]
        if kind == b"data":
            break
        body = stream.read(size + size % 2)
        if kind == b"fmt ":
            fmt, channels, rate = struct.unpack("<HHI", body[:8])
            bits = struct.unpack("<H", body[14:16])[0]
            if fmt == 0xFFFE and len(body) >= 26:  # WAVE_FORMAT_EXTENSIBLE: the sub-format GUID starts with the tag
                fmt = struct.unpack("<H", body[24:26])[0]
            layout = _WAV_SAMPLES.get((fmt, bits), "")
            if not layout:
                raise CliError(f"the WAV stream holds {bits}-bit audio of format {fmt}; PCM or float only")
    if not rate:
        raise CliError("the WAV stream on stdin has no fmt chunk before its data")
    return rate, channels, layout


def _to_linear16(data: bytes, channels: int, layout: str = "<i2") -> bytes:
    """Interleaved WAV samples -> mono 16-bit little-endian (channels averaged); a partial last frame is dropped."""
    import numpy as np

    width = 3 if layout == "i3" else np.dtype(layout).itemsize
    frames = len(data) // (width * channels)
    if layout == "<i2" and channels == 1:
        return data[: frames * 2]
    raw = np.frombuffer(data[: frames * width * channels], np.uint8)
    if layout == "i3":  # 24-bit: the three bytes as the top of an int32
        b = raw.reshape(-1, 3).astype(np.int32)
        x = ((b[:, 0] << 8) | (b[:, 1] << 16) | (b[:, 2] << 24)).astype(np.float64) / 2**31
    elif layout == "u1":
        x = (raw.astype(np.float64) - 128.0) / 128.0
    else:
        x = raw.view(layout).astype(np.float64)
        x = x if layout[1] == "f" else x / 2.0 ** (8 * width - 1)
    mono = x.reshape(-1, channels).mean(axis=1)
    return np.clip(np.round(mono * 32768.0), -32768, 32767).astype("<i2").tobytes()


def audio_source(path: Path, sample_rate: int) -> tuple[str, int, Iterator[bytes], bool]:
    """(encoding name, rate, chunks of ~CHUNK_S, whether to pace them): the file decoded, or stdin as it arrives."""
    from omnivox.services.cli.ask import RAW_AUDIO, read_file

    if str(path) == "-":
        stdin = _StdinReader(sys.stdin.fileno())
        channels, layout = 1, "<i2"
        if not sample_rate:
            sample_rate, channels, layout = _wav_header(stdin)
        width = 3 if layout == "i3" else int(layout[-1])
        size = width * channels * round(CHUNK_S * sample_rate)
        return "LINEAR16", sample_rate, iter(lambda: _to_linear16(stdin.read(size), channels, layout), b""), False
    raw = RAW_AUDIO.get(path.suffix.lower())
    data = read_file(path)
    if raw:
        if not sample_rate:
            raise CliError(f"{path} is headerless {raw} audio: give its rate with --sample-rate")
        encoding, rate = raw, sample_rate
    else:
        import numpy as np
        import soundfile

        try:
            # As float, scaled here: libsndfile reads a float or double WAV as int16 unscaled (samples in [-1, 1]
            # truncate to 0 and 1), so a 32-bit float file was streamed as silence.
            pcm, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
        except (soundfile.LibsndfileError, RuntimeError, ValueError) as exc:
            raise CliError(f"cannot decode {path}: {exc}") from None
        mono = pcm.mean(axis=1) if pcm.shape[1] > 1 else pcm[:, 0]
        data = np.clip(np.round(mono * 32768.0), -32768, 32767).astype("<i2").tobytes()
        encoding = "LINEAR16"
    size = round(CHUNK_S * rate) * (2 if encoding == "LINEAR16" else 1)
    return encoding, rate, (data[i : i + size] for i in range(0, len(data), size)), True


def requests(args: argparse.Namespace, encoding: str, rate: int, chunks: Iterator[bytes], pace: float):
    from omnivox.v1 import content_pb2, transcription_pb2

    config = transcription_pb2.StreamingTranscriptionConfig(
        model=args.model,
        encoding=content_pb2.AudioEncoding.Value(f"AUDIO_ENCODING_{encoding}"),
        sample_rate_hertz=rate,
        language=args.language,
        interim_results=args.interim or args.format == "json",
        task=getattr(args, "task", "") or "",
        prompt=args.prompt,
        cache_salt=args.cache_salt,
        temperature=getattr(args, "temperature", None),
    )
    yield transcription_pb2.StreamingTranscribeRequest(config=config)
    start, sent = time.monotonic(), 0.0
    for chunk in chunks:
        if pace > 0:  # real time: chunk i leaves i * CHUNK_S / pace after the first
            time.sleep(max(0.0, start + sent / pace - time.monotonic()))
            sent += CHUNK_S
        yield transcription_pb2.StreamingTranscribeRequest(audio=chunk)


def _json(response) -> str:
    from google.protobuf.json_format import MessageToDict

    return json.dumps(MessageToDict(response), ensure_ascii=False)


def run_stream(args: argparse.Namespace) -> int:
    import grpc

    from omnivox.services.cli._common import subtitle_clock
    from omnivox.v1 import transcription_pb2_grpc

    encoding, rate, chunks, paced = audio_source(args.audio, args.sample_rate)
    pace = args.pace if paced else 0.0
    live = args.interim and args.format == "text" and sys.stderr.isatty()
    out = sys.stdout if args.output == "-" else open_output(args.output)
    finals: list[tuple[float, float, str]] = []
    summary = None
    try:
        with connect(args) as channel:
            stub = transcription_pb2_grpc.TranscriptionServiceStub(channel)
            try:
                for response in stub.StreamingTranscribe(requests(args, encoding, rate, chunks, pace),
                                                         timeout=args.timeout):  # fmt: skip
                    if args.format == "json":
                        out.write(_json(response) + "\n")
                        out.flush()
                    kind = response.WhichOneof("response")
                    if kind == "summary":
                        summary = response.summary
                    elif kind == "result" and response.result.is_final:
                        r = response.result
                        span = (r.start_offset.ToNanoseconds() / 1e9, r.end_offset.ToNanoseconds() / 1e9)
                        finals.append((*span, r.text))
                        if live:
                            sys.stderr.write("\r\033[K")
                        if args.format == "text" and r.text:
                            out.write(r.text + "\n")
                            out.flush()
                    elif kind == "result" and live:
                        sys.stderr.write("\r\033[K" + response.result.text[-200:])
                        sys.stderr.flush()
            except grpc.RpcError as err:
                raise CliError(rpc_error_line(err, args.server)) from None
        assert summary is not None, "the stream ended without a summary"
        cues = [(a, b, t) for a, b, t in finals if t]
        if args.format == "srt":
            out.write("".join(f"{i}\n{subtitle_clock(a, ',')} --> {subtitle_clock(b, ',')}\n{t}\n\n" for i, (a, b, t) in
                              enumerate(cues, 1)))  # fmt: skip
        elif args.format == "vtt":
            out.write(
                "WEBVTT\n\n"
                + "".join(f"{subtitle_clock(a, '.')} --> {subtitle_clock(b, '.')}\n{t}\n\n" for a, b, t in cues)
            )
    finally:
        if out is not sys.stdout:
            out.close()
    if not args.quiet:
        first = summary.time_to_first_result.ToNanoseconds() / 1e9
        print(f"[{summary.audio_seconds:.2f} s of audio · {summary.utterances} utterance(s) · real-time factor "
              f"{summary.real_time_factor:.2f} · first result after {first:.2f} s]", file=sys.stderr)  # fmt: skip
    return 0
