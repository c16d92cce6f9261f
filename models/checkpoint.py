"""Reading decoder checkpoints one tensor at a time: safetensors folders, PyTorch `.bin` folders and GGUF files.

Every reader yields `(hf_name, tensor)` pairs with transformers' parameter names (`model.layers.0.self_attn.q_proj.weight`),
so the decoder's `load_weights` sees one naming scheme whatever the file format. Only one tensor is materialised at a
time, so loading needs the model's own memory plus the largest single tensor, not twice the model.

GGUF files are read by models/gguf_checkpoint.py (dequantized tensor by tensor; config and tokenizer from the
file's metadata, cached).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import transformers

from .gguf_checkpoint import iter_gguf, load_gguf_config, load_gguf_tokenizer

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
TORCH_BIN_SINGLE = "pytorch_model.bin"
# tekken.json: Mistral's own format (Voxtral); transformers reads it through mistral_common (MistralCommonBackend).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tekken.json")

# safetensors dtype strings -> torch dtypes (https://github.com/huggingface/safetensors, format spec).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


# ---------------------------------------------------------------------------------------------------------------------
# Public API


# Multimodal checkpoints hold the text decoder under a prefix, next to the other parts. Each name is routed to one
# part; the decoder's names are rewritten to a plain causal LM's (`model.layers.0...`, `lm_head.weight`). Checked in
# order, first match wins. Transformers' own LLaVA / Qwen2-Audio `save_pretrained` writes the legacy names
# (`language_model.model.*`); newer checkpoints use `model.language_model.*` with a top-level `lm_head.*`.
DECODER, VISION, AUDIO, PROJECTOR = "decoder", "vision", "audio", "projector"
_PART_PREFIXES: tuple[tuple[str, str], ...] = (
    ("vision_tower.", VISION),
    ("model.vision_tower.", VISION),
    ("visual.", VISION),  # Qwen2-VL / Qwen2.5-VL
    ("model.visual.", VISION),
    ("model.vision_model.", VISION),  # Idefics3 / SmolVLM
    ("audio_tower.", AUDIO),  # Qwen2-Audio
    ("model.audio_tower.", AUDIO),
    ("multi_modal_projector.", PROJECTOR),
    ("model.multi_modal_projector.", PROJECTOR),
    ("model.connector.", PROJECTOR),  # Idefics3 / SmolVLM
    ("image_newline", PROJECTOR),  # LLaVA-NeXT's row separator (one vector)
    ("model.image_newline", PROJECTOR),
)
_DECODER_RENAMES: tuple[tuple[str, str], ...] = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("model.text_model.", "model."),  # Idefics3 / SmolVLM
    ("language_model.", "model."),
)


def route_weight_name(name: str) -> tuple[str, str]:
    """(part, name within the part) of a checkpoint tensor name: `language_model.model.norm.weight` ->
    ("decoder", "model.norm.weight"); `vision_tower.x` -> ("vision", "vision_tower.x"). Plain decoders: unchanged."""
    for prefix, part in _PART_PREFIXES:
        if name.startswith(prefix):
            return part, name
    for prefix, replacement in _DECODER_RENAMES:
        if name.startswith(prefix):
            return DECODER, replacement + name[len(prefix) :]
    return DECODER, name


def iter_checkpoint_tensors(path: str | os.PathLike, part: str | None = DECODER) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every weight of one part of the checkpoint at `path`, one tensor at a time.

    `path` is a folder (`model.safetensors`, sharded safetensors with `model.safetensors.index.json`, or
    `pytorch_model.bin[.index.json]`) or a `.gguf` file (models/gguf_checkpoint.py GGUF_ARCHS). Safetensors tensors keep their stored
    dtype; GGUF tensors come out as float32. A tied GGUF (no `output.weight`) yields no `lm_head.weight`.
    `part`: DECODER (the default: the text decoder, with a multimodal checkpoint's names rewritten to a causal LM's,
    see `route_weight_name`), VISION, AUDIO, PROJECTOR, or None for every tensor under its stored name. Tensors of
    other parts are not read at all.
    Errors about the path are raised here, before the first tensor: FileNotFoundError if it does not exist,
    ValueError if it holds no weights in a format we read.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {path}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"checkpoint file {path} is not a .gguf file; pass a checkpoint folder or a .gguf file")
        return iter_gguf(path)  # GGUF files we read are text decoders: every tensor is the decoder's
    files, kind = _find_weight_files(path)
    keep = None if part is None else (lambda name: route_weight_name(name)[0] == part)
    if kind == "safetensors":
        tensors = _iter_safetensors_files(files, _index_names(path / SAFETENSORS_INDEX), keep)
    else:
        tensors = _iter_torch_bin_files(files, keep)
    return tensors if part is None else ((route_weight_name(n)[1], t) for n, t in tensors)


def checkpoint_parts(path: str | os.PathLike) -> dict[str, list[str]]:
    """The tensor names of a safetensors checkpoint folder by part (stored names), read from headers only.

    What a multimodal checkpoint holds beside its decoder (vision / audio towers, projectors) is collected here for
    the parts that will load it; a GGUF file or a `.bin` folder reports every name as the decoder's.
    """
    path = Path(path)
    names: list[str] = []
    if path.is_dir():
        files, kind = _find_weight_files(path)
        if kind == "safetensors":
            for file in files:
                names += _safetensors_header(file)[0]
    parts: dict[str, list[str]] = {}
    for name in names:
        parts.setdefault(route_weight_name(name)[0], []).append(name)
    return parts


def load_hf_config(path: str | os.PathLike) -> transformers.PretrainedConfig:
    """The transformers config of the checkpoint folder or `.gguf` file at `path`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {path}")
    if path.is_file():
        return load_gguf_config(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"checkpoint folder {path} has no config.json{_gguf_hint(path)}")
    config = transformers.AutoConfig.from_pretrained(path)
    _use_generation_eos(config, path / "generation_config.json")
    return config


