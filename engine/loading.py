"""Building the decoder for an engine: device and dtype defaults, allocation straight on the device."""

from __future__ import annotations

import dataclasses
import logging

import torch

from omnivox.models.config import ModelConfig
from omnivox.models.decoder import DecoderModel

log = logging.getLogger(__name__)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "auto": None,
}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None/"auto": bfloat16 on CUDA, float32 elsewhere."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        return resolve_dtype(_DTYPES[dtype], device)
    return dtype


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    """The decoder with uninitialised weights, allocated directly on device in dtype (no float32 detour)."""
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = DecoderModel(cfg)
        finally:
            torch.set_default_dtype(prev)
    model.rotary.to(torch.float32)
    return model


def load_model(
    path,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int | None = None,
    progress: bool = False,
    quantization: str | None = None,
    quantize_lm_head: bool | None = None,
    tensor_parallel: int = 1,
    activation_bits: int = 16,
    node_group=None,
) -> DecoderModel:
    """The decoder of a checkpoint folder or .gguf with its weights, streamed tensor by tensor.

    quantization None / "none": float `dtype` (a GGUF dequantised); "auto": what the checkpoint carries (a GGUF's
    blocks at their own precision on CPU); "int8" / "int4": linear layers quantised at load (models/loading.py).
    tensor_parallel N > 1: rank 0's shard, with ranks 1..N-1 started in their own processes, each loading its own
    slice (engine/tensor_parallel.py); float weights only (int8/int4 refused, "auto" means float).
    activation_bits 16, or 8 for quantised weights (models/quant.py apply_activation_bits; refused before loading
    where the weights will be float)."""
    from pathlib import Path

    from omnivox.models.checkpoint import iter_checkpoint_tensors, load_hf_config
    from omnivox.models.config import NotApplicable
    from omnivox.models.quant import apply_activation_bits, check_activation_bits

    check_activation_bits(activation_bits, "quantization none is float" if quantization in (None, "none") else None)

    if tensor_parallel > 1 or node_group is not None:  # node_group: several nodes (models/pipeline.py)
        from omnivox.engine.tensor_parallel import start_tensor_parallel

        check_activation_bits(activation_bits, "tensor parallelism is float only")
        if quantization not in (None, "none", "auto"):  # "auto" loads float here: a GGUF's blocks are dequantised
            raise NotApplicable(
                "quantization", f"tensor parallelism needs float weights; quantization {quantization!r} is not sharded"
            )
        return start_tensor_parallel(path, tensor_parallel, device, dtype, max_model_len, nodes=node_group)
    hf_config = load_hf_config(path)
    if getattr(hf_config, "model_type", "") == "whisper":  # encoder-decoder: the encoder rides along (on rank 0)
        from omnivox.models.audio.whisper import build_whisper

        if quantization not in (None, "none", "auto"):
            raise NotApplicable(
                "quantization", f"quantization {quantization!r} is not supported for Whisper models (float only)"
            )
        check_activation_bits(activation_bits, "Whisper models are float only")
        model = build_whisper(hf_config, device, dtype, max_model_len)
        model.load_weights(iter_checkpoint_tensors(path))
        return model
    if getattr(hf_config, "model_type", "") == "csm":  # a backbone plus a depth decoder: frames, not tokens
        from omnivox.engine.frame_step import DepthSampling
        from omnivox.models.csm import build_csm

        if quantization not in (None, "none", "auto"):
            raise NotApplicable("quantization", f"quantization {quantization!r} is not supported for CSM (float only)")
        check_activation_bits(activation_bits, "CSM models are float only")
        model = build_csm(hf_config, device, dtype, max_model_len)
        model.load_weights(iter_checkpoint_tensors(path, part=None))
        model.depth_sampling = DepthSampling.from_folder(path)  # codebooks 1..N-1: the checkpoint's own settings
        return model
    if quantization == "auto" and not (Path(path).suffix == ".gguf" and device.type == "cpu"):
        quantization = None  # "auto" (the served default) is float but for a GGUF on CPU: the usual loader below
        check_activation_bits(activation_bits, "quantization auto is float for a checkpoint folder or off CPU")
    if quantization not in (None, "none"):
        from omnivox.models.loading import load_decoder

        mode = None if quantization == "auto" else quantization
        model = load_decoder(path, device, dtype, max_model_len, mode, quantize_lm_head, progress)
        apply_activation_bits(model, activation_bits)
        return model
    model = build_model(ModelConfig.from_hf(hf_config, max_model_len), device, dtype)
    tensors = iter_checkpoint_tensors(path)
    if progress:
        from tqdm import tqdm

        tensors = tqdm(tensors, desc=f"loading {Path(path).name}", unit=" tensors", leave=False)
    model.load_weights(tensors)
    return model


def cap_max_len(cfg: ModelConfig, n: int) -> ModelConfig:
    return dataclasses.replace(cfg, max_model_len=min(cfg.max_model_len, n))


# Share of the memory still free after the weights and the profiled activations that the KV cache takes, and what is
# kept back for the decode graphs' memory pool (captured after the cache exists). A second model served by the same
# process sizes its cache from what this one left free, so give each an explicit kv_cache_gib when serving several.
KV_MEMORY_FRACTION = 0.85
GRAPH_RESERVE_BYTES = 512 * 2**20


