"""Decode steps of the Llama-family decoder layers in one C call on CPU (`decoder_layers_f32` in cpu_kernels.c).

Why: at native precision a batch-1 SmolLM2-135M step was ~17 ms, of which the quantised matmuls took ~8 ms and the
rest was ~100 small torch ops per layer (norms, RoPE, slicing, KV writes, SiLU, residual adds: 2-10 us each) and four
ctypes calls per layer. One call per step does the same arithmetic with the same kernels and none of that overhead.

It serves steps of fewer than `quant.LARGE_BATCH` rows (decode rows, and small prefill chunks such as speculative
verify rows, each row attending up to its own token; no FlexAttention mask) on CPU in float32 without autograd, for models whose layers are exactly models/decoder.py's (subclasses such as tensor-parallel
layers take the torch path), and only while the rows fit the layers' kernels: quantised block layers below
`quant.LARGE_BATCH` rows (from there a layer is dequantised for GEMM), float32 layers at one row (the GEMV kernel).
Where a many-row kernel (VNNI or AVX2) serves every layer, it serves up to MANY_MAX_ROWS rows: mixed steps of
decodes and a prompt chunk.
The MLP gate is SiLU or (Gemma 1) GELU with the tanh approximation; Gemma 2 / 3 (sandwich norms, soft caps, local
RoPE) take the torch path. The torch path stays the reference: tests/models/test_fused_decode.py checks both agree.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from omnivox.models import cpu_kernels, quant
from omnivox.models.attention import AttentionMetadata
from omnivox.models.layers import Linear, PackedLinear, RMSNorm

_FLOAT, _Q8, _Q4 = 0, 1, 2
_ACTS = {"silu": 0, "gelu_tanh": 1}  # MLP.act -> fused_layer.act (cpu_kernels.c); others take the torch path

# Bumped whenever any module anywhere registers a submodule, parameter or buffer (quantize_decoder, sharding, a
# `setattr` of a layer): a table built before then is re-checked against the modules. Walking the modules on every
# step cost 0.4 ms of a ~10 ms step; this check costs a comparison.
_generation = 0


def _bump(*_args) -> None:
    global _generation
    _generation += 1


torch.nn.modules.module.register_module_module_registration_hook(_bump)
torch.nn.modules.module.register_module_parameter_registration_hook(_bump)
torch.nn.modules.module.register_module_buffer_registration_hook(_bump)
MAX_ROWS = quant.LARGE_BATCH - 1  # from LARGE_BATCH rows block layers dequantise for float GEMM ...
# ... unless a many-row kernel serves every layer (the VNNI or AVX2 build, quantised weights): then the torch path
# runs the same kernel at any rows, and the C step serves mixed steps (decodes beside a prefill chunk) up to this.
# Measured on the AVX2 build (emulated on an AVX-512 host: MKL/ATen/oneDNN limited to AVX2, x86-64-v3 kernels),
# SmolLM2-135M Q4_1, one thread, one process alternating the two bounds (median of 3, load 5.6-6.7, shared): 16
# decodes + 64 prompt tokens 502 -> 394 ms, 16 + 112 688 -> 687 ms, 128 prompt tokens alone 698 -> 668 ms (the
# torch path's ~100 small ops per layer cost ~85 ms of an 80-row step). 128: the CPU engine's default step tokens.
MANY_MAX_ROWS = 128


class _FusedLinear(ctypes.Structure):
    _fields_ = [
        ("w", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("kind", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("many_passes", ctypes.c_int64),
        ("many_min_rows", ctypes.c_int64),
    ]


class _FusedLayer(ctypes.Structure):
    _fields_ = [
        ("qkv", _FusedLinear),
        ("o", _FusedLinear),
        ("gate_up", _FusedLinear),
        ("down", _FusedLinear),
        ("in_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("window", ctypes.c_int64),  # sliding window (0: none)
        ("act", ctypes.c_int64),  # MLP gate activation (_ACTS)
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear(module: nn.Module) -> tuple[_FusedLinear, bool] | None:
    """(the C description, whether it is a quantised block layer) or None when the layer has no fused kernel."""
    if type(module) in (quant.Int8Linear, quant.Int4Linear):
        if module.padded_in != module.in_features or module.blocks.device.type != "cpu":
            return None
        kind = _Q8 if module.kind == "q8" else _Q4
        many = cpu_kernels.many_row_kernel()  # the C step picks VNNI where built, else the AVX2 kernel
        start = quant.MANY_MIN_ROWS[many][module.kind] if many else None
        entry = _FusedLinear(module.blocks.data_ptr(), _ptr(module.bias), kind, module.out_features, module.in_features)
        entry.many_passes = 0 if start is None else (1 if module.act_bits == 8 else 2)
        entry.many_min_rows = start or 0
        return entry, True
    if type(module) in (Linear, PackedLinear):
        w = module.weight
        if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
            return None
        bias = module.bias
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            return None
        return _FusedLinear(w.data_ptr(), _ptr(bias), _FLOAT, w.shape[0], w.shape[1]), False
    return None


def _norm(module: nn.Module | None) -> bool:
    return module is None or (type(module) is RMSNorm and module.weight.dtype == torch.float32)


class FusedDecode:
    """The C description of a model's layers, with the modules it was built from (to notice when they change)."""

    def __init__(self, layers: nn.ModuleList, layer_types: tuple[type, type, type]) -> None:
        """`layer_types`: the (layer, attention, MLP) classes the C step computes (models/decoder.py
        DecoderModel.fused_layer_types); a layer of another class makes it not apply."""
        self.layer_types = layer_types
        self.generation = _generation
        self.modules = self._modules_of(layers)
        self.tensors = [t for m in layers for t in m.parameters()] + [t for m in layers for t in m.buffers()]
        self.pointers = self._pointers()
        self.table = (_FusedLayer * len(layers))()
        self.quantised = False
        self.has_float = False
        self.all_many = True  # every layer has a many-row kernel (set per layer in _describe)
        self.ok = True
        self.cache_ptrs: tuple[int, ...] = ()
        for i, layer in enumerate(layers):
            if not self._describe(layer, self.table[i]):
                self.ok = False
                return

    @staticmethod
    def _modules_of(layers: nn.ModuleList) -> tuple[nn.Module, ...]:
        out: list[nn.Module] = []
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            out += [layer, a, m, a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj]
        return tuple(out)

    def _pointers(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.tensors)

    def _describe(self, layer: nn.Module, entry: _FusedLayer) -> bool:
        layer_type, attention_type, mlp_type = self.layer_types
        if (
            type(layer) is not layer_type
            or type(layer.self_attn) is not attention_type
            or type(layer.mlp) is not mlp_type
        ):
            return False  # Gemma 3's SandwichDecoderLayer among them
        attn, mlp = layer.self_attn, layer.mlp
        if attn.partial_rotary or attn.local_rope or attn.softcap or mlp.act not in _ACTS:  # the C step has none
            return False
        norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
        if not all(_norm(n) for n in norms) or layer.input_layernorm is None:
            return False
        parts = [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(p is None for p in parts):
            return False
        entry.qkv, entry.o, entry.gate_up, entry.down = (p[0] for p in parts)
        self.all_many &= all(p[1] and p[0].many_passes > 0 for p in parts)
        self.quantised |= any(p[1] for p in parts)
        self.has_float |= not all(p[1] for p in parts)
        entry.in_norm = layer.input_layernorm.weight.data_ptr()
        entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
        entry.q_norm = None if attn.q_norm is None else attn.q_norm.weight.data_ptr()
        entry.k_norm = None if attn.k_norm is None else attn.k_norm.weight.data_ptr()
        entry.num_heads, entry.num_kv_heads = attn.num_heads, attn.num_kv_heads
        entry.scale, entry.eps = attn.scale, layer.input_layernorm.eps
        entry.window = attn.window or 0
        entry.act = _ACTS[mlp.act]
        return True

    def current(self, layers: nn.ModuleList) -> bool:
        """Whether the layers are still the modules and tensors this table points at (quantize_decoder and sharding
        replace modules; `model.to(...)` swaps a parameter's storage under the same module)."""
        if self.generation != _generation:  # something was registered somewhere: are these layers still ours?
            if len(self.modules) != 7 * len(layers) or self.modules != self._modules_of(layers):
                return False
            self.generation = _generation
        return self.pointers == self._pointers()

    @property
    def max_rows(self) -> int:
        """The most rows the C step serves: MANY_MAX_ROWS where a many-row kernel serves every layer, else MAX_ROWS."""
        return MANY_MAX_ROWS if self.all_many and not self.has_float else MAX_ROWS

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        rows = x.shape[0]
        return (
            self.ok
            and rows > 0
            and _rows_in_order(meta, rows)
            and not any(c.bidirectional for c in meta.prefills)  # the C step masks causally only
            and meta.decode_block_mask is None
            and meta.slot_mapping.dtype == torch.int64
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and (rows == 1 or not self.has_float)
            and rows <= self.max_rows
            and not torch.is_grad_enabled()
            and cpu_kernels.kernel_available()
        )

    def __call__(
        self,
        x: torch.Tensor,  # [M, H] embeddings of the M decode tokens
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [M, 1, D]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [slots, KVH, D] float32
        meta: AttentionMetadata,
        intermediate_size: int,
    ) -> torch.Tensor:  # [M, H] the residual stream after the last layer (before the final norm)
        ptrs = tuple(t.data_ptr() for kv in kv_caches for t in kv)
        if ptrs != self.cache_ptrs:
            for i, (k, v) in enumerate(kv_caches):
                if k.dtype != torch.float32 or not (k.is_contiguous() and v.is_contiguous()):
                    raise ValueError("fused decode needs contiguous float32 KV caches")
                self.table[i].k_cache, self.table[i].v_cache = k.data_ptr(), v.data_ptr()
            self.cache_ptrs = ptrs
        x = x.contiguous().clone()
        cos, sin = rope[0].reshape(x.shape[0], -1).contiguous(), rope[1].reshape(x.shape[0], -1).contiguous()
        slots = meta.slot_mapping.contiguous()
        tables, lens = _row_tables(meta)
        cpu_kernels.decoder_layers(
            self.table, len(kv_caches), x, cos, sin, slots, tables, lens, intermediate_size, meta.block_size
        )
        return x


def _rows_in_order(meta: AttentionMetadata, rows: int) -> bool:
    """Decode rows first, then prefill chunks back to back, covering every row (as the runner lays a step out)."""
    if meta.num_decode and (meta.decode_block_tables is None or meta.decode_lens is None):
        return False
    row = meta.num_decode
    for chunk in meta.prefills:
        if chunk.query_start != row:
            return False
        row += chunk.num_tokens
    return row == rows


def _row_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Block table [M, W] int64 and context length [M] of every row. A prefill chunk's row j (small chunks only:
    speculative verify rows, short prompts) attends like a decode row whose context ends at its own token, which is
    the chunk's causal mask; every row's K/V is written before any row attends, as in the torch path."""
    if not meta.prefills:
        return meta.decode_block_tables.contiguous(), meta.decode_lens.contiguous()
    tables: list[torch.Tensor] = list(meta.decode_block_tables) if meta.num_decode else []
    lens = [meta.decode_lens] if meta.num_decode else []
    for chunk in meta.prefills:
        tables += [chunk.block_table] * chunk.num_tokens
        lens.append(torch.arange(chunk.context_len - chunk.num_tokens + 1, chunk.context_len + 1))
    table = torch.nn.utils.rnn.pad_sequence([t.long() for t in tables], batch_first=True)
    return table, torch.cat(lens).long()


def fused_decode_for(model: nn.Module) -> FusedDecode | None:
    """The model's FusedDecode (built on first use, rebuilt when its layers were replaced), or None if it has none."""
    fused = getattr(model, "_fused_decode", None)
    if fused is None or not fused.current(model.layers):
        fused = FusedDecode(model.layers, model.fused_layer_types)
        model._fused_decode = fused  # a plain attribute: not a module, not in the state dict
    return fused if fused.ok else None