def _use_generation_eos(config: transformers.PretrainedConfig, file: Path) -> None:
    """A generation_config.json's eos_token_id (an id or a list: Llama 3 instruct stops on three) replaces the model
    config's, as transformers' generate does: the decoder then stops on any of them."""
    if getattr(config, "model_type", "") == "whisper" or not file.is_file():
        return  # Whisper's stops are its own rules (services/processing/whisper_rules.py)
    try:
        eos = json.loads(file.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError, AttributeError):
        return  # services/parts/bundle.py warns about an unreadable file once
    if isinstance(eos, int) or (isinstance(eos, list) and eos and all(isinstance(i, int) for i in eos)):
        config.get_text_config().eos_token_id = eos


def load_tokenizer(path: str | os.PathLike) -> transformers.PreTrainedTokenizerBase | None:
    """The tokenizer of the checkpoint folder or `.gguf` file at `path`, or None when it ships none."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {path}")
    if path.is_file():
        return load_gguf_tokenizer(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    return transformers.AutoTokenizer.from_pretrained(path, mistral_format=_reads_tekken(path))


def _reads_tekken(folder: Path) -> bool | None:
    """Whether transformers may read the folder's tekken.json (None: its choice) or must not (False).

    With mistral_common installed (Voxtral needs it) transformers reads tekken.json first, even next to a
    tokenizer.json, as a MistralCommonBackend that has no chat template: a Mistral text checkpoint that ships both
    (the hub's do) then had its turns joined by newlines instead of its template. Its HF files win; tekken.json is
    read when it is the only tokenizer, or for Voxtral, whose prompts are mistral_common's (services/processing/voxtral_prompt.py).
    """
    if not any((folder / name).is_file() for name in TOKENIZER_FILES if name != "tekken.json"):
        return None
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError, AttributeError):
        model_type = None
    return None if model_type == "voxtral" else False


# ---------------------------------------------------------------------------------------------------------------------
# Folders: safetensors and PyTorch .bin


def _find_weight_files(folder: Path) -> tuple[list[Path], str]:
    """The weight files of a checkpoint folder, in load order, and their kind ("safetensors" or "bin")."""
    for index_name, single_name, kind in (
        (SAFETENSORS_INDEX, SAFETENSORS_SINGLE, "safetensors"),
        (TORCH_BIN_INDEX, TORCH_BIN_SINGLE, "bin"),
    ):
        index = folder / index_name
        if index.is_file():
            shards = list(dict.fromkeys(_read_index(index).values()))  # first-appearance order, no repeats
            missing = [name for name in shards if not (folder / name).is_file()]
            if missing:
                raise ValueError(f"{index} lists shard files that are missing: {', '.join(missing)}")
            return [folder / name for name in shards], kind
        if (folder / single_name).is_file():
            return [folder / single_name], kind
    looked_for = ", ".join((SAFETENSORS_SINGLE, SAFETENSORS_INDEX, TORCH_BIN_SINGLE, TORCH_BIN_INDEX))
    raise ValueError(f"checkpoint folder {folder} holds no weights: looked for {looked_for}{_gguf_hint(folder)}")


def _gguf_hint(folder: Path) -> str:
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    return f" (it has {', '.join(ggufs)}: pass the .gguf file itself)" if ggufs else ""


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a valid checkpoint index (needs a 'weight_map' object): {e}") from e
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to shard files")
    return weight_map


def _index_names(index: Path) -> set[str] | None:
    return set(_read_index(index)) if index.is_file() else None


def _iter_safetensors_files(
    files: list[Path], expected: set[str] | None, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[str] = set()
    for file in files:
        for name, tensor in _iter_safetensors_file(file, keep):
            seen.add(name)
            yield name, tensor
    if expected is not None and keep is not None:
        expected = {name for name in expected if keep(name)}
    if expected is not None and expected - seen:
        missing = sorted(expected - seen)
        raise ValueError(f"tensors listed in the index but found in no shard: {', '.join(missing[:5])}")


def _safetensors_header(file: Path) -> tuple[dict, int]:
    """(header {name: {dtype, shape, data_offsets}}, offset of the data) of a .safetensors file.

    Format: 8-byte little-endian header length, a JSON header, then the data.
    """
    size = file.stat().st_size
    with open(file, "rb", buffering=0) as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{file} is not a safetensors file (shorter than its 8-byte header length)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise ValueError(f"{file} is not a safetensors file (header length {header_len} exceeds the file)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} is not a safetensors file (bad JSON header): {e}") from e
    header.pop("__metadata__", None)
    return header, 8 + header_len


def _iter_safetensors_file(file: Path, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Read a .safetensors file tensor by tensor with plain reads into fresh tensors (only those `keep` accepts).

    Not memory-mapped on purpose: pages of a mapped file count in the process's resident memory until it is closed,
    so mapping a single-file checkpoint while copying it into the model holds twice the weights at the peak.
    """
    size = file.stat().st_size
    header, data_start = _safetensors_header(file)
    with open(file, "rb", buffering=0) as f:
        # File order: sequential reads.
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            if keep is not None and not keep(name):
                continue
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"{file}: tensor {name} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
            nbytes = end - begin
            if nbytes != dtype.itemsize * int(np.prod(shape, dtype=np.int64)) or data_start + end > size:
                raise ValueError(f"{file}: tensor {name} has inconsistent offsets {begin}..{end} for {shape}")
            # No local keeps the tensor: once the caller drops it, it is freed before the next one is read.
            yield name, _read_tensor(f, data_start + begin, nbytes, dtype, shape, file)


def _read_tensor(f, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...], file: Path) -> torch.Tensor:
    raw = torch.empty(nbytes, dtype=torch.uint8)
    buffer = memoryview(raw.numpy())
    f.seek(offset)
    done = 0
    while done < nbytes:
        n = f.readinto(buffer[done:])
        if not n:
            raise ValueError(f"{file} is truncated")
        done += n
    return raw.view(dtype).reshape(shape)


def _iter_torch_bin_files(
    files: list[Path], keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        state_dict = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        for name in list(state_dict):
            tensor = state_dict.pop(name)
            if keep is None or keep(name):
                yield name, tensor
        del state_dict
