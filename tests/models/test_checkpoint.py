"""models/checkpoint.py: streaming safetensors / .bin / GGUF readers against transformers' own loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from support.checkpoints import make_checkpoint
from support.gguf_writer import _gguf_name, write_gguf

from omnivox.models.checkpoint import iter_checkpoint_tensors, load_hf_config, load_tokenizer


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """GGUF metadata caches go to this test's tmp folder, not the user's cache."""
    monkeypatch.setenv("OMNIVOX_CACHE", str(tmp_path / "omnivox-cache"))


def _reference_state_dict(path: Path, **kwargs) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def _assert_same_tensors(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(reference)
    for name, tensor in reference.items():
        assert ours[name].shape == tensor.shape, name
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name


# ---------------------------------------------------------------------------------------------------------------------
# safetensors and .bin folders


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("shard", ["5GB", "100KB"])
def test_safetensors_folder_matches_transformers(tmp_path, family, shard):
    path = make_checkpoint(tmp_path / "ckpt", family=family, max_shard_size=shard)
    if shard == "100KB":
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1, "expected a sharded checkpoint"
    ours = dict(iter_checkpoint_tensors(path))
    _assert_same_tensors(ours, _reference_state_dict(path))


def test_safetensors_keeps_stored_dtype(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", family="qwen2", dtype=torch.bfloat16)
    ours = dict(iter_checkpoint_tensors(path))
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
    assert all(t.dtype == torch.bfloat16 for t in ours.values())
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
    assert "model.layers.0.self_attn.q_proj.bias" in ours  # qwen2 has q/k/v biases


def test_tied_embeddings_yield_no_lm_head(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", family="llama", tie_word_embeddings=True)
    names = [name for name, _ in iter_checkpoint_tensors(path)]
    assert "lm_head.weight" not in names
    assert "model.embed_tokens.weight" in names


def test_torch_bin_folder(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", family="qwen3")
    reference = _reference_state_dict(path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torch.save(reference, bin_dir / "pytorch_model.bin")
    _assert_same_tensors(dict(iter_checkpoint_tensors(bin_dir)), reference)


def test_config_and_tokenizer_of_folder(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", family="qwen3")
    config = load_hf_config(path)
    assert config.model_type == "qwen3" and config.head_dim == 32 and config.num_hidden_layers == 2
    tokenizer = load_tokenizer(path)
    assert tokenizer is not None and tokenizer.eos_token_id == 2
    bare = make_checkpoint(tmp_path / "bare", family="llama", with_tokenizer=False)
    assert load_tokenizer(bare) is None


def test_missing_path_and_empty_folder_errors(tmp_path):
    missing = tmp_path / "nope"
    for fn in (iter_checkpoint_tensors, load_hf_config, load_tokenizer):
        with pytest.raises(FileNotFoundError, match="nope"):
            fn(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="model.safetensors"):
        iter_checkpoint_tensors(empty)  # raised at the call, before iterating
    with pytest.raises(ValueError, match="config.json"):
        load_hf_config(empty)
    (empty / "model.Q4_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="model.Q4_0.gguf"):
        iter_checkpoint_tensors(empty)
    not_gguf = tmp_path / "weights.txt"
    not_gguf.write_text("x")
    with pytest.raises(ValueError, match=".gguf"):
        iter_checkpoint_tensors(not_gguf)


def test_missing_shard_and_truncated_file_errors(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", family="llama", max_shard_size="100KB")
    shards = sorted(path.glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(ValueError, match="missing"):
        iter_checkpoint_tensors(path)
    single = make_checkpoint(tmp_path / "single", family="llama")
    data = (single / "model.safetensors").read_bytes()
    (single / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        list(iter_checkpoint_tensors(single))


# ---------------------------------------------------------------------------------------------------------------------
# Peak memory while streaming

_MEMORY_PROBE = textwrap.dedent(
    """
    import sys, torch
    from safetensors import safe_open
    from omnivox.models.checkpoint import iter_checkpoint_tensors
    path, mode = sys.argv[1], sys.argv[2]
    with safe_open(path + "/model.safetensors", "pt") as f:  # shapes only: the header
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    def peak_mib():  # VmHWM: the peak resident set since the last reset
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak to the current resident set (Linux)
        f.write("5")
    before = peak_mib()
    model = {name: torch.ones(shape) for name, shape in shapes.items()}  # the model's own (touched) memory
    if mode == "ours":
        for name, tensor in iter_checkpoint_tensors(path):
            model[name].copy_(tensor)
    else:  # control: everything at once, as a non-streaming loader would
        from safetensors.torch import load_file
        for name, tensor in load_file(path + "/model.safetensors").items():
            model[name].copy_(tensor)
    print(peak_mib() - before)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak-RSS reset needs Linux /proc")
