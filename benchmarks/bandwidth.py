"""The physical floor of batch-1 decode: every step reads every weight once, so ITL >= bytes read / bandwidth.

Bandwidth is measured here, in the same run, as a large matrix-vector product in the model's dtype (the same kind of
work a decode step does), with torch's default threads; the matrix is much larger than the last-level cache.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Bandwidth:
    dtype: str
    matrix_bytes: int
    seconds_per_pass: float  # best of the timed passes
    gb_per_s: float  # 1e9 bytes / s

    def to_dict(self) -> dict:
        return asdict(self)


def measure_bandwidth(dtype: torch.dtype, matrix_mib: int = 512, repeats: int = 10, device: str = "cpu") -> Bandwidth:
    """Best-of-`repeats` read bandwidth of `y = W @ x` with W of about `matrix_mib` MiB in `dtype`."""
    elem = torch.empty((), dtype=dtype).element_size()
    cols = 4096
    rows = max(1, matrix_mib * 2**20 // (cols * elem))
    w = torch.randn(rows, cols, device=device).to(dtype)
    x = torch.randn(cols, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with torch.inference_mode():
        torch.mv(w, x)  # warm up (page faults, thread pool)
        best = float("inf")
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            torch.mv(w, x)
            sync()
            best = min(best, time.perf_counter() - t0)
    nbytes = w.numel() * elem
    return Bandwidth(str(dtype).removeprefix("torch."), nbytes, best, nbytes / best / 1e9)


def weight_bytes_per_step(config, dtype_bytes: int) -> int:
    """Bytes of weights one decode step reads, for a Llama/Qwen2/Qwen3-style decoder config (a transformers config).

    Every linear layer and norm of every layer, the final norm, and the lm_head. The embedding lookup reads one row
    per token (~nothing); with tied embeddings the lm_head *is* the embedding matrix and is counted once, as lm_head.
    A mixture-of-experts layer (Qwen3-MoE, Mixtral, Qwen2-MoE) reads its router, its top_k experts (and Qwen2-MoE's
    shared expert and its gate), not every expert: a batch-1 step's floor is set by the active weights.
    """
    from omnivox.models.config import ModelConfig

    moe = ModelConfig.from_hf(config).moe
    h = config.hidden_size
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or h // n_heads
    inter = config.intermediate_size
    q, kv, o = n_heads * head_dim, n_kv * head_dim, n_heads * head_dim
    per_layer = h * q + 2 * h * kv + o * h + 2 * h  # q k v o, two norms
    if config.model_type in ("qwen2", "qwen2_moe"):
        per_layer += q + 2 * kv  # q/k/v biases
    if config.model_type in ("qwen3", "qwen3_moe"):
        per_layer += 2 * head_dim  # q_norm, k_norm
    layers = config.num_hidden_layers
    sparse = len(moe.sparse_layers) if moe is not None else 0
    mlp = (layers - sparse) * 3 * h * inter  # dense gate up down
    if moe is not None:  # router + the chosen experts (+ the shared expert and its gate)
        shared = 3 * h * moe.shared_expert_intermediate_size + h if moe.shared_expert_intermediate_size else 0
        mlp += sparse * (h * moe.num_experts + moe.top_k * 3 * h * moe.expert_intermediate_size + shared)
    params = layers * per_layer + mlp + h + config.vocab_size * h  # + final norm + lm_head
    return params * dtype_bytes


def kv_bytes_per_step(config, context_tokens: int, dtype_bytes: int) -> int:
    """Bytes of KV cache one decode step of one sequence reads at `context_tokens` of context."""
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return 2 * config.num_hidden_layers * n_kv * head_dim * context_tokens * dtype_bytes


@dataclass(frozen=True)
class MatmulRate:
    dtype: str
    size: int
    seconds_per_pass: float
    gflop_per_s: float  # 1e9 floating-point operations / s (a multiply-add counts 2)

    def to_dict(self) -> dict:
        return asdict(self)


def measure_matmul(dtype: torch.dtype, size: int = 1024, repeats: int = 5, device: str = "cpu") -> MatmulRate:
    """Best-of-`repeats` rate of a square `size` matmul in `dtype`: the compute roof that batched decode and prefill
    approach once the weights are amortised over many tokens."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with torch.inference_mode():
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            torch.mm(a, b)
            sync()
            best = min(best, time.perf_counter() - t0)
    return MatmulRate(str(dtype).removeprefix("torch."), size, best, 2 * size**3 / best / 1e9)
