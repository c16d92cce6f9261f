"""Phi-3 (Phi3ForCausalLM), Gemma 3's text decoder (Gemma3ForCausalLM) and Gemma 2 on our decoder, against transformers' own
implementation on tiny random checkpoints saved with save_pretrained: greedy tokens (model.generate) and top-5
log-probabilities, prefill whole and in chunks, paged decode past sliding windows, every load path (float, int8 at
load, 2 tensor-parallel ranks), refusals naming the config key, and one Generate per family through gRPC."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from support.checkpoints import load_reference, make_checkpoint
from support.decoder_parity import LONG, MID, SHORT, XL, assert_matches
from support.engines import tiny_engine
from support.service_harness import served_greedy_equals_generate

from omnivox.models import quant
from omnivox.models.config import ModelConfig
from omnivox.models.loading import load_decoder

# Phi-4-mini's config.json as released, shrunk: pre-transformers-5 keys (`rope_scaling` {"type": "longrope"},
# top-level rope_theta and partial_rotary_factor), 3/4 of each head rotating (12 of 16 dims: 6 factors each), tied.
# original_max_position_embeddings 32 < the prompts: transformers takes the long factors, as our tables always do at
# a served length past it (models/layers.py).
PHI4_MINI = {
    "partial_rotary_factor": 0.75,
    "original_max_position_embeddings": 32,
    "tie_word_embeddings": True,
    "legacy": {
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
            "long_factor": [2.0, 2.5, 3.0, 3.5, 4.0, 4.5],
        },
        "rope_theta": 10000.0,
    },
}
# Gemma 3 4B's text config as released, shrunk: legacy rope keys (global rope_theta with linear scaling, the local
# layers' rope_local_base_freq), plus what other releases may set: untied, q/k/v/o biases, final logit soft-capping.
GEMMA3_4B = {
    "tie_word_embeddings": False,
    "attention_bias": True,
    "final_logit_softcapping": 2.0,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "num_hidden_layers": 3,
    "legacy": {
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0,
    },
}

# id -> (family, checkpoint overrides, engine kwargs, prompts compared)
CASES = {
    # fused qkv / gate_up split at load; a 20-key window on every layer, 8-token prefill chunks, decode past it
    "phi3-window-20-chunked": ("phi3", {"sliding_window": 20}, {"max_num_batched_tokens": 8}, (SHORT, MID, XL)),
    "phi4-mini-longrope-partial-rotary": ("phi3", PHI4_MINI, {}, (LONG, XL)),
    "phi3-partial-rotary-half-default-rope": ("phi3", {"partial_rotary_factor": 0.5}, {}, (SHORT,)),
    # Gemma 1: 2B's MQA (one KV head), (1 + w) norms, scaled embedding, GELU-tanh on Llama's layer; 7B's MHA untied
    # with the releases' legacy hidden_act "gelu" (transformers reads it as the tanh GELU)
    "gemma-2b-like-mqa-chunked": ("gemma", {}, {"max_num_batched_tokens": 8}, (SHORT, MID, XL)),
    "gemma-7b-like-mha-untied-legacy-gelu": ("gemma", {"num_key_value_heads": 4, "tie_word_embeddings": False,
                                                       "legacy": {"hidden_act": "gelu"}}, {}, (MID, LONG)),
    # Gemma 3 1B's shape: a sliding layer (window 20) then a full one, tied, query_pre_attn_scalar != head_dim
    "gemma3-1b-like-chunked": ("gemma3", {}, {"max_num_batched_tokens": 8}, (SHORT, MID, XL)),
    "gemma3-4b-like-linear-rope-softcap-bias": ("gemma3", GEMMA3_4B, {}, (SHORT, XL)),
    # Gemma 2: attention scores soft-capped on every path (prefill whole and in chunks, decode past the window)
    "gemma2-softcaps-chunked": ("gemma2", {}, {"max_num_batched_tokens": 8}, (SHORT, MID, XL)),
    "gemma2-softcaps-gqa4-untied-whole-prompt": ("gemma2", {"num_attention_heads": 8, "tie_word_embeddings": False},
                                                 {}, (MID, LONG)),
}  # fmt: skip


def build(root: Path, name: str, family: str, overrides: dict, tokenizer: bool = False) -> Path:
    """The case's checkpoint; `legacy` keys are written into config.json in place of `rope_parameters`, as the hub's
    checkpoints carry them (transformers converts them when it reads the file)."""
    overrides = dict(overrides)
    legacy = overrides.pop("legacy", None)
    path = make_checkpoint(root / name, family, seed=7, with_tokenizer=tokenizer, **overrides)
    if legacy:
        config = json.loads((path / "config.json").read_text())
        config.pop("rope_parameters", None)
        (path / "config.json").write_text(json.dumps(config | legacy))
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("families")


@pytest.fixture(scope="module")
def paths(root) -> dict[str, Path]:
    return {case: build(root, case, family, overrides) for case, (family, overrides, _, _) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_transformers(paths, case):
    _, _, engine_kwargs, prompts = CASES[case]
    engine = tiny_engine(paths[case], **engine_kwargs)
    assert_matches(engine, load_reference(paths[case]), prompts)


def test_configs_read_as_released(paths):
    """What the legacy keys and each family's knobs become (a key we dropped would still decode, differently)."""
    phi = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(paths["phi4-mini-longrope-partial-rotary"]))
    assert (phi.family, phi.rotary_dim, phi.tie_word_embeddings) == ("phi3", 12, True)
    assert phi.hf_config.rope_parameters["rope_type"] == "longrope"
    window = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(paths["phi3-window-20-chunked"]))
    assert (window.sliding_window, window.window_everywhere) == (20, 20)  # every layer slides: blocks released
    # Phi-3-mini-128k / Phi-4-mini: a window of 262144 over 131072 positions masks nothing, so there is none
    for window, want in ((512, None), (2048, None), (511, 511)):
        cfg = transformers.Phi3Config(vocab_size=384, hidden_size=64, num_attention_heads=4, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2, max_position_embeddings=512, sliding_window=window)  # fmt: skip
        assert ModelConfig.from_hf(cfg).sliding_window == want
    gemma = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(paths["gemma3-4b-like-linear-rope-softcap-bias"]))  # fmt: skip
    assert (gemma.family, gemma.sliding_layers, gemma.local_rope_layers) == ("gemma3", (0, 2), (0, 2))
    assert (gemma.attn_scale, gemma.embed_scale, gemma.final_logit_softcapping) == (24**-0.5, 8.0, 2.0)
    rope = gemma.hf_config.rope_parameters
    assert rope["full_attention"]["rope_type"] == "linear" and rope["sliding_attention"]["rope_theta"] == 10000.0
    gemma2 = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(paths["gemma2-softcaps-chunked"]))
    assert (gemma2.family, gemma2.sliding_layers, gemma2.local_rope_layers, gemma2.qk_norm) == (
        "gemma2",
        (0,),
        (),
        False,
    )
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (0.05, 3.0)
    gemma = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(paths["gemma-7b-like-mha-untied-legacy-gelu"]))
    assert (gemma.family, gemma.hidden_act, gemma.norm_offset, gemma.embed_scale) == ("gemma", "gelu_tanh", 1.0, 8.0)
    assert (gemma.sandwich_norms, gemma.attn_scale, gemma.sliding_window, gemma.tie_word_embeddings) == (
        False, None, None, False)  # fmt: skip


