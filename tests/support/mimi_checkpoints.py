"""Tiny random Mimi codecs (transformers' `MimiModel`, saved with `save_pretrained`) for the codec and CSM tests.

transformers initialises Mimi's codebooks to zeros and its layer scales to 0.01, which would hide a wrong codebook or
a wrong attention: the codebooks, their usage counts and the layer scales are drawn at random, and the last conv is
scaled so that the audio stays near [-1, 1] (absolute tolerances then mean what they say).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import MimiConfig, MimiModel

# Two shapes: different codebook counts, ratios, residual layers, shortcut convs, GQA; both past the sliding window
# within a few frames (window 5 transformer steps = 2.5 frames at latent stride 2).
TINY_MIMI_CONFIGS: dict[str, dict] = {
    "mimi-a": dict(
        hidden_size=32, num_filters=4, upsampling_ratios=[4, 3], codebook_size=16, codebook_dim=8, num_quantizers=4,
        vector_quantization_hidden_dimension=8, upsample_groups=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=5, sampling_rate=24000,
    ),
    "mimi-b": dict(
        hidden_size=24, num_filters=2, upsampling_ratios=[3, 2, 2], codebook_size=32, codebook_dim=6, num_quantizers=6,
        num_semantic_quantizers=2, vector_quantization_hidden_dimension=6, upsample_groups=24, num_hidden_layers=1,
        intermediate_size=48, num_attention_heads=2, num_key_value_heads=2, sliding_window=7, sampling_rate=24000,
        num_residual_layers=2, use_conv_shortcut=True, hidden_act="gelu",
    ),
}  # fmt: skip


def random_mimi(config: dict, seed: int = 0) -> MimiModel:
    """A `MimiModel` of `config` with every weight random (see the module docstring), in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MimiModel(MimiConfig(**config)).eval()
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("embed_sum"):
                    buf.normal_()
                elif name.endswith("cluster_usage"):
                    buf.uniform_(0.5, 2.0)
            for name, p in model.named_parameters():
                if name.endswith("layer_scale.scale"):
                    p.normal_(0.0, 0.3)
            probe = torch.randint(0, config["codebook_size"], (1, config["num_quantizers"], 8))
            peak = model.decode(probe).audio_values.abs().max().clamp(min=1e-3)
            last = model.decoder.decoder_seanet.layers[-1].conv
            last.weight.div_(peak)
            last.bias.div_(peak)
    return model


def save_tiny_mimi(out_dir: Path, name: str, seed: int = 0) -> Path:
    random_mimi(TINY_MIMI_CONFIGS[name], seed).save_pretrained(out_dir)
    return out_dir
