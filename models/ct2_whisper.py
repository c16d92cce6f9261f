"""A CTranslate2 Whisper (faster-whisper's folders): its names both ways, and its folder as a transformers folder.

Whisper's layout (CTranslate2's WhisperSpec, filled by its transformers converter from BART's loader): attention
projections are fused: self-attention `linear_0` = q|k|v ([3d, d]; k has no bias in transformers, so its third of
the bias is zeros), `linear_1` = output; cross-attention (`attention`) `linear_0` = q, `linear_1` = k|v, `linear_2` =
output; `ffn/linear_0|1` = fc1|fc2; LayerNorms are `gamma`/`beta`; `position_encodings/encodings` are the learned
(decoder) and sinusoidal (encoder) position tables as transformers stores them.

The file itself is read and written by models/ctranslate2.py.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from omnivox.models.ctranslate2 import WHISPER_SPEC, ct2_spec_name, dequantize_ct2, read_ct2, resolve_aliases

_GELU = 3  # CTranslate2's Activation.GELU (the value whisper-base's `decoder/activation` holds)


def is_ct2_whisper_folder(path: str | os.PathLike) -> bool:
    """A folder holding a CTranslate2 Whisper: `model.bin` with spec WhisperSpec, and `tokenizer.json`."""
    path = Path(path)
    return (path / "tokenizer.json").is_file() and ct2_spec_name(path / "model.bin") == WHISPER_SPEC


# ---------------------------------------------------------------------------------------------------------------------
# Whisper names

# Per-layer CTranslate2 suffix -> transformers suffix, for the unfused tensors.
_LAYER_NAMES = {
    "self_attention/layer_norm/gamma": "self_attn_layer_norm.weight",
    "self_attention/layer_norm/beta": "self_attn_layer_norm.bias",
    "self_attention/linear_1/weight": "self_attn.out_proj.weight",
    "self_attention/linear_1/bias": "self_attn.out_proj.bias",
    "attention/layer_norm/gamma": "encoder_attn_layer_norm.weight",
    "attention/layer_norm/beta": "encoder_attn_layer_norm.bias",
    "attention/linear_0/weight": "encoder_attn.q_proj.weight",
    "attention/linear_0/bias": "encoder_attn.q_proj.bias",
    "attention/linear_2/weight": "encoder_attn.out_proj.weight",
    "attention/linear_2/bias": "encoder_attn.out_proj.bias",
    "ffn/layer_norm/gamma": "final_layer_norm.weight",
    "ffn/layer_norm/beta": "final_layer_norm.bias",
    "ffn/linear_0/weight": "fc1.weight",
    "ffn/linear_0/bias": "fc1.bias",
    "ffn/linear_1/weight": "fc2.weight",
    "ffn/linear_1/bias": "fc2.bias",
}
# Fused CTranslate2 tensor -> the transformers projections it stacks (by rows), in order.
_FUSED = {
    "self_attention/linear_0": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "attention/linear_1": ("encoder_attn", ("k_proj", "v_proj")),
}
_STACK_NAMES = {
    "conv1/weight": "conv1.weight",
    "conv1/bias": "conv1.bias",
    "conv2/weight": "conv2.weight",
    "conv2/bias": "conv2.bias",
    "position_encodings/encodings": "embed_positions.weight",
    "layer_norm/gamma": "layer_norm.weight",
    "layer_norm/beta": "layer_norm.bias",
    "embeddings/weight": "embed_tokens.weight",
}
# Rank-0 flags of a Whisper decoder and the only values transformers' Whisper has.
_DECODER_FLAGS = {"activation": _GELU, "pre_norm": 1, "scale_embeddings": 0, "alibi": 0, "start_from_zero_embedding": 0}
_LAYER = re.compile(r"^(encoder|decoder)/layer_(\d+)/(.+)$")


def ct2_whisper_to_hf(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CTranslate2 Whisper variables -> transformers `WhisperForConditionalGeneration` tensors (`model.*` names).

    Pass the variables with their aliases resolved (`resolve_aliases`). Quantised weights (int8 / int16 with a
    `weight_scale`) are dequantised to float32. Fused projections are split; the zero k bias is dropped
    (transformers' k_proj has none: a non-zero one is an error); flags are checked against what Whisper is;
    `decoder/projection/weight` must equal the embedding (tied).
    """
    tensors = dequantize_ct2(tensors)
    out: dict[str, torch.Tensor] = {}
    d = tensors["decoder/embeddings/weight"].shape[1]
    for name, t in tensors.items():
        stack, _, rest = name.partition("/")
        if stack not in ("encoder", "decoder"):
            raise ValueError(f"CTranslate2 variable {name!r} is not a Whisper one")
        if t.dim() == 0:
            _check_flag(stack, rest, int(t))
            continue
        if rest == "projection/weight":
            if not torch.equal(t, tensors["decoder/embeddings/weight"]):
                raise ValueError(
                    "decoder/projection/weight differs from the embedding: untied Whisper is not supported"
                )
            continue
        m = _LAYER.match(name)
        if m is None:
            wrong_stack = (rest == "embeddings/weight" and stack != "decoder") or (
                rest[:4] == "conv" and stack != "encoder"
            )
            if rest not in _STACK_NAMES or wrong_stack:
                raise ValueError(f"CTranslate2 variable {name!r} has no place in Whisper")
            out[f"model.{stack}.{_STACK_NAMES[rest]}"] = t
            continue
        prefix = f"model.{stack}.layers.{m.group(2)}."
        inner = m.group(3)
        module, _, kind = inner.rpartition("/")
        if module in _FUSED:
            attn, projs = _FUSED[module]
            for proj, part in zip(projs, t.split(d), strict=True):
                if proj == "k_proj" and kind == "bias":
                    if part.abs().max() > 0:
                        raise ValueError(f"{name}: Whisper's k projection has no bias, but this one is non-zero")
                    continue
                out[f"{prefix}{attn}.{proj}.{kind}"] = part.clone()
        elif inner in _LAYER_NAMES:
            out[prefix + _LAYER_NAMES[inner]] = t
        else:
            raise ValueError(f"CTranslate2 variable {name!r} has no place in Whisper")
    return out


