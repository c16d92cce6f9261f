"""`load_decoder`: a checkpoint (folder or .gguf) into a DecoderModel, at float precision or quantised at load.

Linear layers are never materialised in float when they are to be quantised: the model is built on the meta device,
its projections are replaced by `_PendingLinear` collectors, and each checkpoint tensor is quantised as it arrives
(one float tensor in memory at a time). A GGUF's quantised tensors arrive as raw blocks (`GGUFBlocks`) and are served
at their own precision: Q4_0 / Q4_1 / Q4_K as 4-bit groups, Q8_0 / Q6_K as int8; other types are dequantised to
float as `iter_checkpoint_tensors` does. llama.cpp's Q/K row permutation is undone on rows of blocks, not values.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from omnivox.models import quant
from omnivox.models.checkpoint import iter_checkpoint_tensors, load_hf_config
from omnivox.models.config import ModelConfig
from omnivox.models.decoder import (
    PACKED_PROJECTIONS,
    DecoderModel,
    load_expert,
    make_rotaries,
    norm_value,
    split_fused_projections,
)
from omnivox.models.gguf_checkpoint import (
    GGUF_ARCHS,
    dequantize_gguf_tensors,
    gguf_name_map,
    gguf_tensor_parts,
    gguf_tensor_table,
)
from omnivox.models.layers import Linear, PackedLinear, RMSNorm
from omnivox.models.meta import meta_device
from omnivox.models.moe import FLOAT_ROUTERS, Experts, expert_tensor
from omnivox.models.moe_quant import PendingExperts

# GGML types served at their own precision (ggml_type ids from gguf.GGMLQuantizationType).
Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14
_INT4_TYPES = {Q4_0, Q4_1, Q4_K}
_INT8_TYPES = {Q8_0, Q6_K}


@dataclass
class GGUFBlocks:
    """One quantised GGUF matrix as stored: raw blocks [rows, bytes per row] (rows already un-permuted)."""

    ggml_type: int
    raw: np.ndarray  # uint8 [N, row_bytes]
    shape: tuple[int, ...]  # (N, K) of the float matrix; (E, N, K) of stacked experts

    def __getitem__(self, rows: slice | int) -> GGUFBlocks:
        """Some rows of the matrix, as blocks (Phi-3's fused qkv / gate_up are split at load by rows); of stacked
        experts (raw [E, N, row bytes]), an int picks one expert's matrix."""
        raw = self.raw[rows]
        return GGUFBlocks(self.ggml_type, raw, self.shape[1:] if isinstance(rows, int) else (len(raw), *self.shape[1:]))

    @property
    def native(self) -> str:
        """The precision it is served at: "int4" (Q4_0 / Q4_1 / Q4_K) or "int8" (Q8_0 / Q6_K)."""
        return "int4" if self.ggml_type in _INT4_TYPES else "int8"

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        import gguf

        w = gguf.quants.dequantize(self.raw, gguf.GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))

    def as_int8(self) -> torch.Tensor:
        """Q8_0 blocks uint8 [N, K / 32 * 34]: Q8_0 as is, other types requantised from their values per group of 32
        (Q6_K's 6-bit levels to 8 bits: ~0.3 % relative error)."""
        if self.ggml_type == Q8_0:
            return torch.from_numpy(np.array(self.raw, dtype=np.uint8, order="C")).view(self.shape[0], -1)
        return quant.quantize_q8(self.dequantize())

    def as_int4(self) -> torch.Tensor:
        """Q4_1 blocks uint8 [N, K / 32 * 20]: Q4_1 as is, Q4_0 with m = -8 d (exact), Q4_K regrouped from its values
        (exact when a group of 32 uses its lowest and highest level, else within half a level)."""
        n = self.shape[0]
        if self.ggml_type == Q4_1:
            return torch.from_numpy(np.array(self.raw, dtype=np.uint8, order="C")).view(n, -1)
        if self.ggml_type == Q4_0:
            b = torch.from_numpy(np.array(self.raw, dtype=np.uint8, order="C")).view(n, -1, 18)
            d = b[..., :2].contiguous().view(torch.float16)  # [N, G, 1]
            m = (d * -8).view(torch.uint8)
            return torch.cat([b[..., :2], m, b[..., 2:]], dim=-1).reshape(n, -1).contiguous()
        return quant.quantize_q4(self.dequantize())


