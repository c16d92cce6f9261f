"""Speech out from a user's side: a streaming client that waits for its audio before sending more, odd texts, every
output encoding decoded back, cancelled streams next to live ones, reference audio of odd shapes, the CLI."""

from __future__ import annotations

import io
import queue
import threading
import time

import numpy as np
import pytest
from support.service_harness import ServerThread

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
from omnivox.services.calls.speech_stream import ClauseCutter
from omnivox.services.grpc_api.speech import SpeechServicer
from omnivox.services.parts.defaults import save_random_speech_model
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, sampling_pb2, speech_pb2, speech_pb2_grpc

SMALL_SNAC = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)
ENC = content_pb2.AudioEncoding
PCM = speech_pb2.AudioConfig(encoding=ENC.AUDIO_ENCODING_LINEAR16)
SEEDED = sampling_pb2.SamplingConfig(seed=7)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("speech-clients")
    path = save_random_speech_model(root / "orpheus-random", snac_config=SMALL_SNAC)
    with ServerThread([ModelSpec(path=path, name="speech")], EngineOptions(kv_cache_gib=0.02), data_dir=root) as srv:
        servicer = next(b.servicer for b in srv.server.services if isinstance(b.servicer, SpeechServicer))
        servicer.limits.audio_seconds_base = 0.3  # the random decoder speaks its whole budget: keep it short
        servicer.limits.audio_seconds_per_char = 0.01
        srv.speech = servicer
        srv.worker = srv.registry.lookup("speech").bundle.speech.worker
        yield srv


def stub(server: ServerThread) -> speech_pb2_grpc.SpeechServiceStub:
    return speech_pb2_grpc.SpeechServiceStub(server.channel())


def one_shot_pcm(server: ServerThread, text: str, voice: str = "") -> bytes:
    request = speech_pb2.SynthesizeSpeechRequest(
        model="speech", text=text, audio_config=PCM, sampling=SEEDED, voice=speech_pb2.VoiceSelection(name=voice)
    )
    return b"".join(r.audio.data for r in stub(server).SynthesizeSpeech(request, timeout=60))


class WaitingStreamClient:
    """A StreamingSynthesizeSpeech client that sends `texts`, then waits (sending nothing, not ending) until it is told
    to `send` more or to `end`; responses are collected on a thread."""

    def __init__(self, server: ServerThread, texts: list[str]) -> None:
        self.outbox: queue.Queue[str | None] = queue.Queue()
        self.audio = bytearray()
        self.kinds: list[str] = []
        self.summary: speech_pb2.SpeechSummary | None = None
        self.error: BaseException | None = None
        config = speech_pb2.StreamingSpeechConfig(model="speech", audio_config=PCM, sampling=SEEDED)
        for text in texts:
            self.send(text)

        def requests():
            yield speech_pb2.StreamingSynthesizeSpeechRequest(config=config)
            while (text := self.outbox.get(timeout=60)) is not None:
                yield speech_pb2.StreamingSynthesizeSpeechRequest(text=text)
            yield speech_pb2.StreamingSynthesizeSpeechRequest(end=True)

        self.call = stub(server).StreamingSynthesizeSpeech(requests(), timeout=60)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def send(self, text: str) -> None:
        self.outbox.put(text)

    def _read(self) -> None:
        try:
            for response in self.call:
                self.kinds.append(response.WhichOneof("response"))
                self.audio += response.audio.data
                if response.HasField("summary"):
                    self.summary = response.summary
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def wait_for_bytes(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.audio) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return len(self.audio) >= n

    def wait_quiet(self, server: ServerThread, quiet_s: float = 1.0, timeout: float = 20) -> int:
        """Bytes received once the engine has nothing left to generate and no audio came for quiet_s."""
        deadline = time.monotonic() + timeout
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            if len(self.audio) != last or server.engine("speech").num_unfinished():
                last, since = len(self.audio), time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
            time.sleep(0.02)
        return last

    def end(self) -> None:
        self.outbox.put(None)
        self.thread.join(30)


