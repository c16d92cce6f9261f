"""A headless realtime client: N sessions x M spoken turns against `GET /v1/realtime` (a raw `websockets` client),
reporting end of user speech -> first assistant audio, and barge-in stop time.

    python -m omnivox.benchmarks.realtime_sessions --sessions 1 --turns 3 --out benchmarks/results/realtime-cpu.json

It starts its own server (the embedded defaults: SmolLM2-135M, hibari, whisper-base, gRPC + HTTP in one process),
synthesizes each question with the served voice (SynthesizeSpeech, LINEAR16 24 kHz: the session's pcm16), and streams
it in 20 ms appends at real time, then silence, as a microphone would. Per turn:
- first audio: from the end of the question's speech (the last voiced sample sent) to the first
  `response.output_audio.delta` received. It includes the detector's silence_duration_ms (500 ms by default).
- barge-in (the last turn of each session, with --barge-in): while the answer's audio arrives, the next question
  starts; stop time = from its first speech sample sent to the last audio delta of the cancelled response received.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

CHUNK_MS = 20
RATE = 24000
QUESTIONS = ("What is the capital of France?", "Name a large animal that lives in Africa.",
             "What colour is the sky on a clear day?", "How many days are there in a week?")  # fmt: skip


def synthesize_pcm16(channel: Any, text: str) -> bytes:
    """The served voice speaking `text`: raw pcm16 at 24 kHz."""
    from omnivox.v1 import content_pb2, speech_pb2, speech_pb2_grpc

    stub = speech_pb2_grpc.SpeechServiceStub(channel)
    config = speech_pb2.AudioConfig(encoding=content_pb2.AUDIO_ENCODING_LINEAR16, sample_rate_hertz=RATE)
    request = speech_pb2.SynthesizeSpeechRequest(text=text, audio_config=config)
    return b"".join(r.audio.data for r in stub.SynthesizeSpeech(request, timeout=120) if r.HasField("audio"))


def _voiced_frames(pcm16: bytes) -> np.ndarray:
    """The indices of the 10 ms frames of `pcm16` above -50 dBFS."""
    x = np.frombuffer(pcm16, "<i2").astype(np.float32) / 32768
    frame = RATE // 100
    n = len(x) // frame
    energy = 10 * np.log10(np.mean(x[: n * frame].reshape(n, frame) ** 2, axis=1) + 1e-12)
    return np.nonzero(energy > -50)[0]


def speech_end_ms(pcm16: bytes) -> float:
    """Where the speech in `pcm16` ends: past its last 10 ms frame above -50 dBFS."""
    voiced = _voiced_frames(pcm16)
    return (voiced[-1] + 1) * 10.0 if len(voiced) else 0.0


def speech_start_ms(pcm16: bytes) -> float:
    """Where the speech in `pcm16` starts: its first 10 ms frame above -50 dBFS (a voice's clip opens with silence)."""
    voiced = _voiced_frames(pcm16)
    return voiced[0] * 10.0 if len(voiced) else 0.0


class RawSession:
    """One session over a plain `websockets` connection: events sent as JSON, received into a queue."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, url: str, api_key: str | None = None) -> RawSession:
        import websockets

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return cls(await websockets.connect(url, additional_headers=headers, max_size=None))

    async def _read(self) -> None:
        """Until the socket closes (with any code: the server's final close is 1000 or 1012)."""
        from websockets.exceptions import ConnectionClosed

        try:
            async for message in self.ws:
                event = json.loads(message)
                event["received_at"] = time.monotonic()
                await self.events.put(event)
        except ConnectionClosed:
            pass

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def until(self, kind: str, timeout: float = 120.0, seen: list | None = None) -> dict[str, Any]:
        """The next event of type `kind` (the ones before it appended to `seen`)."""
        deadline = time.monotonic() + timeout
        while True:
            event = await asyncio.wait_for(self.events.get(), max(0.01, deadline - time.monotonic()))
            if seen is not None:
                seen.append(event)
            if event["type"] == kind:
                return event

    async def stream(self, pcm16: bytes, realtime: bool = True, silence_ms: int = 0) -> float:
        """Append `pcm16` then `silence_ms` of digital silence in CHUNK_MS pieces (at real time when asked); the
        time.monotonic() at which the speech's last voiced sample was sent."""
        step = RATE * CHUNK_MS // 1000 * 2
        data = pcm16 + bytes(RATE * silence_ms // 1000 * 2)
        end_byte = round(speech_end_ms(pcm16) * RATE / 1000) * 2
        start, speech_end_sent = time.monotonic(), time.monotonic()
        for i in range(0, len(data), step):
            if realtime:
                await asyncio.sleep(max(0.0, start + i / 2 / RATE - time.monotonic()))
            await self.send(
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(data[i : i + step]).decode()}
            )
            if i < end_byte:
                speech_end_sent = time.monotonic()
        return speech_end_sent

    async def close(self) -> None:
        await self.ws.close()
        self.reader.cancel()


@dataclass
class Turn:
    question: str
    transcript: str = ""
    answer: str = ""
    first_audio_s: float | None = None
    status: str = ""
    audio_deltas: int = 0
    # Seconds from the end of the question's speech to each step the server reported (where the time goes)
    steps_s: dict[str, float] = field(default_factory=dict)


@dataclass
class BargeIn:
    stop_s: float | None = None  # first speech frame of the interruption sent -> last audio delta received
    status: str = ""
    # where the stop time goes: first speech frame sent -> speech_started received (the detector's START needs 90 ms
    # of voiced frames), and speech_started -> response.done (the cancel path)
    speech_started_s: float | None = None
    cancel_to_done_s: float | None = None
    deltas_after_speech_started: int = 0  # audio deltas of the cancelled response received after speech_started


@dataclass
class SessionResult:
    turns: list[Turn] = field(default_factory=list)
    barge_in: BargeIn | None = None


async def spoken_turn(session: RawSession, question: str, pcm16: bytes) -> Turn:
    turn = Turn(question)
    sent = asyncio.create_task(session.stream(pcm16, silence_ms=1500))
    seen: list[dict[str, Any]] = []
    done = await session.until("response.done", timeout=180, seen=seen)
    speech_end = await sent
    audio = [e for e in seen if e["type"] == "response.output_audio.delta"]
    turn.audio_deltas = len(audio)
    if audio:
        turn.first_audio_s = audio[0]["received_at"] - speech_end
    for kind in (
        "input_audio_buffer.speech_stopped",
        "conversation.item.input_audio_transcription.completed",
        "response.created",
        "response.output_audio_transcript.delta",
        "response.output_audio.delta",
    ):
        first = next((e for e in seen if e["type"] == kind), None)
        if first is not None:
            turn.steps_s[kind] = round(first["received_at"] - speech_end, 3)
    turn.transcript = next((e["transcript"] for e in seen if e["type"].endswith("transcription.completed")), "")
    turn.answer = next((e["transcript"] for e in seen if e["type"] == "response.output_audio_transcript.done"), "")
    turn.status = done["response"]["status"]
    return turn


STORY = "Tell me a long story about a dragon who learns to bake bread, with many details."


async def barge_in(session: RawSession, interruption: bytes) -> BargeIn:
    """Ask for a long answer and, once its audio arrives, start speaking: the answer is still being generated (a
    short one is generated faster than it plays, and is done before the user can cut in)."""
    result = BargeIn()
    await session.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                        "content": [{"type": "input_text", "text": STORY}]}})  # fmt: skip
    await session.send({"type": "response.create"})
    seen: list[dict[str, Any]] = []
    await session.until("response.output_audio.delta", timeout=180, seen=seen)
    # the clock starts at the interruption's first speech frame, not its first sample: the clip is streamed at
    # real time, so that frame is sent its leading silence after the stream starts (runs before this counted it)
    interrupted_at = time.monotonic() + speech_start_ms(interruption) / 1000
    talking = asyncio.create_task(session.stream(interruption, silence_ms=1500))
    done = await session.until("response.done", timeout=60, seen=seen)
    cancelled = done["response"]["id"]
    late = [e for e in seen if e["type"] == "response.output_audio.delta" and e.get("response_id") == cancelled]
    result.status = done["response"]["status"]
    result.stop_s = max(late[-1]["received_at"] - interrupted_at, 0.0) if late else 0.0
    started = next((e for e in seen if e["type"] == "input_audio_buffer.speech_started"), None)
    if started is not None:
        result.speech_started_s = round(started["received_at"] - interrupted_at, 4)
        result.cancel_to_done_s = round(done["received_at"] - started["received_at"], 4)
        after = seen[seen.index(started) + 1 :]
        result.deltas_after_speech_started = sum(e in late for e in after)
    await talking
    await session.until("response.done", timeout=180)  # the interruption's own answer
    return result