def _check_flag(stack: str, name: str, value: int) -> None:
    if name == "num_heads" or name.startswith("alignment_"):
        return  # sizes, read by `whisper_config_from_ct2`; alignment heads come from config.json
    want = _DECODER_FLAGS.get(name) if stack == "decoder" else None
    if want is None:
        raise ValueError(f"CTranslate2 flag {stack}/{name} is not a Whisper one")
    if value != want:
        raise ValueError(f"CTranslate2 flag {stack}/{name} = {value}; Whisper has {want}")


def hf_whisper_to_ct2(
    tensors: dict[str, torch.Tensor], hf_config: Any
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The inverse of `ct2_whisper_to_hf` (names, fusing, the zero k bias, flags, the tied-projection alias), as
    CTranslate2's converter lays a transformers Whisper out; tensors keep their dtype."""
    inverse_layer = {v: k for k, v in _LAYER_NAMES.items()}
    inverse_stack = {v: k for k, v in _STACK_NAMES.items()}
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name == "proj_out.weight":
            continue
        rest = name.removeprefix("model.")
        stack, _, rest = rest.partition(".")
        m = re.match(r"^layers\.(\d+)\.(.+)$", rest)
        if m is None:
            out[f"{stack}/{inverse_stack[rest]}"] = t
            continue
        prefix, inner = f"{stack}/layer_{m.group(1)}/", m.group(2)
        module, _, kind = inner.rpartition(".")
        attn, _, proj = module.rpartition(".")
        target = next((k for k, (a, p) in _FUSED.items() if a == attn and proj in p), None)
        if target is not None:
            fused.setdefault(f"{prefix}{target}/{kind}", {})[proj] = t
        else:
            out[prefix + inverse_layer[inner]] = t
    for name, parts in fused.items():
        module = name.split("/", 2)[2].rpartition("/")[0]
        projs = _FUSED[module][1]
        ref = next(iter(parts.values()))
        out[name] = torch.cat([parts.get(p, torch.zeros_like(ref)) for p in projs])  # k bias: zeros
    i16, i8 = torch.int16, torch.int8
    out["encoder/num_heads"] = torch.tensor(int(hf_config.encoder_attention_heads), dtype=i16)
    out["decoder/num_heads"] = torch.tensor(int(hf_config.decoder_attention_heads), dtype=i16)
    out["decoder/alignment_heads"] = torch.tensor(1, dtype=i16)
    out["decoder/alignment_layer"] = torch.tensor(-1, dtype=i16)
    for flag, value in _DECODER_FLAGS.items():
        out[f"decoder/{flag}"] = torch.tensor(value, dtype=i8)
    return dict(sorted(out.items())), {"decoder/projection/weight": "decoder/embeddings/weight"}


# ---------------------------------------------------------------------------------------------------------------------
# A CTranslate2 Whisper folder -> a transformers folder


def _count_layers(tensors: dict[str, torch.Tensor], stack: str) -> int:
    return len({m.group(2) for n in tensors if (m := _LAYER.match(n)) and m.group(1) == stack})


def whisper_config_from_ct2(tensors: dict[str, torch.Tensor], ct2_config: dict, tokenizer_json: dict):
    """A transformers WhisperConfig from the variables' shapes, CTranslate2's config.json and tokenizer.json."""
    from transformers import WhisperConfig

    ids = _special_ids(tokenizer_json)
    emb = tensors["decoder/embeddings/weight"]
    eot = ids["<|endoftext|>"]
    return WhisperConfig(
        architectures=["WhisperForConditionalGeneration"],
        vocab_size=emb.shape[0],
        num_mel_bins=tensors["encoder/conv1/weight"].shape[1],
        d_model=emb.shape[1],
        encoder_layers=_count_layers(tensors, "encoder"),
        decoder_layers=_count_layers(tensors, "decoder"),
        encoder_attention_heads=int(tensors["encoder/num_heads"]),
        decoder_attention_heads=int(tensors["decoder/num_heads"]),
        encoder_ffn_dim=tensors["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=tensors["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=tensors["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=tensors["decoder/position_encodings/encodings"].shape[0],
        activation_function="gelu",
        scale_embedding=False,
        tie_word_embeddings=True,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=ids["<|startoftranscript|>"],
        suppress_tokens=None,  # in generation_config.json (on the model config, transformers warns at generate)
        begin_suppress_tokens=None,
    )


def _special_ids(tokenizer_json: dict) -> dict[str, int]:
    return {a["content"]: int(a["id"]) for a in tokenizer_json.get("added_tokens", [])}


def whisper_generation_config(hf_config: Any, ct2_config: dict, tokenizer_json: dict):
    """transformers' Whisper GenerationConfig: what `generate` and a service need to build prompts (language and
    task tokens, no-timestamps token, suppression lists, alignment heads)."""
    from transformers import GenerationConfig

    ids = _special_ids(tokenizer_json)
    by_id = {v: k for k, v in ids.items()}
    lang_ids = list(ct2_config.get("lang_ids") or [])
    eot = ids["<|endoftext|>"]
    return GenerationConfig(
        alignment_heads=[list(h) for h in ct2_config.get("alignment_heads") or []],
        begin_suppress_tokens=list(ct2_config.get("suppress_ids_begin") or []),
        suppress_tokens=list(ct2_config.get("suppress_ids") or []),
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        decoder_start_token_id=ids["<|startoftranscript|>"],
        is_multilingual=bool(lang_ids),
        lang_to_id={by_id[i]: i for i in lang_ids},
        task_to_id={t: ids[f"<|{t}|>"] for t in ("transcribe", "translate") if f"<|{t}|>" in ids},
        no_timestamps_token_id=ids["<|notimestamps|>"],
        prev_sot_token_id=ids.get("<|startofprev|>"),
        max_initial_timestamp_index=50,  # OpenAI's max_initial_timestamp = 1.0 s of 0.02 s steps
        max_length=int(hf_config.max_target_positions),
        return_timestamps=False,
    )


def convert_ct2_whisper_folder(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> None:
    """A CTranslate2 Whisper folder (`model.bin`, `config.json`, `tokenizer.json`) -> a transformers folder:
    config.json, model.safetensors (float32), tokenizer (timestamp tokens `<|0.00|>`... added after the special
    tokens, as the hub's Whisper tokenizers have them), preprocessor_config.json, generation_config.json."""
    from safetensors.torch import save_file
    from transformers import AddedToken, WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizer

    src, dst = Path(src_dir), Path(dst_dir)
    spec, tensors, aliases = read_ct2(src / "model.bin")
    tensors = resolve_aliases(tensors, aliases)
    if spec != WHISPER_SPEC:
        raise ValueError(f"{src}: CTranslate2 spec {spec!r}, not {WHISPER_SPEC}")
    ct2_config = json.loads((src / "config.json").read_text()) if (src / "config.json").exists() else {}
    tokenizer_json = json.loads((src / "tokenizer.json").read_text())
    config = whisper_config_from_ct2(tensors, ct2_config, tokenizer_json)
    hf = ct2_whisper_to_hf(tensors)
    del tensors
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    del hf
    config.save_pretrained(dst)
    whisper_generation_config(config, ct2_config, tokenizer_json).save_pretrained(dst)

    # The tokenizer: every added special token beyond <|endoftext|> registered as special (transformers finds the
    # first timestamp id as the last special id + 1), then the timestamp tokens up to the vocabulary size.
    ids = _special_ids(tokenizer_json)
    specials = [a["content"] for a in tokenizer_json["added_tokens"] if a["special"] and a["id"] > ids["<|endoftext|>"]]
    with tempfile.TemporaryDirectory() as tok_src:  # from_pretrained reads a folder
        (Path(tok_src) / "tokenizer.json").write_text(json.dumps(tokenizer_json))
        tokenizer = WhisperTokenizer.from_pretrained(tok_src, additional_special_tokens=specials)
    first_timestamp = ids["<|notimestamps|>"] + 1
    if len(tokenizer) != first_timestamp:
        raise ValueError(f"tokenizer.json holds {len(tokenizer)} tokens; expected {first_timestamp} before timestamps")
    stamps = [f"<|{i * 0.02:.2f}|>" for i in range(config.vocab_size - first_timestamp)]
    tokenizer.add_tokens([AddedToken(s, special=False, normalized=False, lstrip=False, rstrip=False) for s in stamps])
    features = WhisperFeatureExtractor(feature_size=config.num_mel_bins)
    WhisperProcessor(feature_extractor=features, tokenizer=tokenizer).save_pretrained(dst)
    features.save_pretrained(dst)  # preprocessor_config.json too: what AutoFeatureExtractor and older readers open


CONVERTED_VERSION = 1  # bump when the converted folder's contents change: old cache entries are then rebuilt


def cached_ct2_whisper_folder(src_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The transformers folder converted from the CTranslate2 Whisper at `src_dir`, built once into the omnivox
    cache (under a lock, atomically: native/cache.py) and keyed by model.bin's size and mtime and the transformers
    version; later calls only look. whisper-base: 2.4 s to convert, 290 MB (float32)."""
    import transformers

    from omnivox.native.cache import build_cached, omnivox_cache_dir

    src = Path(src_dir).resolve()
    if not is_ct2_whisper_folder(src):
        raise ValueError(f"{src} is not a CTranslate2 Whisper folder (model.bin with WhisperSpec + tokenizer.json)")
    stat = (src / "model.bin").stat()
    key = f"{src.name}-{stat.st_size}-{stat.st_mtime_ns}-tf{transformers.__version__}-v{CONVERTED_VERSION}"
    target = omnivox_cache_dir(cache_dir) / "ct2-whisper" / key

    def complete(p: Path) -> bool:
        return all((p / f).is_file() for f in ("model.safetensors", "config.json", "generation_config.json"))

    return build_cached(target, lambda staged: convert_ct2_whisper_folder(src, staged), complete)