@pytest.mark.parametrize("texts", [["Hello there."], ["Hello ", "there. "]])
def test_a_complete_sentence_is_spoken_in_full_before_the_stream_ends(server, texts):
    """A client that sends one sentence and waits for all its audio before it sends `end` gets all of it: the clause
    is complete at its period (nothing more may follow) and its last codec window is decoded without waiting for
    more frames. Before, "Hello there." got none of it (the clause waited for a space after the period) and
    "Hello there. " 7680 of 20480 bytes (the clause's last window waited in the codec stream for the next clause's
    frames)."""
    expected = one_shot_pcm(server, "Hello there.")
    assert expected
    client = WaitingStreamClient(server, texts)
    try:
        arrived = client.wait_for_bytes(len(expected), timeout=10)
        got_before_end = len(client.audio)
    finally:
        client.end()
    assert client.error is None, client.error
    assert arrived, f"{got_before_end} of {len(expected)} bytes before end"
    # Same prompt, seed and sampling as the one-shot call: the same audio tokens, so the same samples (the codec's
    # windows differ only at rounding level).
    assert len(client.audio) == len(expected)
    ours = np.frombuffer(bytes(client.audio), "<i2").astype(np.int32)
    theirs = np.frombuffer(expected, "<i2").astype(np.int32)
    assert np.abs(ours - theirs).max() <= 2
    assert client.kinds[0] == "format" and client.kinds[-1] == "summary"


def test_clause_cutter_cjk_and_settled_tails():
    """CJK clause punctuation is followed by no space: each clause is cut at it (a Chinese text was one clause until
    max_clause_chars). A text ending at punctuation is a complete clause only once no more text comes."""
    cut = ClauseCutter(max_chars=120)
    assert cut.feed("你好。今天天气很好，我们去公园吧！走") == ["你好。", "今天天气很好，", "我们去公园吧！"]
    assert cut.buffer == "走" and not cut.ends_at_boundary()
    assert cut.feed("吧。」") == [] and cut.ends_at_boundary()
    assert cut.flush() == ["走吧。」"]
    assert cut.feed("It costs 3.") == [] and cut.ends_at_boundary()  # "3." may go on as "3.5": not cut yet
    assert cut.feed("5 dollars") == [] and not cut.ends_at_boundary()
    assert cut.feed(', right?"') == ["It costs 3.5 dollars,"] and cut.ends_at_boundary()
    assert cut.flush() == ['right?"']  # the text paused: its settle timer flushes it
    assert cut.feed("! Next one,") == []  # "Next one," may go on: "one,000"
    assert cut.feed(" more") == ["Next one,"]  # the '!' of '?!' had nothing to say on its own: dropped
    assert cut.feed(" 😀 ... ") == ["more 😀 ..."] and cut.feed("… 😀") == [] and cut.flush() == []


def test_each_clause_is_spoken_in_full_while_the_client_waits_between_them(server):
    """Sentence, wait for its audio, another sentence, wait, end: everything was heard before `end`, the second
    clause continuing the same stream (whole frames, as many as the summary's audio tokens say)."""
    client = WaitingStreamClient(server, ["Hello there."])
    try:
        first = client.wait_quiet(server)
        client.send(" How are you?")
        second = client.wait_quiet(server)
    finally:
        client.end()
    assert client.error is None and client.summary is not None, client.error
    total = len(client.audio)
    assert 0 < first < second == total, (first, second, total)  # nothing was left for `end` to release
    assert total == client.summary.audio_tokens // 7 * 2048 * 2


def tone(seconds: float, rate: int) -> np.ndarray:
    return 0.3 * np.sin(np.arange(int(seconds * rate)) * 2 * np.pi * 220 / rate)


def test_create_voice_takes_headerless_reference_audio_by_its_declared_encoding(server):
    """CreateVoice passed the AudioPart's encoding NUMBER to the decoder, which knows names: raw LINEAR16 or MULAW
    reference audio (which needs its encoding declared) was refused as 'unknown encoding 1', and a WAV declared as
    such with a rate contradicting its header was refused for its encoding, not its rate."""
    import grpc
    import soundfile as sf

    pcm = (tone(1.0, 16000) * 32767).astype("<i2").tobytes()
    mulaw = io.BytesIO()
    sf.write(mulaw, tone(1.0, 8000), 8000, subtype="ULAW", format="RAW")
    wav = io.BytesIO()
    sf.write(wav, tone(1.0, 16000), 16000, format="WAV")
    parts = {
        "raw-pcm": content_pb2.AudioPart(data=pcm, encoding=ENC.AUDIO_ENCODING_LINEAR16, sample_rate_hertz=16000),
        "raw-mulaw": content_pb2.AudioPart(
            data=mulaw.getvalue(), encoding=ENC.AUDIO_ENCODING_MULAW, sample_rate_hertz=8000
        ),
    }
    for name, part in parts.items():
        request = speech_pb2.CreateVoiceRequest(model="speech", name=name, transcript="A test.", reference_audio=part)
        voice = stub(server).CreateVoice(request, timeout=60).voice
        assert voice.reference_seconds == pytest.approx(1.0, abs=1e-3)
        assert one_shot_pcm(server, "Hi.", voice=name)
    with pytest.raises(grpc.RpcError) as err:  # an unknown voice's error lists the created voices too
        one_shot_pcm(server, "Hi.", voice="nobody")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "raw-mulaw" in err.value.details(), err.value.details()
    bad = content_pb2.AudioPart(data=wav.getvalue(), encoding=ENC.AUDIO_ENCODING_WAV, sample_rate_hertz=24000)
    with pytest.raises(grpc.RpcError) as err:
        stub(server).CreateVoice(speech_pb2.CreateVoiceRequest(name="x", transcript="A.", reference_audio=bad))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("reference_audio.sample_rate_hertz:"), err.value.details()