async def run_session(url: str, spoken: list[tuple[str, bytes]], with_barge_in: bool) -> SessionResult:
    session = await RawSession.open(url)
    result = SessionResult()
    try:
        await session.until("session.created")
        await session.send({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["audio"],
                            "instructions": "Answer in one short sentence."}})  # fmt: skip
        await session.until("session.updated")
        for question, pcm in spoken:
            result.turns.append(await spoken_turn(session, question, pcm))
        if with_barge_in:
            result.barge_in = await barge_in(session, spoken[-1][1])
    finally:
        await session.close()
    return result


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(values, q))


def summarize(results: list[SessionResult]) -> dict[str, Any]:
    first = [t.first_audio_s for r in results for t in r.turns if t.first_audio_s is not None]
    stops = [r.barge_in.stop_s for r in results if r.barge_in and r.barge_in.stop_s is not None]
    turns = [t for r in results for t in r.turns]
    return {
        "turns": len(turns), "turns_completed": sum(t.status == "completed" for t in turns),
        "first_audio_p50_s": _percentile(first, 50), "first_audio_p90_s": _percentile(first, 90),
        "barge_in_stop_p50_s": _percentile(stops, 50), "barge_in_stop_max_s": max(stops) if stops else None,
        "barge_ins_cancelled": sum(1 for r in results if r.barge_in and r.barge_in.status == "cancelled"),
        "barge_in_speech_started_max_s": max((r.barge_in.speech_started_s for r in results if r.barge_in and
                                              r.barge_in.speech_started_s is not None), default=None),
        "barge_in_cancel_to_done_max_s": max((r.barge_in.cancel_to_done_s for r in results if r.barge_in and
                                              r.barge_in.cancel_to_done_s is not None), default=None),
        "barge_in_deltas_after_speech_started": sum(r.barge_in.deltas_after_speech_started for r in results
                                                    if r.barge_in),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from omnivox.benchmarks.host import write_results

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 4], help="concurrent sessions, one run per value")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--barge-in", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--turn-window-s",
        type=float,
        nargs="+",
        default=[None],
        help="the turns' encoder window (OMNIVOX_TURN_WINDOW_S), one server per value: 30 10 = before/after",
    )
    p.add_argument("--out")
    args = p.parse_args(argv)
    import datetime
    import os
    import subprocess

    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
    load = [round(x, 1) for x in os.getloadavg()]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    runs = []
    for window in args.turn_window_s:
        if window is not None:
            os.environ["OMNIVOX_TURN_WINDOW_S"] = str(window)  # read by the server process it starts
        runs += [{"turn_window_s": window, **r} for r in asyncio.run(_runs(args.sessions, args.turns, args.barge_in))]
    result = {"benchmark": "realtime_sessions", "note": "CPU, the machine shared with other jobs", "started": started,
              "commit": commit.stdout.strip(), "load_average_at_start": load, "runs": runs}  # fmt: skip
    print(json.dumps(runs, indent=2))
    if args.out:
        write_results(args.out, result)
    return 0


