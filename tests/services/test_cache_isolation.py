"""Per-tenant cache isolation over gRPC: with API keys, one caller never hits another caller's prefix KV blocks,
encoded images, encoded Whisper windows or cascade transcripts (a hit answers far sooner: a timing side channel), the
same caller does, and `cache_salt` separates requests of one caller further. Hits are read from the caches' own
counters and the summary's cached_prompt_tokens, never from timing. Unauthenticated servers keep one shared cache
(test_service_generate's prefix test, test_whisper_service's cascade)."""

from __future__ import annotations

import re

import grpc
import pytest
from google.rpc import error_details_pb2
from support.audio_checkpoints import chirp, encode, make_qwen2_audio
from support.checkpoints import make_checkpoint
from support.service_harness import ServerThread, user_request
from support.vision_checkpoints import make_llava, png_bytes, sample_image
from support.whisper_checkpoints import make_whisper

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
from omnivox.services.grpc_api.rpc_errors import status_details
from omnivox.services.grpc_api.speech import SpeechServicer
from omnivox.services.parts.defaults import save_random_speech_model
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.services.parts.whisper_part import TranscriptCache
from omnivox.services.processing.cache_salt import MAX_CACHE_SALT_CHARS, request_salt
from omnivox.v1 import (
    content_pb2,
    generation_pb2,
    generation_pb2_grpc,
    sampling_pb2,
    speech_pb2,
    speech_pb2_grpc,
    transcription_pb2,
    transcription_pb2_grpc,
)

ALICE = (("authorization", "Bearer sk-alice-0123456789"),)
BOB = (("authorization", "Bearer sk-bob-0123456789"),)
GREEDY = sampling_pb2.SamplingConfig(temperature=0.0)
SMALL_SNAC = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)
TEXT = "The capital of France is Paris. The capital of Italy is Rome. " * 4  # several full KV blocks


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("isolation")
    keys = root / "keys.txt"
    keys.write_text("alice:sk-alice-0123456789\nbob:sk-bob-0123456789\n")
    specs = [
        ModelSpec(path=make_checkpoint(root / "text", family="llama", max_position_embeddings=4096), name="text"),
        ModelSpec(path=make_llava(root / "llava"), name="llava"),
        ModelSpec(path=make_whisper(root / "whisper"), name="whisper"),
        ModelSpec(path=make_qwen2_audio(root / "audio-llm"), name="audio-llm"),
        ModelSpec(path=save_random_speech_model(root / "speech", snac_config=SMALL_SNAC), name="speech"),
    ]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01), api_keys=keys, asr_model="whisper") as server:
        channel = server.channel()
        speech = next(b.servicer for b in server.server.services if isinstance(b.servicer, SpeechServicer))
        speech.limits.audio_seconds_base = 0.2  # the random decoder speaks for its whole budget: keep it short
        speech.limits.audio_seconds_per_char = 0.0
        yield {
            "server": server,
            "generate": generation_pb2_grpc.GenerationServiceStub(channel),
            "transcribe": transcription_pb2_grpc.TranscriptionServiceStub(channel),
            "speech": speech_pb2_grpc.SpeechServiceStub(channel),
        }


def cached(served, metadata, parts, model: str = "text", **fields) -> int:
    """The prompt tokens the prefix cache served to one Generate call."""
    request = generation_pb2.GenerateRequest(
        model=model, contents=[content_pb2.Content(role="user", parts=parts)], sampling=GREEDY,
        max_output_tokens=1, **fields,
    )  # fmt: skip
    out = list(served["generate"].Generate(request, metadata=metadata, timeout=60))
    return out[-1].summary.usage.cached_prompt_tokens


def test_prefix_cache_is_shared_within_a_caller_and_a_salt_only(served) -> None:
    text = [content_pb2.Part(text=TEXT)]
    assert cached(served, ALICE, text) == 0
    assert cached(served, BOB, text) == 0  # alice's blocks are cached, but not for bob
    assert cached(served, ALICE, text) >= 16
    assert cached(served, BOB, text) >= 16
    assert cached(served, ALICE, text, cache_salt="conversation-1") == 0  # a salt narrows alice's share
    assert cached(served, ALICE, text, cache_salt="conversation-1") >= 16
    assert cached(served, ALICE, text, cache_salt="conversation-2") == 0
    assert cached(served, BOB, text, cache_salt="conversation-1") == 0  # the same salt from another key: no share
    free, total = served["server"].wait_kv_free("text")
    assert free == total