@pytest.mark.parametrize(
    "case",
    ["phi4-mini-longrope-partial-rotary", "gemma3-4b-like-linear-rope-softcap-bias", "gemma-2b-like-mqa-chunked"],
)
def test_load_paths_agree(paths, case):
    """The streaming loader (models/loading.py: fused projections split, Gemma norms folded as tensors arrive) gives
    the engine loader's float weights, and its int8-at-load the same model as quantising the float one."""
    path = paths[case]
    engine = tiny_engine(path)
    ours = load_decoder(path, quantization="none")
    for (name, a), (_, b) in zip(ours.state_dict().items(), engine.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    loaded = load_decoder(path, quantization="int8")
    converted = quant.quantize_decoder(load_decoder(path, quantization="none"), "int8")
    for (name, a), (_, b) in zip(loaded.state_dict().items(), converted.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    int8 = tiny_engine(path, quantization="int8")
    assert isinstance(int8.model.layers[0].mlp.down_proj, quant.Int8Linear)
    assert len(int8.generate([XL], _greedy(4))[0].token_ids) == 4


def _greedy(n: int):
    from omnivox.engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize(
    "case",
    [
        "phi4-mini-longrope-partial-rotary",
        "gemma3-4b-like-linear-rope-softcap-bias",
        "gemma2-softcaps-chunked",
        "gemma-7b-like-mha-untied-legacy-gelu",
    ],
)
def test_two_tensor_parallel_ranks_equal_one_process(paths, case):
    from support.tensor_parallel import two_ranks_equal_one

    two_ranks_equal_one(paths[case], 12)


REFUSED = {
    "bidirectional": ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    "relu": ("gemma3", {"hidden_activation": "relu"}, "hidden_activation"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_config_is_refused_at_load_naming_the_key(case):
    family, overrides, key = REFUSED[case]
    hf = transformers.Gemma3TextConfig(vocab_size=384, hidden_size=64, num_attention_heads=4, head_dim=16, **overrides)
    assert family == "gemma3"
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf(hf)


def test_gemma3_vision_language_config_unwraps_to_this_decoder():
    """Gemma 3 4B+ (Gemma3ForConditionalGeneration) holds this text decoder plus a SigLIP tower, served together
    (models/vision/gemma3.py, tests/models/vision/test_vision_gemma3.py): its config gives the text decoder's."""
    hf = transformers.Gemma3Config(architectures=["Gemma3ForConditionalGeneration"])
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.family, cfg.hidden_size, cfg.sandwich_norms) == ("gemma3", hf.text_config.hidden_size, True)


def test_paligemma_is_refused_not_served_as_its_gemma_text_part():
    hf = transformers.PaliGemmaConfig(architectures=["PaliGemmaForConditionalGeneration"])
    assert hf.text_config.model_type == "gemma"
    with pytest.raises(ValueError, match="unsupported architecture.*PaliGemma"):
        ModelConfig.from_hf(hf)


def test_grpc_greedy_matches_transformers(root):
    """One Generate per family through a real server: the ChatML prompt the service builds, greedy tokens as
    transformers' generate gives them (past the windows of 20)."""
    paths = {
        "phi3": build(root, "grpc-phi3", "phi3", CASES["phi4-mini-longrope-partial-rotary"][1], tokenizer=True),
        "gemma3": build(root, "grpc-gemma3", "gemma3", {}, tokenizer=True),
        "gemma2": build(root, "grpc-gemma2", "gemma2", {}, tokenizer=True),
        "gemma": build(root, "grpc-gemma", "gemma", {}, tokenizer=True),
    }
    served_greedy_equals_generate(paths, min_prompt=32)  # past the windows and Phi's original length (long rope)


@pytest.mark.parametrize("arch", ["llama4", "gemma"])
def test_gguf_of_these_families_refused_at_load_naming_the_architecture(tmp_path, arch):
    """We read llama / qwen2 / qwen3 / gemma2 / gemma3 / phi3 GGUFs only: others are refused when the config is read, before
    a model is allocated."""
    import gguf
    import numpy as np

    from omnivox.engine import Engine

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"GGUF architecture '{arch}' is not supported"):
        Engine.from_pretrained(path, device="cpu", kv_cache_gib=0.01)


def test_softcapped_attention_over_many_query_rows_equals_the_formula():
    """Gemma 2's written-out attention takes a long chunk's queries a slice at a time (bounded score memory); the
    slices together equal the formula over the whole chunk (600 queries: three slices), GQA and a ragged mask."""
    from omnivox.models.attention import _softcapped_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 8, 600, 16), torch.randn(1, 2, 700, 16), torch.randn(1, 2, 700, 16)
    mask = torch.rand(600, 700) > 0.3
    mask[:, 0] = True
    scores = torch.tanh(q @ k.repeat_interleave(4, 1).transpose(-1, -2) * 0.25 / 2.0) * 2.0
    want = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.repeat_interleave(4, 1)
    torch.testing.assert_close(_softcapped_attention(q, k, v, mask, 0.25, 2.0), want)


def test_embedding_segments_of_plain_tokens_equal_the_tokens_on_gemma(paths):
    """Engine.embed_tokens gives the rows the token path feeds the layers: Gemma's scaled by sqrt(hidden). An
    embedding segment of them in place of the tokens yields the same greedy tokens and log-probabilities (was: the
    unscaled rows, 8x too small here)."""
    from omnivox.engine.request import EmbeddingSegment

    engine = tiny_engine(paths["gemma-2b-like-mqa-chunked"])
    from omnivox.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    prompt = list(range(20, 60))
    plain = engine.generate([prompt], params)[0]
    segment = EmbeddingSegment.from_embeds(10, engine.embed_tokens(prompt[10:30]))
    via = engine.generate([prompt[:10] + [3] * 20 + prompt[30:]], params, segments=[[segment]])[0]
    assert via.token_ids == plain.token_ids
    for a, b in zip(via.logprobs, plain.logprobs, strict=True):
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        torch.testing.assert_close([lp for _, lp in a.top], [lp for _, lp in b.top], atol=1e-5, rtol=0)
