"""services/parts/bundle.py: what a served model is, and what it accepts and produces follows from the parts it holds."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from support.checkpoints import make_checkpoint

from omnivox.codecs.snac import SNAC_24KHZ_CONFIG
from omnivox.services.parts.bundle import AUDIO, TEXT, load_bundle, modalities, probe, read_generation_config
from omnivox.services.parts.defaults import (
    DEFAULT_GENERATION_CONFIG,
    DEFAULT_SPEECH_UNTRAINED,
    save_random_speech_model,
)
from omnivox.services.parts.loading import EngineOptions, ModelSpec

OPTIONS = EngineOptions(kv_cache_gib=0.01, device="cpu")


def test_modalities_follow_the_parts() -> None:
    assert modalities(()) == (frozenset({TEXT}), frozenset({TEXT}))
    assert modalities({"speech"}) == (frozenset({TEXT}), frozenset({AUDIO}))
    assert modalities({"vision", "audio"})[0] == {"text", "image", "audio"}
    assert modalities({"whisper"}) == (frozenset({AUDIO}), frozenset({TEXT}))  # speech recognition: no text in


def test_probe_reads_declarations_without_loading(tmp_path: Path) -> None:
    text_default = probe(ModelSpec(path=None))
    assert text_default.source is None and text_default.parts == frozenset()
    assert text_default.file_defaults == read_generation_config(DEFAULT_GENERATION_CONFIG)
    speech_default = probe(ModelSpec(path=None, speech=True, sampling_overrides={"temperature": 0.9}))
    assert speech_default.output_modalities == {AUDIO}
    assert speech_default.untrained_components == DEFAULT_SPEECH_UNTRAINED
    assert speech_default.sampling_defaults == {"temperature": 0.9}


def test_a_text_checkpoint_is_a_text_bundle(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "tiny")
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 7}))
    bundle = load_bundle(ModelSpec(path=path, sampling_overrides={"top_k": 2}), OPTIONS)
    try:
        assert bundle.speech is None and bundle.source == path
        assert bundle.input_modalities == {TEXT} and bundle.output_modalities == {TEXT}
        assert bundle.generation_defaults == {"temperature": 0.3, "top_k": 2}  # the operator's override wins
        assert bundle.prompt_builder.build  # the chat-template builder over the engine's tokenizer
    finally:
        asyncio.run(bundle.aclose())


@pytest.mark.slow
def test_a_speech_checkpoint_brings_its_codec_and_layout_defaults(tmp_path: Path) -> None:
    small = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)
    path = save_random_speech_model(tmp_path / "speech", snac_config=small)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 1.0, "top_k": 50}))
    bundle = load_bundle(ModelSpec(path=path), OPTIONS)
    try:
        assert bundle.speech is not None and bundle.output_modalities == {AUDIO}
        layout = bundle.speech.layout
        # The layout's values win over the decoder's generation_config.json; what the layout leaves alone stays.
        assert bundle.generation_defaults == {
            "temperature": layout.temperature,
            "top_p": layout.top_p,
            "repetition_penalty": layout.repetition_penalty,
            "top_k": 50,
        }
        assert bundle.untrained_components == DEFAULT_SPEECH_UNTRAINED
    finally:
        asyncio.run(bundle.aclose())


def test_a_speech_model_without_its_codec_fails_to_load_not_at_its_first_request(tmp_path: Path) -> None:
    import shutil

    from omnivox.services.parts.loading import ModelLoadError, load, resolve
    from omnivox.services.parts.registry import ModelState

    small = dict(SNAC_24KHZ_CONFIG, encoder_dim=8, decoder_dim=64)
    path = save_random_speech_model(tmp_path / "speech", snac_config=small)
    shutil.rmtree(path / "snac")
    model = resolve(ModelSpec(path=path), is_default=True, max_queue=4)
    assert model.output_modalities == {AUDIO}  # declared by speech_layout.json before loading
    with pytest.raises(ModelLoadError, match="cannot load 'speech'"):
        load(model, OPTIONS)
    assert model.state is ModelState.FAILED and model.bundle is None