def test_a_stream_cancelled_as_its_requests_end_logs_no_unretrieved_exception():
    """The idle bound reads the next message in a future; when the request stream ended just as the call was
    cancelled (a client cancelling mid-audio), the future's StopAsyncIteration was never retrieved and asyncio
    logged 'Task exception was never retrieved' in the server log."""
    import asyncio
    import gc

    from omnivox.services.processing.stream_idle import idle_bounded

    async def scenario() -> None:
        gate = asyncio.Event()

        async def requests():
            await gate.wait()
            return
            yield

        async def consume() -> None:
            async for _ in idle_bounded(requests(), 30.0, "text"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.01)
        gate.set()  # the requests end ...
        task.cancel()  # ... as the call is cancelled
        await asyncio.gather(task, return_exceptions=True)
        gc.collect()
        await asyncio.sleep(0.01)

    logged: list[str] = []
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _loop, ctx: logged.append(ctx["message"]))
    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert logged == []


def test_streams_cancelled_mid_audio_and_while_waiting_leave_no_state(server):
    """Three text streams at once: one cancelled mid-audio, one cancelled while it waits for text after its audio
    went out (flushed), one spoken to its end; the last one's audio is whole, and no codec stream, engine request or
    KV block is left behind."""
    import grpc

    registry = server.server.metrics.registry
    abort = {"model": "speech", "finished_reason": "abort"}
    aborted_before = registry.get_sample_value("omnivox_request_success_total", abort) or 0.0
    server.speech.limits.audio_seconds_base = 3.0  # long enough to still be speaking when cancelled
    try:
        speaking = WaitingStreamClient(server, ["Keep talking, please. "])
        waiting = WaitingStreamClient(server, ["Hi."])
        whole = WaitingStreamClient(server, ["Hello there. "])
        assert speaking.wait_for_bytes(1, timeout=20)
        speaking.call.cancel()
        server.speech.limits.audio_seconds_base = 0.3
        assert waiting.wait_for_bytes(1, timeout=20)
        waiting.call.cancel()
        whole.end()
        speaking.end()
        waiting.end()
    finally:
        server.speech.limits.audio_seconds_base = 0.3
    for cancelled in (speaking, waiting):
        assert isinstance(cancelled.error, grpc.RpcError) and cancelled.error.code() == grpc.StatusCode.CANCELLED
    assert whole.error is None and whole.kinds[-1] == "summary"
    assert len(whole.audio) > 0 and len(whole.audio) % (2 * 2048) == 0  # whole frames: nothing cut or doubled
    free, total = server.wait_kv_free("speech", timeout=5.0)
    assert free == total and server.engine("speech").num_unfinished() == 0
    deadline = time.monotonic() + 5
    while server.worker.open_streams and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.worker.open_streams == 0
    # Both cancelled streams count as finished_reason="abort", as cancelled Generate calls do (they were not counted).
    deadline = time.monotonic() + 5
    while registry.get_sample_value("omnivox_request_success_total", abort) != aborted_before + 2:
        assert time.monotonic() < deadline, registry.get_sample_value("omnivox_request_success_total", abort)
        time.sleep(0.02)