async def _runs(session_counts: list[int], turns: int, with_barge_in: bool) -> list[dict[str, Any]]:
    import tempfile
    from pathlib import Path

    import grpc

    from omnivox.benchmarks.systems.omnivox_grpc import ServerProcess
    from omnivox.services.parts.defaults import DEFAULT_MODEL_NAME

    http_port = _free_port()
    log = Path(tempfile.mkdtemp()) / "serve.log"
    server = await asyncio.to_thread(ServerProcess, None, ["--http-port", str(http_port)], log)
    try:
        url = f"ws://127.0.0.1:{http_port}/v1/realtime?model={DEFAULT_MODEL_NAME}"
        with grpc.insecure_channel(server.address) as channel:
            spoken = [(q, await asyncio.to_thread(synthesize_pcm16, channel, q)) for q in QUESTIONS[:turns]]
        out = []
        for count in session_counts:
            results = await asyncio.gather(*(run_session(url, spoken, with_barge_in) for _ in range(count)))
            out.append({"sessions": count, "turns_per_session": turns, **summarize(list(results)),
                        "detail": [asdict(r) for r in results]})  # fmt: skip
        return out
    finally:
        await asyncio.to_thread(server.close)


def _free_port() -> int:
    """A free port for --http-port (the server prints its gRPC port, not the HTTP one; a race is possible)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