def test_encoder_cache_is_per_caller(served) -> None:
    cache = served["server"].registry.lookup("llava").bundle.vision.cache
    image = content_pb2.Part(image=content_pb2.ImagePart(data=png_bytes(sample_image(40, 30, seed=7))))
    parts = [image, content_pb2.Part(text="What is in the picture?")]
    hits, misses = cache.hits, cache.misses
    assert cached(served, ALICE, parts, model="llava") == 0
    assert (cache.hits - hits, cache.misses - misses) == (0, 1)
    assert cached(served, BOB, parts, model="llava") == 0
    assert (cache.hits - hits, cache.misses - misses) == (0, 2)  # bob's image is encoded anew
    assert cached(served, ALICE, parts, model="llava") > 0
    assert (cache.hits - hits, cache.misses - misses) == (1, 2)  # alice's features are hers to reuse
    assert cached(served, ALICE, parts, model="llava", cache_salt="s") == 0
    assert (cache.hits - hits, cache.misses - misses) == (1, 3)
    assert cache.total_refs() == 0


def test_cascade_transcripts_and_whisper_windows_are_per_caller(served) -> None:
    part = served["server"].registry.lookup("whisper").bundle.whisper
    transcripts, windows = part.transcripts, part.cache
    audio = content_pb2.AudioPart(data=encode(chirp(0.5), 16000, "WAV", "FLOAT"))
    spoken = [content_pb2.Part(text="Answer:"), content_pb2.Part(audio=audio)]
    t_hits, t_misses, w_misses = transcripts.hits, transcripts.misses, windows.misses
    cached(served, ALICE, spoken)
    assert (transcripts.hits - t_hits, transcripts.misses - t_misses) == (0, 1)
    cached(served, BOB, spoken)
    assert (transcripts.hits - t_hits, transcripts.misses - t_misses) == (0, 2)  # transcribed again for bob
    assert windows.misses - w_misses == 2  # and its window encoded again: alice's cross K/V is not bob's
    cached(served, ALICE, spoken)
    assert (transcripts.hits - t_hits, transcripts.misses - t_misses) == (1, 2)
    cached(served, ALICE, spoken, cache_salt="other")
    assert (transcripts.hits - t_hits, transcripts.misses - t_misses) == (1, 3)
    # Transcribe on the Whisper model itself, a clip new to the server: encoded for alice, again for bob, then a hit.
    other = content_pb2.AudioPart(data=encode(chirp(0.6), 16000, "WAV", "FLOAT"))
    request = transcription_pb2.TranscribeRequest(model="whisper", audio=other, language="en", temperature=0.0)
    encoded = []
    for metadata in (ALICE, BOB, ALICE):
        before = windows.misses
        list(served["transcribe"].Transcribe(request, metadata=metadata, timeout=60))
        encoded.append(windows.misses - before)
    assert encoded == [1, 1, 0]
    assert windows.total_refs() == 0


def test_audio_llm_clips_are_encoded_per_caller(served) -> None:
    """Transcribe and Generate on an audio-LLM (its own encoder cache): a clip is encoded once per caller and salt."""
    cache = served["server"].registry.lookup("audio-llm").bundle.audio.cache
    audio = content_pb2.AudioPart(data=encode(chirp(0.7), 16000, "WAV", "FLOAT"))
    transcribe = transcription_pb2.TranscribeRequest(model="audio-llm", audio=audio, language="en")
    spoken = [content_pb2.Part(audio=audio), content_pb2.Part(text="What was said?")]
    encoded = []
    for metadata, call in [(ALICE, "transcribe"), (BOB, "transcribe"), (ALICE, "transcribe"), (BOB, "generate")]:
        before = cache.misses
        if call == "transcribe":
            list(served["transcribe"].Transcribe(transcribe, metadata=metadata, timeout=60))
        else:
            cached(served, metadata, spoken, model="audio-llm")
        encoded.append(cache.misses - before)
    assert encoded == [1, 1, 0, 0]  # Generate shares bob's clip with his Transcribe: the same model, caller and salt
    assert cache.total_refs() == 0


def test_speech_prompts_are_cached_per_caller(served) -> None:
    request = speech_pb2.SynthesizeSpeechRequest(model="speech", text="The quick brown fox jumps over the lazy dog.")

    def cached_speech(metadata, **fields) -> int:
        request.cache_salt = fields.get("cache_salt", "")
        out = list(served["speech"].SynthesizeSpeech(request, metadata=metadata, timeout=60))
        return out[-1].summary.cached_prompt_tokens

    assert [cached_speech(ALICE), cached_speech(BOB)] == [0, 0]
    assert cached_speech(ALICE) >= 16
    assert cached_speech(ALICE, cache_salt="s") == 0


def test_grammar_compiles_are_per_caller(served) -> None:
    """A response_format's or tools' compiled grammar (a cache hit answers at once) is shared within a caller and a
    salt only: read from the model's compile counter (services/processing/structured.py), not timing."""
    grammars = served["server"].registry.lookup("text").bundle.grammars
    fmt = generation_pb2.ResponseFormat(regex="isolated [0-9]")
    schema = '{"type": "object", "properties": {"q": {"type": "string"}}}'
    tools = [generation_pb2.Tool(name="lookup", parameters_json_schema=schema)]

    def compiles(metadata, **fields) -> int:
        before = grammars.compiles
        cached(served, metadata, [content_pb2.Part(text="Hi")], **fields)
        return grammars.compiles - before

    assert compiles(ALICE, response_format=fmt) == 1
    assert compiles(ALICE, response_format=fmt) == 0  # the same caller's retry: cached
    assert compiles(BOB, response_format=fmt) == 1
    assert compiles(ALICE, response_format=fmt, cache_salt="other") == 1
    assert (compiles(ALICE, tools=tools), compiles(ALICE, tools=tools), compiles(BOB, tools=tools)) == (1, 0, 1)