def iter_gguf_blocks(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """Like `iter_checkpoint_tensors` for a .gguf, but matrices of the types served natively come as `GGUFBlocks`."""
    import gguf

    path = Path(path)
    arch, table = gguf_tensor_table(path)
    if arch not in GGUF_ARCHS:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})")
    processor, name_map = gguf_name_map(arch, load_hf_config(path))
    # Matrices, and a MoE layer's stacked experts [E, N, K] (each expert's N rows of blocks handed on as its own)
    native = {n for n, ggml_type, shape, _ in table if ggml_type in _INT4_TYPES | _INT8_TYPES and len(shape) in (2, 3)}
    offsets = _gguf_offsets(path)
    with open(path, "rb", buffering=0) as f:
        for gguf_name, ggml_type, shape, raw in table:
            if gguf_name in native and gguf_name in name_map:
                # Plain reads, not the memory map: mapped pages would stay resident (~the file size) while loading.
                blocks = _read_rows(f, *offsets[gguf_name], raw.shape) if offsets else np.asarray(raw)
                rows = processor.process(weights=blocks, name=gguf_name).weights  # permutes whole rows of blocks
                matrix = GGUFBlocks(ggml_type, rows, tuple(int(d) for d in shape))
                yield from gguf_tensor_parts(gguf_name, name_map[gguf_name], matrix)
    rest = [entry for entry in table if entry[0] not in native]
    yield from dequantize_gguf_tensors(path, rest, name_map, processor, gguf.quants.dequantize)


def _gguf_offsets(path: Path) -> dict[str, tuple[int, int]] | None:
    """{tensor name: (absolute offset, bytes)}, or None without transformers' header reader."""
    try:
        from transformers.integrations.gguf.reader import GgufHeader
    except ImportError:
        return None
    header = GgufHeader.from_file(str(path))
    return {t.name: (header.data_start + t.offset, t.nbytes) for t in header.tensors}


