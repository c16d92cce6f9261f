"""EngineConfig: how one engine is built and run, as one frozen value (what `Engine.from_pretrained` reads).

The service's per-model options (services/parts/loading.py EngineOptions) are an EngineConfig plus the service's own knobs,
so a served model's engine is built from them as they are, with no field copied by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from omnivox.models.pipeline import NodeGroup


@dataclass(frozen=True)
class EngineConfig:
    device: str | torch.device | None = None  # None: CUDA when present, else CPU (engine/loading.py default_device)
    dtype: str | torch.dtype | None = None  # None: the device's default (bfloat16 on CUDA, float32 on CPU)
    kv_cache_gib: float | None = None  # None: sized from free memory (engine/loading.py size_kv_cache)
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int | None = None  # per engine step; None = the engine's default for the device
    max_model_len: int | None = None  # None: the checkpoint's own context length
    enable_prefix_caching: bool = True
    static_decode: bool | None = None  # replayed CUDA graphs for decode; None = on where they apply
    progress: bool = False  # progress bars while loading weights
    speculative: str | None = None  # "ngram" or "draft:PATH" (engine/draft.py build_proposer); None = off
    num_speculative_tokens: int = 4
    # None / "none" float, "auto" the checkpoint's own (GGUF blocks on CPU), "int8", "int4" (models/loading.py).
    quantization: str | None = None
    quantize_lm_head: bool | None = None  # None: as the checkpoint carries it
    tensor_parallel: int = 1  # processes the decoder is split over (engine/tensor_parallel.py)
    # A model group over several nodes, this process its leader (models/pipeline.py): pipeline stages across nodes,
    # `tensor_parallel` ranks on each. None: one node.
    node_group: NodeGroup | None = None
    activation_bits: int = 16  # of quantised weights' kernels: 16, or 8 (models/quant.py apply_activation_bits)
