"""Multimodal checkpoints: the text decoder loads from them today's way; the other parts' weights are routed away.

Tiny random LLaVA and Qwen2-Audio models saved with transformers' own `save_pretrained`: our engine loads the text
decoder, and on a text-only prompt its logits and greedy tokens equal transformers' own multimodal model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from omnivox.engine import Engine, SamplingParams
from omnivox.models.checkpoint import checkpoint_parts, iter_checkpoint_tensors, route_weight_name
from omnivox.models.config import ModelConfig

TEXT = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
PROMPT = [1, 17, 42, 99, 5, 63, 120, 7, 33]


def _perturb_and_save(model: torch.nn.Module, out: Path) -> Path:
    with torch.no_grad():  # random init leaves norms at 1.0: make every weight matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.eval().save_pretrained(out)
    return out


def _llava(out: Path) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    config = transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(**TEXT),
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=16,
            projection_dim=16,
        ),  # fmt: skip
        image_token_index=TEXT["vocab_size"] - 1,
    )
    model = transformers.LlavaForConditionalGeneration(config)
    return _perturb_and_save(model, out), model


def _qwen2_audio(out: Path) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    config = transformers.Qwen2AudioConfig(
        text_config=transformers.Qwen2Config(**TEXT),
        audio_config=transformers.Qwen2AudioEncoderConfig(
            d_model=16,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=32,
            num_mel_bins=16,
            max_source_positions=30,
        ),  # fmt: skip
        audio_token_index=TEXT["vocab_size"] - 1,
    )
    model = transformers.Qwen2AudioForConditionalGeneration(config)
    return _perturb_and_save(model, out), model


@pytest.mark.parametrize("make", [_llava, _qwen2_audio], ids=["llava", "qwen2-audio"])
def test_text_decoder_of_a_multimodal_checkpoint_matches_transformers(tmp_path: Path, make) -> None:
    path, reference = make(tmp_path / "mm")
    parts = checkpoint_parts(path)
    assert set(parts) >= {"decoder", "projector"} and ({"vision", "audio"} & set(parts))
    decoder_names = {name for name, _ in iter_checkpoint_tensors(path)}
    assert "model.norm.weight" in decoder_names and "model.layers.0.self_attn.q_proj.weight" in decoder_names
    assert not any("tower" in n or "projector" in n for n in decoder_names)

    config = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(path))
    assert (config.vocab_size, config.hidden_size, config.num_layers) == (384, 64, 2)

    engine = Engine.from_pretrained(str(path), device="cpu", dtype="float32", kv_cache_gib=0.01)
    try:
        [out] = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0))
        with torch.no_grad():
            ids = torch.tensor([PROMPT + out.token_ids[:-1]])
            logits = reference(input_ids=ids).logits[0, len(PROMPT) - 1 :].float()  # [8, vocab]
        expected = logits.argmax(-1).tolist()
        assert out.token_ids == expected
        ours = torch.tensor([lp.logprob for lp in out.logprobs])
        theirs = torch.log_softmax(logits, -1).gather(1, torch.tensor(expected)[:, None])[:, 0]
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=0)
    finally:
        engine.shutdown()


def test_weight_names_route_to_their_part() -> None:
    cases = {
        "language_model.model.layers.0.mlp.up_proj.weight": ("decoder", "model.layers.0.mlp.up_proj.weight"),
        "language_model.lm_head.weight": ("decoder", "lm_head.weight"),
        "model.language_model.norm.weight": ("decoder", "model.norm.weight"),
        "model.text_model.embed_tokens.weight": ("decoder", "model.embed_tokens.weight"),
        "lm_head.weight": ("decoder", "lm_head.weight"),
        "model.layers.1.self_attn.k_proj.bias": ("decoder", "model.layers.1.self_attn.k_proj.bias"),
        "vision_tower.vision_model.embeddings.patch_embedding.weight": ("vision", None),
        "model.vision_tower.encoder.layers.0.mlp.fc1.weight": ("vision", None),
        "visual.blocks.0.attn.qkv.weight": ("vision", None),
        "model.visual.merger.mlp.0.weight": ("vision", None),
        "audio_tower.layers.0.fc1.weight": ("audio", None),
        "multi_modal_projector.linear_1.weight": ("projector", None),
        "model.multi_modal_projector.linear.weight": ("projector", None),
    }
    for name, (part, renamed) in cases.items():
        assert route_weight_name(name) == (part, renamed or name), name


def test_a_vision_checkpoint_without_its_processor_fails_to_load_naming_it(tmp_path: Path) -> None:
    """Image input needs the checkpoint's own processor (services/processing/image_prompt.py); without one the model is not
    served as text-only in silence: loading fails with the reason (tests/services/generation/test_service_images.py serves full ones)."""
    from support.checkpoints import make_tokenizer
    from support.service_harness import ServerThread

    from omnivox.services.parts.loading import EngineOptions, ModelLoadError, ModelSpec

    path, _ = _llava(tmp_path / "llava")
    make_tokenizer(path, TEXT["vocab_size"])
    server = ServerThread([ModelSpec(path=path, name="llava")], EngineOptions(kv_cache_gib=0.01, device="cpu"))
    with pytest.raises(ModelLoadError, match="image processor"):
        server.__enter__()
    assert server.registry.lookup("llava").manifest.planned_parts == ()  # vision and projector are built parts
    server.stop()