def test_streaming_peak_memory_under_1_5x_weights(tmp_path):
    # ~128 MiB of float32 weights in one file, in 16 tensors of 8 MiB.
    from safetensors.torch import save_file

    folder = tmp_path / "big"
    folder.mkdir()
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.full((1024, 2048), float(i)) for i in range(16)}
    weights_mib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    save_file(tensors, folder / "model.safetensors")
    del tensors

    # glibc's dynamic mmap threshold keeps some freed 8 MiB blocks in the heap (reusable, but resident), which makes
    # the peak wander by several tensors from run to run; a fixed threshold returns them, so what we measure is
    # what the loader holds.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}

    def growth(mode: str) -> float:
        out = subprocess.run(
            [sys.executable, "-c", _MEMORY_PROBE, str(folder), mode],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        return float(out.stdout.strip().splitlines()[-1])

    ours = growth("ours")
    print(f"streaming peak growth {ours:.0f} MiB for {weights_mib:.0f} MiB of weights")
    assert ours < 1.5 * weights_mib, f"peak grew {ours:.0f} MiB for {weights_mib:.0f} MiB of weights"
    # The measurement can tell: loading the whole file at once (memory-mapped) costs about twice the weights.
    control = growth("load_file")
    assert control > 1.5 * weights_mib, f"control grew only {control:.0f} MiB; the probe cannot see the difference"


# ---------------------------------------------------------------------------------------------------------------------
# GGUF written here the way llama.cpp's convert_hf_to_gguf.py writes it


_Q8 = gguf.GGMLQuantizationType.Q8_0
_Q4_1 = gguf.GGMLQuantizationType.Q4_1
_QUANTIZED = {
    "blk.0.attn_q.weight": _Q8,
    "blk.0.attn_k.weight": _Q8,
    "blk.1.attn_q.weight": _Q4_1,
    "blk.1.ffn_down.weight": _Q4_1,
    "blk.0.ffn_up.weight": _Q8,
    "token_embd.weight": _Q8,
}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny llama checkpoint folder and a GGUF of it with permuted Q/K, some tensors Q8_0 / Q4_1."""
    root = tmp_path_factory.mktemp("gguf")
    hf_dir = make_checkpoint(root / "hf", family="llama")
    return hf_dir, write_gguf(hf_dir, root / "gguf" / "tiny-llama.gguf", _QUANTIZED)


def test_gguf_llama_matches_transformers(tiny_gguf):
    hf_dir, gguf_path = tiny_gguf
    ours = dict(iter_checkpoint_tensors(gguf_path))
    reference = _reference_state_dict(gguf_path.parent, gguf_file=gguf_path.name)
    _assert_same_tensors(ours, reference)
    assert "lm_head.weight" in ours  # untied: the file has output.weight

    # And against the original weights: exact where stored F32 (so the Q/K permutation was undone), close where not.
    original = dict(iter_checkpoint_tensors(hf_dir))
    for name, tensor in original.items():
        gguf_name = _gguf_name(name)
        if gguf_name in _QUANTIZED:
            tolerance = 0.01 if _QUANTIZED[gguf_name] == _Q8 else 0.05
            assert torch.allclose(ours[name], tensor, atol=tolerance), name
            assert not torch.equal(ours[name], tensor), f"{name} should carry quantization error"
        else:
            assert torch.equal(ours[name], tensor), name


def test_gguf_config_and_tokenizer(tiny_gguf, tmp_path):
    hf_dir, gguf_path = tiny_gguf
    original = transformers.AutoConfig.from_pretrained(hf_dir)
    config = load_hf_config(gguf_path)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert getattr(config, key) == getattr(original, key), key
    assert config.model_type == "llama" and config.tie_word_embeddings is False

    tokenizer = load_tokenizer(gguf_path)
    reference = transformers.AutoTokenizer.from_pretrained(hf_dir)
    text = "Hello there! 東京は日本の首都です。 😀 café <|im_start|>"
    assert tokenizer.encode(text) == reference.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert tokenizer.eos_token_id == 2

    # Second calls come from the cache folder, and give the same answers.
    cache = tmp_path / "omnivox-cache" / "gguf-meta"
    (entry,) = cache.iterdir()
    assert (entry / "config" / "config.json").is_file() and (entry / "tokenizer" / "tokenizer_config.json").is_file()
    assert load_hf_config(gguf_path).to_dict() == config.to_dict()
    assert load_tokenizer(gguf_path).encode(text) == tokenizer.encode(text)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_gguf_qwen_matches_original(tmp_path, family):
    # qwen3 with head_dim 32 != hidden / heads: only the GGUF's attention.key_length tells.
    overrides = {"tie_word_embeddings": True} if family == "qwen2" else {}
    hf_dir = make_checkpoint(tmp_path / "hf", family=family, **overrides)
    gguf_path = write_gguf(hf_dir, tmp_path / "g" / f"{family}.gguf", {"blk.1.ffn_up.weight": _Q8})
    config = load_hf_config(gguf_path)
    original_config = transformers.AutoConfig.from_pretrained(hf_dir)
    assert config.model_type == family
    assert getattr(config, "head_dim", None) == getattr(original_config, "head_dim", None)
    assert config.tie_word_embeddings == original_config.tie_word_embeddings
    ours = dict(iter_checkpoint_tensors(gguf_path))
    original = dict(iter_checkpoint_tensors(hf_dir))
    assert sorted(ours) == sorted(original)
    for name, tensor in original.items():
        if name == "model.layers.1.mlp.up_proj.weight":
            assert torch.allclose(ours[name], tensor, atol=0.01)
        else:
            assert torch.equal(ours[name], tensor), name  # no permutation for qwen: llama.cpp writes them as is
    if family == "qwen2":
        assert "lm_head.weight" not in ours
        assert "model.layers.0.self_attn.q_proj.bias" in ours
    else:
        assert "model.layers.0.self_attn.q_norm.weight" in ours


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(path, "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="phi2"):
        list(iter_checkpoint_tensors(path))


@pytest.mark.parametrize(("low", "high", "context"), [(1.0, 4.0, 8192), (2.0, 8.0, 4096)])
def test_gguf_llama3_rope_scaling_is_recovered(tmp_path, low, high, context):
    # llama.cpp keeps Llama 3.x rope scaling only as the rope_freqs.weight tensor; transformers' GGUF config drops it.
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": low}
    rope |= {"high_freq_factor": high, "original_max_position_embeddings": context}
    # head_dim 32: 16 frequencies, a few of them in the smooth band.
    hf_dir = make_checkpoint(
        tmp_path / "hf", family="llama", num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16384
    )
    hf_config = json.loads((hf_dir / "config.json").read_text())
    hf_config["rope_parameters"] = rope
    (hf_dir / "config.json").write_text(json.dumps(hf_config))
    gguf_path = write_gguf(hf_dir, tmp_path / "g" / "llama3.gguf", {})

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ours = load_hf_config(gguf_path)
    original = transformers.AutoConfig.from_pretrained(hf_dir)
    assert ours.rope_parameters["rope_type"] == "llama3"
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](ours, torch.device("cpu"))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](original, torch.device("cpu"))
    assert torch.allclose(inv_freq, expected, rtol=1e-5)
    plain = 1.0 / rope["rope_theta"] ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32)
    assert not torch.allclose(inv_freq, plain, rtol=1e-3)  # the scaling matters
    # Also after a round trip through the metadata cache.
    assert load_hf_config(gguf_path).rope_parameters == ours.rope_parameters
    # rope_freqs is not a parameter: not yielded.
    assert sorted(name for name, _ in iter_checkpoint_tensors(gguf_path)) == sorted(
        name for name, _ in iter_checkpoint_tensors(hf_dir)
    )


def test_gguf_reader_fallback_agrees(tiny_gguf, monkeypatch):
    # Without transformers' fast GGUF header reader (older transformers), gguf.GGUFReader gives the same tensors.
    _, gguf_path = tiny_gguf
    fast = dict(iter_checkpoint_tensors(gguf_path))
    load_hf_config(gguf_path)  # cached before the reader goes away
    monkeypatch.setitem(sys.modules, "transformers.integrations.gguf.reader", None)
    with pytest.raises(ImportError):
        from transformers.integrations.gguf.reader import GgufHeader  # noqa: F401
    _assert_same_tensors(dict(iter_checkpoint_tensors(gguf_path)), fast)
