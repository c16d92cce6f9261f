"""GGUF checkpoint files: tensors dequantized one at a time, and the config and tokenizer in their metadata.

GGUF files are dequantized tensor by tensor to float32 (the caller casts to its dtype). The facts about GGUF (name map,
llama.cpp's Q/K row permutation for Llama) come from transformers' GGUF utilities; the tensors themselves are never
materialised all at once (which `load_gguf_checkpoint(return_tensors=True)` would do).

Config and tokenizer of a GGUF file are parsed from its metadata once (~10 s for a 49k-token vocabulary) and cached as
ordinary `save_pretrained` folders under the omnivox cache, keyed by file name, size, mtime and transformers version.

models/checkpoint.py is the entry point (`iter_checkpoint_tensors`, `load_hf_config`, `load_tokenizer`): it hands
`.gguf` paths to this module; models/gguf_config.py completes the config transformers reads from the metadata.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import transformers

from omnivox.native.cache import build_cached, omnivox_cache_dir

from .gguf_config import mixtral_config, patch_gguf_config

logger = logging.getLogger(__name__)

GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen2moe", "qwen3moe")
# llama.cpp stores a MoE layer's experts stacked: blk.N.ffn_{gate,up}_exps [E, I, H] and ffn_down_exps [E, H, I] (torch
# order); they are handed on expert by expert under transformers' per-expert names, which every loader takes.
_STACKED_EXPERTS = re.compile(r"^blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|down)_exps\.weight$")


def load_gguf_config(path: Path) -> transformers.PretrainedConfig:
    """The transformers config of the `.gguf` file at `path` (parsed from its metadata once, then cached). A GGUF of
    an architecture we do not read is refused here, before any model is allocated for it."""
    _check_gguf_file(path)
    arch = _read_gguf_metadata(path).get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})")
    cached = _gguf_cache_dir(path) / "config"
    if (cached / "config.json").is_file():
        config = transformers.AutoConfig.from_pretrained(cached)
    else:
        config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if arch == "llama" and _read_gguf_metadata(path).get("llama.expert_count"):
            config = mixtral_config(config, _read_gguf_metadata(path))
        patch_gguf_config(config, _read_gguf_metadata(path), path, lambda: gguf_tensor_table(path)[1])
        _save_atomically(cached, config.save_pretrained, "config.json")
    config.name_or_path = str(path)
    return config


def load_gguf_tokenizer(path: Path) -> transformers.PreTrainedTokenizerBase | None:
    """The tokenizer of the `.gguf` file at `path` (parsed once, then cached), or None when it carries none."""
    _check_gguf_file(path)
    cached = _gguf_cache_dir(path) / "tokenizer"
    if (cached / "tokenizer_config.json").is_file():
        tokenizer = transformers.AutoTokenizer.from_pretrained(cached)
    elif "tokenizer.ggml.model" not in _read_gguf_metadata(path):
        return None
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        _save_atomically(cached, tokenizer.save_pretrained, "tokenizer_config.json")
    tokenizer.name_or_path = str(path)
    return tokenizer


def _check_gguf_file(path: Path) -> None:
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"checkpoint file {path} is not a .gguf file; pass a checkpoint folder or a .gguf file")


def _read_gguf_metadata(path: Path) -> dict:
    """The GGUF key/value metadata (string arrays such as the vocabulary are given as their lengths)."""
    try:  # transformers' own header reader: ~30 ms, against seconds for gguf.GGUFReader on a 49k vocabulary
        from transformers.integrations.gguf.reader import read_gguf_metadata
    except ImportError:
        import gguf

        reader = gguf.GGUFReader(path)
        return {key: field.contents() for key, field in reader.fields.items()}
    metadata, _ = read_gguf_metadata(str(path))
    return metadata


class _GGUFBytes:
    """One tensor's raw bytes in a GGUF file, read with plain reads when asked for (`np.asarray`).

    Not memory-mapped: pages of a mapped file count in the process's resident memory until it is unmapped, so
    dequantizing an F32 GGUF out of a map of the whole file peaked at 2.04x the weights; read tensor by tensor, under
    1.5x (tests/models/test_gguf_loading.py).
    """

    def __init__(self, path: Path, offset: int, shape: tuple[int, ...]) -> None:
        self.path, self.offset, self.shape = path, offset, shape
        self.nbytes = int(np.prod(shape, dtype=np.int64))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.empty(self.shape, dtype=np.uint8)
        view, done = memoryview(out.reshape(-1)), 0
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.offset)
            while done < self.nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError(f"{self.path} is truncated")
                done += n
        return out if dtype is None else out.astype(dtype)

    def __getitem__(self, index: int) -> _GGUFBytes:
        """Item `index` of the first axis (a stacked tensor's expert), unread: a GGUF tensor's rows are contiguous."""
        if not 0 <= index < self.shape[0]:
            raise IndexError(f"index {index} out of range for {self.shape[0]} items")
        item = int(np.prod(self.shape[1:], dtype=np.int64))
        return _GGUFBytes(self.path, self.offset + index * item, self.shape[1:])


def gguf_tensor_table(path: Path) -> tuple[str, list[tuple[str, int, tuple[int, ...], np.ndarray | _GGUFBytes]]]:
    """(architecture, [(gguf_name, ggml_type, torch shape, raw bytes)]) of a GGUF file.

    The raw bytes have shape (*shape[:-1], bytes per row), which is what `gguf.quants.dequantize` takes; they are
    read when `np.asarray` asks (a memory map only on the fallback reader for transformers without GgufHeader).
    """
    import gguf

    try:
        from transformers.integrations.gguf.reader import GgufHeader
    except ImportError:
        reader = gguf.GGUFReader(path)
        arch = reader.fields["general.architecture"].contents()
        table = [(t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)), t.data) for t in reader.tensors]
        return arch, table
    header = GgufHeader.from_file(str(path))
    size = path.stat().st_size
    table = []
    for info in header.tensors:
        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)]
        row_bytes = info.shape[-1] // block_size * type_size
        start = header.data_start + info.offset
        raw = _GGUFBytes(path, start, (*info.shape[:-1], row_bytes))
        if raw.nbytes != info.nbytes or start + info.nbytes > size:
            raise ValueError(f"{path}: tensor {info.name} has inconsistent size or offset (truncated file?)")
        table.append((info.name, info.ggml_type, info.shape, raw))
    return header.architecture, table


def iter_gguf(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    arch, table = gguf_tensor_table(path)
    if arch not in GGUF_ARCHS:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})")
    processor, name_map = gguf_name_map(arch, load_gguf_config(path))
    return dequantize_gguf_tensors(path, table, name_map, processor, gguf.quants.dequantize)


def gguf_name_map(arch: str, config: transformers.PretrainedConfig):
    """(tensor processor, {GGUF tensor name: transformers parameter name}) for a GGUF of `arch` read as `config`.

    transformers' map, except for MoE layers: its stacked-expert entries (`blk.N.ffn_gate_exps` without `.weight`,
    for transformers' own loader) are replaced by `blk.N.ffn_gate_exps.weight` -> `model.layers.N.mlp.experts`, which
    `gguf_tensor_parts` splits expert by expert, and the older per-expert `blk.N.ffn_gate.E.weight`. Mixtral is arch
    llama in a GGUF (llama.cpp's names, Q/K permuted).
    """
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    heads = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}
    # transformers' Qwen2-MoE processor stacks experts into its loader's dict; ours splits them (gguf_tensor_parts)
    processor_cls = TensorProcessor if arch.endswith("moe") else TENSOR_PROCESSORS.get(arch, TensorProcessor)
    processor = processor_cls(config=heads)
    model_type = "llama" if config.model_type == "mixtral" else None
    name_map = get_gguf_hf_weights_map(ParameterNames(config), processor, model_type=model_type)
    name_map = {g: h for g, h in name_map.items() if not g.endswith(("_exps", "_exps.weight"))}
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    for layer in range(config.num_hidden_layers) if experts else ():
        for proj in ("gate", "up", "down"):
            name_map[f"blk.{layer}.ffn_{proj}_exps.weight"] = f"model.layers.{layer}.mlp.experts"
            # Mixtral files converted before llama.cpp stacked experts (spring 2024, e.g. TheBloke's): one per expert
            for e in range(experts):
                name_map[f"blk.{layer}.ffn_{proj}.{e}.weight"] = (
                    f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"
                )
    return processor, name_map


def gguf_tensor_parts(gguf_name: str, hf_name: str, tensor):
    """The transformers tensors one GGUF tensor holds: a stacked experts tensor [E, ...] as E per-expert matrices
    (`model.layers.N.mlp.experts.E.gate_proj.weight`, each a view: a torch tensor or rows of raw blocks); Qwen2-MoE's
    shared-expert gate, a vector [H] in llama.cpp's files, as transformers' [1, H]; anything else as it is."""
    m = _STACKED_EXPERTS.match(gguf_name)
    if m is not None:
        return [(f"{hf_name}.{e}.{m['proj']}_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    if gguf_name.endswith(".ffn_gate_inp_shexp.weight") and len(tensor.shape) == 1:
        return [(hf_name, tensor.reshape(1, -1))]
    return [(hf_name, tensor)]


class ParameterNames:
    """What `get_gguf_hf_weights_map` reads of a model: its config and parameter names, without submodules.

    Passing the real model makes transformers rebuild gguf's name table once per submodule (seconds for 30 layers);
    for decoder-only llama/qwen2/qwen3 the top level already maps every parameter.
    """

    def __init__(self, config: transformers.PretrainedConfig):
        self.config = config
        self._names = dict.fromkeys(_parameter_names(config))

    def state_dict(self) -> dict[str, None]:
        return self._names

    def named_children(self) -> Iterator[tuple[str, object]]:
        return iter(())


def dequantize_gguf_tensors(path, table, name_map, processor, dequantize) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, float32 tensor) of each mapped tensor in `table`, one tensor in memory at a time.

    A stacked experts tensor [E, rows, cols] is read and dequantized one expert at a time (expert e's rows are one
    contiguous byte range), so the float32 temporary is one expert matrix, not the stack (~0.8 GB per tensor for a
    Qwen3-30B-A3B in F16; tests/models/test_gguf_loading.py's MoE peak-memory case)."""
    import gguf

    for gguf_name, ggml_type, shape, raw in table:
        if gguf_name not in name_map:
            # e.g. llama.cpp's precomputed `rope_freqs.weight`: derived from the config, not a parameter.
            logger.debug("%s: skipping GGUF tensor %s (no transformers parameter)", path, gguf_name)
            continue
        qtype = gguf.GGMLQuantizationType(ggml_type)
        if _STACKED_EXPERTS.match(gguf_name) is not None and len(shape) == 3:
            for hf_name, rows in gguf_tensor_parts(gguf_name, name_map[gguf_name], raw):
                yield hf_name, _dequantized(path, gguf_name, rows, qtype, tuple(shape[1:]), processor, dequantize)
            continue
        tensor = _dequantized(path, gguf_name, raw, qtype, tuple(shape), processor, dequantize)
        yield from gguf_tensor_parts(gguf_name, name_map[gguf_name], tensor)


def _dequantized(path, gguf_name: str, raw, qtype, shape: tuple[int, ...], processor, dequantize) -> torch.Tensor:
    """The float32 tensor of `raw` (blocks read when asked for), llama.cpp's Q/K permutation undone."""
    weights = dequantize(np.asarray(raw), qtype)  # (*shape) float32
    weights = processor.process(weights=weights, name=gguf_name).weights  # undoes llama.cpp's Q/K permutation
    if not weights.flags.writeable or not weights.flags.c_contiguous:  # still a view of the mapped file
        weights = np.array(weights, copy=True, order="C")
    tensor = torch.from_numpy(weights.astype(np.float32, copy=False))
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{path}: tensor {gguf_name} dequantized to {tuple(tensor.shape)}, expected {shape}")
    return tensor


def _parameter_names(config: transformers.PretrainedConfig) -> list[str]:
    """The state_dict names of transformers' causal LM for `config`, cached by the config's content: building the
    model, even on the meta device, imports its modeling module, whose masking utilities import torch._dynamo
    (~1.5 s of every start that serves a GGUF, the embedded default's included)."""
    text = config.to_json_string(use_diff=False)
    key = hashlib.sha256(text.encode()).hexdigest()[:32]
    target = omnivox_cache_dir() / "gguf-meta" / f"names-tf{transformers.__version__}-{key}.json"
    try:
        return json.loads(target.read_text())
    except (OSError, ValueError):  # not cached yet (or unreadable): build it
        pass
    with torch.device("meta"):  # parameter names without allocating the weights
        model = transformers.AutoModelForCausalLM.from_config(config)
    names = list(model.state_dict())
    try:
        build_cached(target, lambda staged: staged.write_text(json.dumps(names)), Path.is_file)
    except OSError as e:
        logger.warning("cannot cache GGUF parameter names in %s: %s", target.parent, e)
    return names


_GGUF_META_VERSION = 1  # bump when what we derive from GGUF metadata changes, so old cache entries are not reused


def _gguf_cache_dir(path: Path) -> Path:
    """Where the config and tokenizer parsed from a GGUF file are cached."""
    stat = path.stat()
    key = f"{path.name}-{stat.st_size}-{stat.st_mtime_ns}-tf{transformers.__version__}-v{_GGUF_META_VERSION}"
    return omnivox_cache_dir() / "gguf-meta" / key


def _save_atomically(target: Path, save, marker: str) -> None:
    """Cache `save(folder)` at `target` through the one locked, atomic cache build (native/cache.py).

    A read-only cache is not an error: the caller already holds what it parsed and works without the cache.
    """
    try:
        build_cached(target, save, lambda t: (t / marker).is_file())
    except OSError as e:
        logger.warning("cannot cache GGUF metadata in %s: %s", target.parent, e)
