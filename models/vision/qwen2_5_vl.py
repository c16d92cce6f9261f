"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): the vision side; what it shares with Qwen2-VL (processor
plumbing, M-RoPE positions) is in qwen_vl.py.

Tower: transformers' `Qwen2_5_VisionTransformerPretrainedModel`: RMSNorm, a gated SiLU MLP, window attention in most
blocks and full attention in `fullatt_block_indexes`; the merger's width is `vision_config.out_hidden_size`.
"""

from __future__ import annotations

import transformers
from torch import nn

from omnivox.models.vision.qwen_vl import QwenVLEncoder


class Qwen25VLEncoder(QwenVLEncoder):
    family = "qwen2_5_vl"
    merger_width_key = "out_hidden_size"

    @staticmethod
    def build_tower(vision_config: transformers.PretrainedConfig) -> nn.Module:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return Qwen2_5_VisionTransformerPretrainedModel._from_config(vision_config)
