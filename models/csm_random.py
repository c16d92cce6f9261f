"""Random-weight CSM checkpoints: a transformers `CsmForConditionalGeneration` folder (config, weights, generation
config, processor with its chat template, Mimi codec inside) that runs end to end and speaks noise, marked untrained
(`untrained_components.json`) as orpheus-random is. For tests (tiny shapes) and benchmarks (`CSM_1B_SHAPE`).

The tokenizer is the caller's (any transformers tokenizer: the text vocabulary is sized to it). Every weight is
random: transformers would leave Mimi's codebooks at zero and its layer scales at 0.01, which would hide a wrong
codebook or attention; the codec's last conv is scaled so that the audio stays near [-1, 1].
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

UNTRAINED = ("CSM backbone", "CSM depth decoder", "Mimi codec")

# sesame/csm-1b's shape: a Llama-3.2-1B backbone, a 4-layer depth decoder, 32 codebooks of 2048 (+3 specials),
# Mimi at 12.5 frames/s. Rope scaling as published (llama3, factor 32).
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
CSM_1B_SHAPE: dict = dict(
    num_codebooks=32, vocab_size=2051, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048, rope_parameters=_LLAMA3_ROPE,
    codebook_pad_token_id=2050, codebook_eos_token_id=0,
    depth_decoder_config=dict(num_codebooks=32, vocab_size=2051, backbone_hidden_size=2048, hidden_size=1024,
                              intermediate_size=8192, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                              head_dim=128, max_position_embeddings=33, rope_parameters=_LLAMA3_ROPE),
    codec_config={"model_type": "mimi"},
)  # fmt: skip
# CSM's own prompt: each turn `<bos>[speaker]text<eos>`, a turn's audio as <|AUDIO|> placeholders then <|audio_eos|>.
CSM_CHAT_TEMPLATE = (
    "{%- for message in messages -%}{{ bos_token }}[{{ message['role'] }}]"
    "{%- for item in message['content'] if item['type'] == 'text' -%}{{ item['text'] }}{%- endfor -%}{{ eos_token }}"
    "{%- for item in message['content'] if item['type'] == 'audio' -%}<|AUDIO|><|audio_eos|>{%- endfor -%}"
    "{%- endfor -%}"
)
GENERATION_CONFIG = {"do_sample": True, "temperature": 0.9, "top_k": 50, "depth_decoder_do_sample": True,
                     "depth_decoder_temperature": 0.9, "depth_decoder_top_k": 50}  # fmt: skip


def _randomize(model, seed: int, scale: float) -> None:
    """Every weight off its init value; Mimi's codebooks, usage counts and layer scales drawn; audio near [-1, 1]."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("codec_model."):
                p.add_(torch.randn(p.shape, generator=g) * scale)
        codec = model.codec_model
        for name, buf in codec.named_buffers():
            if name.endswith("embed_sum"):
                buf.copy_(torch.randn(buf.shape, generator=g))
            elif name.endswith("cluster_usage"):
                buf.uniform_(0.5, 2.0, generator=g)
        for name, p in codec.named_parameters():
            if name.endswith("layer_scale.scale"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        cfg = codec.config
        probe = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, 4), generator=g)
        peak = codec.decode(probe).audio_values.abs().max().clamp(min=1e-3)
        last = codec.decoder.decoder_seanet.layers[-1].conv
        last.weight.div_(peak)
        last.bias.div_(peak)


def save_random_csm(out_dir: str | Path, shape: dict, tokenizer, seed: int = 0, weight_scale: float = 0.3) -> Path:
    """Write a random CSM folder of `shape` (CsmConfig fields) with `tokenizer` (its specials added) at out_dir."""
    from transformers import CsmConfig, CsmForConditionalGeneration, CsmProcessor, EncodecFeatureExtractor

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|AUDIO|>", "<|audio_eos|>"]})
    if tokenizer.pad_token is None or tokenizer.pad_token == tokenizer.eos_token:
        # A pad distinct from the end of a turn, as sesame/csm-1b has (128002 vs 128001): generate masks the pad id
        # out of its prompt, and every CSM turn ends with the eos token.
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    ids = tokenizer.convert_tokens_to_ids
    config = CsmConfig(
        **shape,
        text_vocab_size=len(tokenizer),
        audio_token_id=ids("<|AUDIO|>"),
        audio_eos_token_id=ids("<|audio_eos|>"),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=None,  # the stream ends on an end frame (all codes but the last = codebook_eos_token_id)
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CsmForConditionalGeneration(config).eval()
    _randomize(model, seed, weight_scale)
    model.generation_config.eos_token_id = None
    for key, value in GENERATION_CONFIG.items():  # the depth decoder's go to its own config (saved prefixed)
        if key.startswith("depth_decoder_"):
            setattr(model.depth_decoder.generation_config, key.removeprefix("depth_decoder_"), value)
        else:
            setattr(model.generation_config, key, value)
    model.save_pretrained(out_dir)
    extractor = EncodecFeatureExtractor(feature_size=1, sampling_rate=config.codec_config.sampling_rate)
    CsmProcessor(extractor, tokenizer, chat_template=CSM_CHAT_TEMPLATE).save_pretrained(out_dir)
    (out_dir / "untrained_components.json").write_text(json.dumps(list(UNTRAINED)))
    return out_dir