def _read_rows(f, offset: int, nbytes: int, shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(nbytes, dtype=np.uint8)
    f.seek(offset)
    view, done = memoryview(out), 0
    while done < nbytes:
        n = f.readinto(view[done:])
        if not n:
            raise ValueError(f"{f.name} is truncated")
        done += n
    return out.reshape(shape)


class _PendingLinear(nn.Module):
    """Collects the parts of one (packed) projection as they arrive; `build()` makes the final layer."""

    def __init__(self, in_features: int, parts: dict[str, int], has_bias: bool, mode: str | None) -> None:
        super().__init__()
        self.in_features, self.parts, self.has_bias = in_features, dict(parts), has_bias
        self.mode = mode  # "none" / "int8" / "int4"; None: each GGUF part's own precision
        self.weights: dict[str, object] = {}
        self.biases: dict[str, torch.Tensor] = {}

    def load_part(self, part: str, kind: str, value: torch.Tensor | GGUFBlocks) -> None:
        rows = self.parts[part]
        if kind == "bias":
            self.biases[part] = torch.as_tensor(value).float().reshape(rows)
            return
        shape = value.shape if isinstance(value, GGUFBlocks) else tuple(value.shape)
        if tuple(shape) != (rows, self.in_features):
            raise ValueError(f"{part}.weight: shape {tuple(shape)} does not fit ({rows}, {self.in_features})")
        if self.mode in ("int8", "int4") and not isinstance(value, GGUFBlocks):
            value = self._quantize(value.float(), self.mode)  # quantise now: rows are quantised independently
        self.weights[part] = value

    @staticmethod
    def _quantize(w: torch.Tensor, mode: str):
        return ("int8", quant.quantize_q8(w)) if mode == "int8" else ("int4", quant.quantize_q4(w))

    def missing(self) -> list[str]:
        out = [f"{p}.weight" for p in self.parts if p not in self.weights]
        return out + ([f"{p}.bias" for p in self.parts if p not in self.biases] if self.has_bias else [])

    def build(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        mode = self.mode or _native_mode(self.weights.values())
        bias = torch.cat([self.biases[p] for p in self.parts]) if self.has_bias else None
        if mode == "none":
            layer = PackedLinear(self.in_features, self.parts, self.has_bias).to(device=device, dtype=dtype)
            for p in self.parts:
                layer.load_part(p, "weight", _as_float(self.weights[p]))
                if bias is not None:
                    layer.load_part(p, "bias", self.biases[p])
            return layer
        items = []
        for p in self.parts:
            w = self.weights[p]
            if isinstance(w, GGUFBlocks):  # a GGUF part: mixed 4/8-bit parts go to the wider one
                w = ("int4", w.as_int4()) if mode == "int4" else ("int8", w.as_int8())
            items.append(w)
        bias = None if bias is None else bias.to(device)
        layer = quant.Int4Linear if mode == "int4" else quant.Int8Linear
        return layer(torch.cat([i[1] for i in items]).to(device), self.in_features, bias)


class _PendingOutput(nn.Module):
    """Receives the output matrix (lm_head, or a tied embedding) and keeps it as Q8_0 blocks: a GGUF's Q8_0 as is,
    anything else quantised 4096 rows at a time (never one float matrix of the whole vocabulary)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: torch.Tensor | None = None  # uint8 [V, H / 32 * 34]
        self.in_features = 0

    def load(self, value: torch.Tensor | GGUFBlocks) -> None:
        rows, self.in_features = value.shape[0], value.shape[1]
        if isinstance(value, GGUFBlocks) and value.ggml_type == Q8_0:
            self.blocks = value.as_int8()
            return
        parts = []
        for s in range(0, rows, 4096):
            if isinstance(value, GGUFBlocks):
                chunk = GGUFBlocks(value.ggml_type, value.raw[s : s + 4096], (min(4096, rows - s), value.shape[1]))
                parts.append(chunk.as_int8())
            else:
                parts.append(quant.quantize_q8(value[s : s + 4096]))
        self.blocks = torch.cat(parts)


def _native_mode(values) -> str:
    """A GGUF module's own precision: 4-bit if every part is, int8 if every part is int8 or 4-bit, else float."""
    types = {v.ggml_type if isinstance(v, GGUFBlocks) else -1 for v in values}
    if types <= _INT4_TYPES:
        return "int4"
    return "int8" if types <= _INT4_TYPES | _INT8_TYPES else "none"


def _as_float(w) -> torch.Tensor:
    if isinstance(w, GGUFBlocks):
        return w.dequantize()
    return w


def load_decoder(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    max_model_len: int | None = None,
    quantization: str | None = None,
    quantize_lm_head: bool | None = None,
    progress: bool = False,
) -> DecoderModel:
    """The decoder of the checkpoint folder or .gguf at `path`, its linear layers at the chosen precision.

    quantization: None = what the checkpoint carries (on CPU a GGUF at its own bit widths; a safetensors folder, or
    any checkpoint off CPU, in `dtype`);
    "none" = float `dtype` everywhere (GGUF dequantised); "int8" / "int4" = every decoder-layer projection.
    quantize_lm_head: the output projection as int8 (a tied embedding then reads the same int8 rows). None = as the
    checkpoint carries it: True for a GGUF whose output (or tied embedding) matrix is quantised, unless quantization
    is "none"; else False. Norms and untied embeddings stay in `dtype`.
    """
    path, device = Path(path), torch.device(device)
    if quantization is not None:
        quant.check_mode(quantization)
    is_gguf = path.is_file()
    cfg = ModelConfig.from_hf(load_hf_config(path), max_model_len)
    # A GGUF at its own precision by default, on CPU: off CPU the block layers dequantise in every matmul (correct,
    # not fast), so there the default stays float (bf16 on CUDA) and quantisation is asked for explicitly.
    native_default = is_gguf and device.type == "cpu"
    mode = quantization if (quantization is not None or native_default) else "none"
    if quantize_lm_head is None:
        quantize_lm_head = is_gguf and mode != "none" and _gguf_output_quantized(path, cfg.tie_word_embeddings)
    tensors = iter_gguf_blocks(path) if is_gguf and mode != "none" else iter_checkpoint_tensors(path)
    with meta_device():  # not torch.device("meta"): its init fills import torch._dynamo (~1 s)
        model = DecoderModel(cfg)
    pending: dict[str, _PendingLinear | PendingExperts] = {}
    if mode != "none":
        for name, module in list(model.layers.named_modules()):
            if isinstance(module, Experts):
                pending[f"layers.{name}"] = PendingExperts(module, mode)
                parent, _, attr = name.rpartition(".")
                setattr(model.layers.get_submodule(parent), attr, pending[f"layers.{name}"])
            elif isinstance(module, Linear | PackedLinear) and not name.endswith(FLOAT_ROUTERS):
                parts = module.parts if isinstance(module, PackedLinear) else {"": module.out_features}
                pending[f"layers.{name}"] = _PendingLinear(module.weight.shape[1], parts, module.bias is not None, mode)
                parent, _, attr = name.rpartition(".")
                setattr(model.layers.get_submodule(parent), attr, pending[f"layers.{name}"])
    output = _PendingOutput() if quantize_lm_head else None
    if output is not None:  # no float output matrix is ever allocated
        if cfg.tie_word_embeddings:
            model.embed_tokens = output
        else:
            model.lm_head = output
    model.to_empty(device=device)
    model.to(dtype)
    with torch.device(device):  # to_empty wiped the tables
        model.rotary, model.rotary_local = make_rotaries(cfg)
    if progress:
        from tqdm import tqdm

        tensors = tqdm(tensors, desc=f"loading {path.name}", unit=" tensors", leave=False)
    _load(model, pending, output, tensors, device, dtype)
    if pending:
        name, layer = next(iter(pending.items()))
        raise ValueError(
            f"checkpoint lacks tensors of {len(pending)} layers, e.g. {name}: {', '.join(layer.missing())}"
        )
    if output is not None:
        if output.blocks is None:
            raise ValueError("checkpoint lacks the output projection (lm_head.weight or a tied embedding)")
        model.lm_head = quant.Int8Linear(output.blocks.to(device), output.in_features, None)
        if cfg.tie_word_embeddings:
            model.embed_tokens = quant.Int8Embedding(model.lm_head, dtype)
    return model


def _gguf_output_quantized(path: Path, tied: bool) -> bool:
    types = {name: ggml_type for name, ggml_type, _, _ in gguf_tensor_table(path)[1]}
    ggml_type = types.get(
        "output.weight", types.get("token_embd.weight") if tied or "output.weight" not in types else 0
    )
    return ggml_type not in (0, 1, 30, None)  # F32, F16, BF16


def _load(
    model: DecoderModel,
    pending: dict[str, _PendingLinear | PendingExperts],
    output: _PendingOutput | None,
    tensors,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Route checkpoint tensors to parameters, pending layers (built as soon as complete) or the pending output;
    fail on missing tensors (the caller checks the layers still pending)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    tied = model.config.tie_word_embeddings
    for name, value in split_fused_projections(model.config, tensors):
        ours = name.removeprefix("model.")
        if "rotary_emb" in ours:
            continue
        if output is not None and ours == ("embed_tokens.weight" if tied else "lm_head.weight"):
            output.load(value)
            continue
        if ours == "lm_head.weight" and tied:
            continue  # tied: the embedding serves as the output projection
        expert = expert_tensor(ours)
        if expert is not None and expert[0] in pending:  # one expert's matrix, quantised as it arrives
            module, part, kind = expert[0], (expert[1], expert[2]), "expert"
        elif load_expert(model, ours, _as_float(value)):
            loaded.add(ours)
            continue
        else:
            parts = ours.split(".")
            module, part, kind = ".".join(parts[:-1]), "", parts[-1]
            if len(parts) >= 2 and parts[-2] in PACKED_PROJECTIONS:
                packed, part = PACKED_PROJECTIONS[parts[-2]]
                module = ".".join(parts[:-2] + [packed])
        if module in pending:
            layer = pending[module]
            layer.load_part(part, kind, value)
            if not layer.missing():  # build now: the raw parts are freed before the next layer's arrive
                parent, _, attr = module.rpartition(".")
                setattr(model.get_submodule(parent), attr, layer.build(device, dtype))
                del pending[module]
            continue
        if module and isinstance(model.get_submodule(module), PackedLinear):
            model.get_submodule(module).load_part(part, kind, _as_float(value))
            loaded.add(f"{module}.{part}.{kind}")
            continue
        if ours not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the {model.config.family} model")
        tensor = _as_float(value)
        if isinstance(model.get_submodule(module), RMSNorm):
            tensor = norm_value(model.config, tensor)
        if params[ours].shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(params[ours].shape)}"
            )
        with torch.no_grad():
            params[ours].copy_(tensor)
        loaded.add(ours)
    missing = []
    for pname in params:
        mod_name, _, kind = pname.rpartition(".")
        mod = model.get_submodule(mod_name)
        if isinstance(mod, PackedLinear):
            missing += [f"{mod_name}.{p}.{kind}" for p in mod.parts if f"{mod_name}.{p}.{kind}" not in loaded]
        elif isinstance(mod, Experts) and pname not in loaded:  # stacked whole, or expert by expert
            missing += mod.missing(mod_name, kind)
        elif pname not in loaded:
            missing.append(pname)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")
