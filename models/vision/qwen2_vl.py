"""Qwen2-VL (`Qwen2VLForConditionalGeneration`, e.g. Qwen2-VL-2B / 7B-Instruct): the vision side; what it shares
with Qwen2.5-VL (processor plumbing, M-RoPE positions) is in qwen_vl.py.

Tower: transformers' `Qwen2VisionTransformerPretrainedModel`: LayerNorm blocks of width `embed_dim` with a
fc1 / fc2 MLP (`hidden_act`, QuickGELU in the releases), full attention in every block (no windows), and a
PatchMerger (LayerNorm `ln_q`, then two linears) out to `vision_config.hidden_size`, the text width.

The text side is Qwen2 with M-RoPE (`mrope_section`); releases keep its keys at the top level of config.json with
`rope_scaling` {"type": "mrope"}, newer saves under `text_config`: transformers' Qwen2VLConfig reads both.
"""

from __future__ import annotations

import transformers
from torch import nn

from omnivox.models.vision.qwen_vl import QwenVLEncoder


class Qwen2VLEncoder(QwenVLEncoder):
    family = "qwen2_vl"
    merger_width_key = "hidden_size"  # Qwen2-VL's vision width is embed_dim; hidden_size is the merger's output

    @staticmethod
    def build_tower(vision_config: transformers.PretrainedConfig) -> nn.Module:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return Qwen2VisionTransformerPretrainedModel._from_config(vision_config)