def field_of(err: grpc.RpcError) -> list[str]:
    return [v.field for d in status_details(err) if isinstance(d, error_details_pb2.BadRequest)
            for v in d.field_violations]  # fmt: skip


def test_a_too_long_cache_salt_is_invalid_argument_naming_it(served) -> None:
    salt = "x" * (MAX_CACHE_SALT_CHARS + 1)
    with pytest.raises(grpc.RpcError) as info:
        list(served["generate"].Generate(user_request("Hi", cache_salt=salt), metadata=ALICE, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_of(info.value) == ["cache_salt"]
    audio = content_pb2.AudioPart(data=encode(chirp(0.2), 16000, "WAV", "FLOAT"))
    request = transcription_pb2.TranscribeRequest(model="whisper", audio=audio, cache_salt=salt, temperature=0.0)
    with pytest.raises(grpc.RpcError) as info:
        list(served["transcribe"].Transcribe(request, metadata=ALICE, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_of(info.value) == ["cache_salt"]
    for stream, config in [
        (served["transcribe"].StreamingTranscribe, transcription_pb2.StreamingTranscribeRequest(
            config=transcription_pb2.StreamingTranscriptionConfig(sample_rate_hertz=16000, cache_salt=salt, temperature=0.0))),
        (served["speech"].StreamingSynthesizeSpeech, speech_pb2.StreamingSynthesizeSpeechRequest(
            config=speech_pb2.StreamingSpeechConfig(model="speech", cache_salt=salt))),
    ]:  # fmt: skip
        with pytest.raises(grpc.RpcError) as info:
            list(stream(iter([config]), metadata=ALICE, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_of(info.value) == ["config.cache_salt"]
    ok = user_request("Hi", cache_salt="x" * MAX_CACHE_SALT_CHARS, max_output_tokens=1)
    assert list(served["generate"].Generate(ok, metadata=ALICE, timeout=30))[-1].HasField("summary")


def test_the_cli_sends_cache_salt(served, tmp_path, capsys) -> None:
    """`--cache-salt` reaches the server from every command whose request takes one: generate shares its prefix
    within a salt only (the summary line's cached count); a too-long salt is the server's INVALID_ARGUMENT naming
    the field, from generate (chat, ask), speak, transcribe and transcribe --stream."""
    from omnivox.services.cli import main

    server = ("--server", served["server"].address, "--api-key", "sk-alice-0123456789")
    prompt = "CLI. " + TEXT

    def generate_cached(salt: str) -> int:
        assert main(["generate", prompt, "--model", "text", "--max-tokens", "1", "--cache-salt", salt, *server]) == 0
        return int(re.search(r"\((\d+) cached\)", capsys.readouterr().err).group(1))

    first, again, other = generate_cached("one"), generate_cached("one"), generate_cached("two")
    assert first == 0 and again > 0 and other == 0, (first, again, other)
    wav = tmp_path / "clip.wav"
    wav.write_bytes(encode(chirp(0.3), 16000, "WAV"))
    long = "x" * (MAX_CACHE_SALT_CHARS + 1)
    for command, field in [
        (["generate", "Hi", "--model", "text"], "cache_salt"),
        (["speak", "Hi", "--model", "speech", "-o", str(tmp_path / "out.wav")], "cache_salt"),
        (["transcribe", str(wav), "--model", "whisper"], "cache_salt"),
        (["transcribe", str(wav), "--model", "whisper", "--stream", "--pace", "0"], "config.cache_salt"),
    ]:
        assert main([*command, "--cache-salt", long, *server]) == 1, command
        assert f"INVALID_ARGUMENT: {field}:" in capsys.readouterr().err, command


def test_an_unauthenticated_call_without_a_salt_keeps_the_shared_cache() -> None:
    """Outside any RPC (no caller) and without cache_salt: the empty salt, i.e. the hashes every cache had before."""
    assert request_salt("") == ""
    assert request_salt("a") != "" and request_salt("a") != request_salt("b")


def test_transcript_cache_evicts_the_least_recently_used() -> None:
    cache = TranscriptCache(max_entries=2)
    cache.put(b"a", "alpha")
    cache.put(b"b", "beta")
    assert cache.get(b"a") == "alpha"  # a is now the most recently used
    cache.put(b"c", "gamma")
    assert (cache.get(b"b"), cache.get(b"a"), cache.get(b"c"), len(cache)) == (None, "alpha", "gamma", 2)
    assert (cache.hits, cache.misses) == (3, 1)
