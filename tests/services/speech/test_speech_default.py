"""The embedded speech model: built into the cache once, served without --model, flagged untrained, speaks (noise)."""

from __future__ import annotations

import json

import pytest
from support.service_harness import ServerThread

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
from omnivox.models.orpheus import ORPHEUS_LAYOUT, SpeechLayout
from omnivox.services.grpc_api.speech import SpeechServicer
from omnivox.services.parts.defaults import DEFAULT_SPEECH_MODEL_NAME, ensure_default_speech_model
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, model_pb2, model_pb2_grpc, speech_pb2, speech_pb2_grpc


@pytest.mark.slow
def test_default_speech_model_is_built_once_and_served(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIVOX_CACHE", str(tmp_path / "cache"))
    path = ensure_default_speech_model()
    assert path.parent == tmp_path / "cache" / "models"
    assert SpeechLayout.load(path) == ORPHEUS_LAYOUT
    assert json.loads((path / "snac" / "config.json").read_text()) == SNAC_24KHZ_CONFIG  # the published shape
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] >= 128256 + 10 + 7 * 4096
    stamp = (path / "config.json").stat().st_mtime_ns
    assert ensure_default_speech_model() == path and (path / "config.json").stat().st_mtime_ns == stamp
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".omnivox-speech") and p.is_dir()]

    with ServerThread([ModelSpec(path=None, speech=True)], EngineOptions(kv_cache_gib=0.02)) as server:
        servicer = next(b.servicer for b in server.server.services if isinstance(b.servicer, SpeechServicer))
        servicer.limits.audio_seconds_base = 0.3  # the full-size SNAC on CPU: keep the noise short
        servicer.limits.audio_seconds_per_char = 0.0
        models = model_pb2_grpc.ModelServiceStub(server.channel()).ListModels(model_pb2.ListModelsRequest()).models
        (info,) = models
        assert info.name == DEFAULT_SPEECH_MODEL_NAME and info.ready
        assert list(info.output_modalities) == [model_pb2.MODALITY_AUDIO]
        assert set(info.untrained_components) == {"speech decoder", "SNAC codec"}
        stub = speech_pb2_grpc.SpeechServiceStub(server.channel())
        request = speech_pb2.SynthesizeSpeechRequest(
            text="Hello there",
            voice=speech_pb2.VoiceSelection(name="tara"),
            audio_config=speech_pb2.AudioConfig(encoding=content_pb2.AUDIO_ENCODING_LINEAR16),
        )
        responses = list(stub.SynthesizeSpeech(request, timeout=300))
        summary = responses[-1].summary
        data = b"".join(r.audio.data for r in responses if r.WhichOneof("response") == "audio")
        assert summary.audio_tokens == 4 * 7  # ceil(0.3 s / 85.3 ms) frames; the random model never stops early
        assert len(data) == 2 * 4 * 2048