def test_cli_speak_to_stdout_and_files(server, tmp_path, capsysbinary):
    """`omnivox speak` to stdout is a WAV whose length is the summary's seconds; a file whose suffix names no encoding
    it can write (x.aac got WAV bytes) is refused before anything is sent, x.mp3 is an MP3, and a refused request
    leaves no file."""
    import re

    import soundfile as sf

    from omnivox.services.cli import main

    assert main(["speak", "Hello there.", "--server", server.address]) == 0
    captured = capsysbinary.readouterr()
    audio, rate = sf.read(io.BytesIO(captured.out))
    seconds = float(re.search(rb"([0-9.]+) s of audio", captured.err).group(1))
    assert rate == 24000 and len(audio) / rate == pytest.approx(seconds, abs=0.006)  # printed to 0.01 s
    aac = tmp_path / "x.aac"
    assert main(["speak", "Hi", "-o", str(aac), "--server", server.address]) == 1
    assert b"--encoding" in capsysbinary.readouterr().err and not aac.exists()
    assert main(["speak", "Hi", "-o", str(aac), "--encoding", "wav", "--server", server.address]) == 0
    assert sf.info(str(aac)).format == "WAV"
    mp3 = tmp_path / "x.mp3"
    assert main(["speak", "Hi", "-o", str(mp3), "--server", server.address]) == 0
    assert sf.info(str(mp3)).format == "MP3" and sf.info(str(mp3)).samplerate == 24000
    refused = tmp_path / "refused.wav"
    assert main(["speak", "Hi", "--voice", "nobody", "-o", str(refused), "--server", server.address]) == 1
    assert b"NOT_FOUND" in capsysbinary.readouterr().err and not refused.exists()


def test_split_text_keeps_closing_quotes_and_cuts_cjk_at_its_sentences():
    """SynthesizeSpeech's segments: a sentence's closing quote or bracket was cut off ('He said "Stop.'), and CJK
    text (no space after its full stops) was cut every max_chars, mid-sentence, a '！' starting a segment."""
    from omnivox.services.processing.speech_text import split_text

    assert split_text('He said "Stop." Then he left. (Really.) Yes', 20) == [
        'He said "Stop."',
        "Then he left.",
        "(Really.) Yes",
    ]
    assert split_text("你好。今天天气很好，我们去公园吧！走吧。", 8) == [
        "你好。",
        "今天天气很好，",
        "我们去公园吧！",
        "走吧。",
    ]
    assert split_text("你好。今天天气很好。", 300) == ["你好。今天天气很好。"]  # joined without a space
    assert split_text("今" * 25, 10) == ["今" * 10, "今" * 10, "今" * 5]  # no break anywhere: cut at max_chars


def test_text_of_only_invisible_characters_is_empty(server):
    """strip() keeps zero-width and format characters: "\u200b" passed the empty check and was spoken."""
    import grpc

    for text in ("\u200b", " \u200b\u2060\ufeff ", "\u200d\n\t"):
        with pytest.raises(grpc.RpcError) as err:
            one_shot_pcm(server, text)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("text:")
    assert one_shot_pcm(server, "\u200bHi.")  # with something to say around them it is spoken


def test_special_token_spellings_in_the_text_are_spoken_as_text(server):
    """ "<|begin_of_text|>" (or any added token's spelling) in the text was tokenized as that control token: a prompt
    injection into the audio-token layout. The text is spoken as its characters (`split_special_tokens`), as the text
    without special parsing tokenizes; text without such spellings keeps its ids, the "tara: ..." layout intact."""
    bundle = server.registry.lookup("speech").bundle
    layout, literal, engine_tok = bundle.speech.layout, bundle.speech.text_tokenizer, bundle.engine.tokenizer
    bos = engine_tok.bos_token_id
    text = "Say <|begin_of_text|> and <|pad|> aloud."
    plain = engine_tok(f"tara: {text}", split_special_tokens=True)["input_ids"]
    assert plain.count(bos) == 1 and plain.count(engine_tok.pad_token_id) == 0  # the spellings as bytes
    ids = layout.build_prompt(literal, text, "tara")
    assert ids == [*layout.prompt_prefix, *plain, *layout.prompt_suffix]
    normal = layout.build_prompt(literal, "Hello there.", "tara")
    assert normal == [*layout.prompt_prefix, *engine_tok("tara: Hello there.")["input_ids"], *layout.prompt_suffix]
    parsed = engine_tok(f"tara: {text}")["input_ids"]
    assert parsed.count(bos) == 2  # the engine's own tokenizer still parses them (chat templates need that)
    # Through gRPC, one-shot and streamed: the prompt is the literal one (prompt_tokens counts it).
    request = speech_pb2.SynthesizeSpeechRequest(model="speech", text=text, audio_config=PCM, sampling=SEEDED)
    responses = list(stub(server).SynthesizeSpeech(request, timeout=60))
    assert responses[-1].summary.prompt_tokens == len(ids)  # parsed, each spelling was one id
    client = WaitingStreamClient(server, [text])
    client.end()
    assert client.error is None and client.summary is not None
    assert client.summary.prompt_tokens == len(ids)