@torch.inference_mode()
def profile_activation_bytes(model: DecoderModel, num_tokens: int, num_logit_rows: int, block_size: int) -> int:
    """Peak memory of one step of `num_tokens` prefill tokens and `num_logit_rows` logits, beyond the weights (and
    beyond the scratch KV cache this profile run writes to): what vLLM's determine_available_memory measures."""
    from omnivox.models.attention import AttentionMetadata, PrefillChunk

    param = next(model.parameters())
    dev, cfg = param.device, model.config
    num_tokens = max(1, min(num_tokens, cfg.max_model_len))
    num_blocks = -(-num_tokens // block_size)
    shape = (num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape, dtype=param.dtype, device=dev),) * 2 for _ in range(cfg.num_layers)]
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    table = torch.arange(num_blocks, device=dev)
    meta = AttentionMetadata(
        block_size=block_size,
        slot_mapping=torch.arange(num_tokens, device=dev),
        num_decode=0,
        decode_block_tables=None,
        decode_mask=None,
        decode_lens=None,
        prefills=[PrefillChunk(0, num_tokens, num_tokens, table)],
    )
    ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
    extra = {}
    if getattr(model, "is_encoder_decoder", False):  # one request's cross K/V, as a served step reads it
        kv = torch.zeros(cfg.num_layers, 2, cfg.num_heads, model.encoder_len, cfg.head_dim, dtype=param.dtype)
        extra["cross"] = [(0, num_tokens, kv.to(dev))]
    hidden = model(ids, torch.arange(num_tokens, device=dev), caches, meta, **extra)
    model.compute_logits(hidden[: max(1, min(num_logit_rows, num_tokens))])
    if dev.type != "cuda":
        return 0
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del caches, hidden
    torch.cuda.empty_cache()
    return int(peak)


def kv_cache_gib_after_profile(model: DecoderModel, num_tokens: int, num_logit_rows: int, block_size: int) -> float:
    """The KV cache size for a CUDA model: a share of the memory free after a profiling step, less the graph pool,
    and never more than twice what `num_logit_rows` (max_num_seqs) full contexts hold: a small model on a large GPU
    took 118 GiB (31 M blocks of bookkeeping) it could never fill, and left nothing for a second model."""
    param = next(model.parameters())
    dev, cfg = param.device, model.config
    peak = profile_activation_bytes(model, num_tokens, num_logit_rows, block_size)
    free, total = torch.cuda.mem_get_info(dev)
    budget = KV_MEMORY_FRACTION * free - peak - GRAPH_RESERVE_BYTES
    useful = 2 * num_logit_rows * cfg.max_model_len * cfg.kv_bytes_per_token(param.element_size())
    gib = min(max(0.5 * 2**30, budget), useful) / 2**30
    log.info(
        "KV cache: %.2f GiB (free %.2f of %.2f GiB after weights, activation peak %.0f MiB for %d tokens)",
        gib,
        free / 2**30,
        total / 2**30,
        peak / 2**20,
        num_tokens,
    )
    return gib


def default_kv_gib(
    model: DecoderModel, max_num_batched_tokens: int | None, max_num_seqs: int, block_size: int
) -> float:
    """KV cache size when none is given: on CUDA sized after a profiling step (its activation peak) and leaving room
    for the decode graphs; 1 GiB on CPU."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        with torch.cuda.device(device):
            return kv_cache_gib_after_profile(model, max_num_batched_tokens or 2048, max_num_seqs, block_size)
    return 1.0


def size_kv_cache(
    model: DecoderModel,
    kv_cache_gib: float | None,
    max_num_batched_tokens: int | None,
    max_num_seqs: int,
    block_size: int,
) -> tuple[int, ModelConfig]:
    """The KV cache's number of blocks (`kv_cache_gib`, or `default_kv_gib` when None) and the model's config with its
    context capped to what those blocks hold: a request must always fit the pool alone (no endless preempt/recompute).
    When every layer slides, a request holds at most the blocks of one step's window plus its chunk (the blocks behind
    are released, engine/kv_manager.py), so the context is capped only by a pool smaller than that."""
    param = next(model.parameters())
    cfg = model.config
    if kv_cache_gib is None:
        kv_cache_gib = default_kv_gib(model, max_num_batched_tokens, max_num_seqs, block_size)
    bytes_per_block = cfg.kv_bytes_per_token(param.element_size()) * block_size
    num_blocks = int(kv_cache_gib * 2**30 // bytes_per_block)
    if num_blocks < 2:
        raise ValueError(f"kv_cache_gib={kv_cache_gib} holds {num_blocks} blocks of {block_size} tokens; need >= 2")
    capacity = num_blocks * block_size
    need = cfg.max_model_len
    if cfg.window_everywhere is not None and max_num_batched_tokens is not None:
        # A step's chunk of n tokens from position c reads keys from c - window + 1 on: blocks over window - 1 + n
        # positions, one more when unaligned.
        need = min(need, (-(-(cfg.window_everywhere - 1 + max_num_batched_tokens) // block_size) + 1) * block_size)
    if capacity < need:
        log.warning("KV cache holds %d tokens: context capped from %d", capacity, cfg.max_model_len)
        cfg = cap_max_len(cfg, capacity)
    return num_blocks, cfg
