"""The config knobs real checkpoints of our decoder families use, each on a tiny random checkpoint saved with
save_pretrained: our engine against transformers (greedy tokens and top-5 log-probabilities), a clear refusal at load
naming the config key where we do not compute what transformers does, and one variant per family through gRPC."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from support.checkpoints import load_reference, make_checkpoint, reference_greedy
from support.decoder_parity import LONG, MID, SHORT, STEPS, XL, assert_matches
from support.engines import tiny_engine
from support.service_harness import ServerThread, user_request

from omnivox.engine import SamplingParams
from omnivox.models.config import ModelConfig
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import generation_pb2_grpc

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
# head_dim 16 in the tiny configs: 8 frequencies, one factor each (Phi-3 style lists)
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + 0.5 * i for i in range(8)],
    "original_max_position_embeddings": 32,
}
LLAMA3 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # fmt: skip


def rope(theta: float = 10000.0, **params) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **params}}


# id -> (family, checkpoint overrides, engine kwargs, prompts compared)
CASES = {
    "llama-rope-linear": ("llama", rope(rope_type="linear", factor=2.0), {}, (SHORT, LONG)),
    "llama-rope-yarn": ("llama", rope(**YARN), {}, (SHORT, LONG)),
    "llama-rope-yarn-factors": (
        "llama", rope(**YARN, attention_factor=1.3, beta_fast=16.0, beta_slow=2.0), {}, (SHORT, LONG)),
    "qwen3-rope-yarn-theta1e6": ("qwen3", rope(1e6, **YARN), {}, (SHORT, LONG)),
    "qwen2-rope-yarn-legacy-keys": ("qwen2", {"legacy_rope": {"type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 64}, "rope_theta": 1e6}, {}, (SHORT, LONG)),
    "llama-rope-llama3-legacy-keys": ("llama", {"legacy_rope": LLAMA3, "rope_theta": 500000.0}, {}, (SHORT, LONG)),
    "mistral-legacy-theta-1e6-no-scaling": ("mistral", {"legacy_rope": None, "rope_theta": 1e6}, {}, (SHORT, LONG)),
    # longrope: one factor set for every position, picked by the served length (models/layers.py)
    "llama-rope-longrope-served-short": ("llama", rope(**LONGROPE), {"max_model_len": 32}, ([1, 5, 9, 33, 17],)),
    "llama-rope-longrope-served-long": ("llama", rope(**LONGROPE), {}, (LONG,)),
    "llama-rope-theta1e6": ("llama", rope(1e6), {}, (SHORT, LONG)),
    "llama-head-dim-32": ("llama", {"head_dim": 32}, {}, (SHORT, LONG)),
    "mistral-nemo-head-dim-32-tied": ("mistral", {"head_dim": 32, "tie_word_embeddings": True}, {}, (SHORT, LONG)),
    "llama-mqa-8-heads-odd-vocab": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 1,
                                    "vocab_size": 389}, {}, (SHORT, LONG)),
    "qwen2-gqa4-odd-vocab-tied": ("qwen2", {"num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 391,
                                  "tie_word_embeddings": True}, {}, (SHORT, LONG)),
    "qwen3-gqa8-odd-vocab-tied": ("qwen3", {"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 8,
                                  "vocab_size": 397, "tie_word_embeddings": True}, {}, (SHORT, LONG)),
    "llama-attention-and-mlp-bias-eps1e-5": ("llama", {"attention_bias": True, "mlp_bias": True,
                                             "rms_norm_eps": 1e-5}, {}, (SHORT, LONG)),
    "qwen3-attention-bias-head-dim-16": ("qwen3", {"attention_bias": True, "head_dim": 16}, {}, (SHORT, LONG)),
    "llama-saved-bfloat16": ("llama", {"dtype": torch.bfloat16}, {}, (SHORT, LONG)),
    "qwen2-saved-float16": ("qwen2", {"dtype": torch.float16}, {}, (SHORT, LONG)),
    "qwen3-sharded-safetensors": ("qwen3", {"max_shard_size": "40KB"}, {}, (SHORT, LONG)),
    "llama-no-bos-eos-pad": ("llama", {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}, {},
                             (SHORT,)),
    # sliding windows shorter than the prompts: MID's decode crosses the window, LONG and XL prefill past it (8-token
    # chunks, or whole) and decode over more blocks than the window touches, SHORT stays inside; rows of all kinds
    # decode batched together
    "mistral-window-20-chunked-prefill": ("mistral", {"sliding_window": 20}, {"max_num_batched_tokens": 8},
                                          (SHORT, MID, XL)),
    "mistral-window-16-whole-prompt": ("mistral", {"sliding_window": 16}, {}, (MID, LONG)),
    "qwen2-sliding-window-layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 20,
                                    "max_window_layers": 1}, {"max_num_batched_tokens": 8}, (SHORT, MID, XL)),
    "qwen3-layer-types-mixed": ("qwen3", {"use_sliding_window": True, "sliding_window": 20,
                                "layer_types": ["sliding_attention", "full_attention"]},
                                {"max_num_batched_tokens": 8}, (MID, LONG)),
}  # fmt: skip


def build(root: Path, name: str, family: str, overrides: dict) -> Path:
    """The case's checkpoint; `legacy_rope` rewrites config.json with the pre-transformers-5 keys (`rope_scaling`
    with "type", top-level `rope_theta`) that most hub checkpoints still carry."""
    overrides = dict(overrides)
    rewrite = "legacy_rope" in overrides
    legacy = overrides.pop("legacy_rope", None)
    theta = overrides.pop("rope_theta", None) if rewrite else None
    path = make_checkpoint(root / name, family, seed=7, with_tokenizer=False, **overrides)
    if rewrite:
        config = json.loads((path / "config.json").read_text())
        config.pop("rope_parameters", None)
        config |= {"rope_scaling": legacy, "rope_theta": theta}
        (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sweep")


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_transformers(root, case):
    family, overrides, engine_kwargs, prompts = CASES[case]
    path = build(root, case, family, overrides)
    engine = tiny_engine(path, **engine_kwargs)
    assert_matches(engine, load_reference(path), prompts)


def test_sliding_window_under_ngram_drafts(root):
    """Drafts are verified as multi-token chunks, past the window here; greedy output stays transformers'."""
    path = build(root, "window-ngram", "mistral", {"sliding_window": 20})
    engine = tiny_engine(path, speculative="ngram")
    drafted: list[int] = []
    engine.step_observers.append(lambda result: drafted.append(result.stats.num_drafted))
    ref = load_reference(path)
    ref.generation_config.eos_token_id = None
    prompts = [[5, 6, 7, 8, 9] * 8, XL]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))  # no logprobs:
    assert sum(drafted) > 0  # they turn drafting off
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference_greedy(ref, prompt, 24)[0]


def test_sliding_window_serves_the_whole_length(root):
    """A window masks keys, it does not shorten what we serve; the layers that slide are the ones transformers
    slides. Qwen2's window with use_sliding_window false (every Qwen2.5 / Qwen3 release) is full attention."""
    cases = {"mistral": ((0, 1), "mistral-window-20-chunked-prefill"), "qwen2": ((1,), "qwen2-sliding-window-layers"),
             "qwen3": ((0,), "qwen3-layer-types-mixed")}  # fmt: skip
    for family, (sliding, case) in cases.items():
        engine = tiny_engine(build(root, f"window-{family}", family, CASES[case][1]))
        cfg = engine.model_config
        assert (cfg.max_model_len, cfg.sliding_window, cfg.sliding_layers) == (512, 20, sliding)
    off = build(root, "qwen2-window-off", "qwen2", {"use_sliding_window": False, "sliding_window": 48})
    cfg = tiny_engine(off).model_config
    assert (cfg.max_model_len, cfg.sliding_window, cfg.sliding_layers) == (512, None, ())


REFUSED = {
    "dynamic rope": ("llama", rope(rope_type="dynamic", factor=2.0), "rope_type"),
    "partial rotary": ("llama", rope(partial_rotary_factor=0.5), "partial_rotary_factor"),
    "gelu": ("llama", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
    "relu2 qwen3": ("qwen3", {"hidden_act": "relu2"}, "hidden_act"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_config_is_refused_at_load_naming_the_key(root, case):
    family, overrides, key = REFUSED[case]
    path = build(root, "refused-" + case.replace(" ", "-"), family, overrides)
    with pytest.raises(ValueError, match=key):
        tiny_engine(path)


def test_generation_config_eos_list_stops_on_any(root):
    """Llama 3 instruct style: config.json names one eos, generation_config.json a list; like transformers' generate,
    the engine stops on whichever of the list comes first, and not on config.json's one."""
    path = build(root, "eos-list", "llama", {})
    ref = load_reference(path)
    free, _ = reference_greedy(ref, SHORT, 12)
    first = free[4]  # an id that first appears at step 4
    if first in free[:4]:
        pytest.skip("the random checkpoint repeats its early tokens")  # seed 7: never taken
    never = next(t for t in range(3, 384) if t not in free)
    gen = {"eos_token_id": [never, first], "bos_token_id": 1}
    (path / "generation_config.json").write_text(json.dumps(gen))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"eos_token_id": free[1]}))  # replaced by the list
    engine = tiny_engine(path)
    assert set(engine.model_config.eos_token_ids) == {never, first}
    out = engine.generate([SHORT], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.token_ids == free[:5] and out.finish_reason == "stop"
    theirs = load_reference(path).generate(torch.tensor([SHORT]), max_new_tokens=12, do_sample=False)
    assert theirs[0, len(SHORT) :].tolist() == out.token_ids


# One variant per family through the gRPC server: the prompt the service builds (ChatML, tests/support/checkpoints.py).
GRPC = {
    "llama": "llama-rope-yarn-factors",
    "qwen2": "qwen2-sliding-window-layers",
    "qwen3": "qwen3-gqa8-odd-vocab-tied",
    "mistral": "mistral-nemo-head-dim-32-tied",
}


def test_grpc_greedy_matches_transformers(root):
    paths = {}
    for family, case in GRPC.items():
        overrides = CASES[case][1]
        paths[family] = make_checkpoint(root / f"grpc-{family}", family, seed=7, **overrides)
    text = "The capital of France is Paris. The capital of Italy is"  # past qwen2's window of 20
    specs = [ModelSpec(path=p, name=f) for f, p in paths.items()]
    with ServerThread(specs, EngineOptions(kv_cache_gib=0.01, max_num_batched_tokens=8)) as server:
        stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
        for family, path in paths.items():
            request = user_request(text, model=family, max_output_tokens=STEPS, ignore_eos=True)
            request.sampling.temperature = 0.0
            ours = [t for r in stub.Generate(request, timeout=60) if r.WhichOneof("response") == "delta"
                    for t in r.delta.token_ids]  # fmt: skip
            tok = transformers.AutoTokenizer.from_pretrained(path)
            prompt = tok.encode(
                f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
            )
            assert len(prompt) > 20
            ref = load_reference(path)
            ref.generation_config.eos_token_id = None
            assert ours == reference_greedy(ref, prompt, STEPS)[0], family


def test_multimodal_text_configs_as_released():
    """The text decoders of the vision / audio checkpoints read the same knobs: Qwen2.5-VL as released (legacy
    `rope_scaling` {"type": "mrope"}, a 32768 window that use_sliding_window false turns off) has no window;
    LLaVA-NeXT-Mistral's text config slides every layer; Qwen2-Audio's Qwen2 text rejects gelu."""
    from transformers import LlavaNextConfig, Qwen2_5_VLConfig, Qwen2AudioConfig

    text = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}  # fmt: skip
    vl = Qwen2_5_VLConfig(text_config={**text, "use_sliding_window": False, "sliding_window": 32768,
                          "max_window_layers": 28, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                          "rope_theta": 1e6})  # fmt: skip
    cfg = ModelConfig.from_hf(vl)
    assert (cfg.family, cfg.max_model_len) == ("qwen2", 4096)
    assert ModelConfig.from_hf(vl).sliding_window is None
    llava = LlavaNextConfig(text_config={**text, "model_type": "mistral", "sliding_window": 1024})
    assert (ModelConfig.from_hf(llava).sliding_window, ModelConfig.from_hf(llava).sliding_layers) == (1024, (0, 1))
    audio = Qwen2AudioConfig(text_config={**text, "model_type": "qwen2", "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf(audio)


def test_a_family_we_do_not_serve_is_named_with_what_we_do():
    """A Qwen2-VL folder (then not served) was refused listing only the three text decoders, as if no image model
    were served: the refusal names its model_type and every family omnivox serves. Qwen3-VL is not served (yet)."""
    from transformers import Qwen3VLConfig

    cfg = Qwen3VLConfig(text_config={"vocab_size": 384, "hidden_size": 64, "num_attention_heads": 4}, architectures=["Qwen3VLForConditionalGeneration"])  # fmt: skip
    with pytest.raises(ValueError) as info:
        ModelConfig.from_hf(cfg)
    message = str(info.value)
    assert "Qwen3VLForConditionalGeneration" in message and "'qwen3_vl'" in message
    names = ("qwen2_vl", "qwen2_5_vl", "llava_next", "smolvlm", "qwen2_audio", "LlamaForCausalLM")
    assert all(name in message for name in names)


# Whisper's decoder (and encoder) under the shapes its releases use: distil-whisper (fewer decoder layers and heads
# than the encoder's), large-v3 (128 mel bins, a vocabulary that is no multiple of 8), and an untied output
# projection with scale_embedding (which transformers' Whisper defines but never applies, nor do we).
WHISPER = {
    "distil-odd-vocab": dict(decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=96, vocab_size=301),
    "large-v3-mels": dict(num_mel_bins=128, vocab_size=333),
    "untied-scale-embedding-8-heads": dict(tie_word_embeddings=False, scale_embedding=True,
                                           encoder_attention_heads=8, decoder_attention_heads=8),
}  # fmt: skip


@pytest.mark.parametrize("case", list(WHISPER))
def test_whisper_matches_transformers(root, case):
    from support.whisper_checkpoints import BLOCK, _Seq, _step, tiny_whisper_config
    from transformers import WhisperForConditionalGeneration

    from omnivox.models.audio.whisper import load_whisper

    torch.manual_seed(0)
    hf = WhisperForConditionalGeneration(tiny_whisper_config(**WHISPER[case])).eval()
    if not hf.config.tie_word_embeddings:
        with torch.no_grad():
            hf.proj_out.weight.normal_(0, 0.1)
    hf.save_pretrained(root / f"whisper-{case}")
    model = load_whisper(str(root / f"whisper-{case}"))
    cfg = model.config
    features = torch.randn(1, hf.config.num_mel_bins, 3000)
    with torch.no_grad():
        torch.testing.assert_close(
            model.encode(features), hf.model.encoder(features).last_hidden_state, atol=1e-5, rtol=0
        )
    shape = (3 * BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    seq = _Seq([2, 10, 11, 12], [0, 1, 2], model.encode_cross(features)[0])
    _step(model, caches, [], [(seq, 4)])
    while len(seq.tokens) < 20:  # decode rows through the paged cache
        _step(model, caches, [seq], [])
    with torch.no_grad():
        ref = hf(input_features=features, decoder_input_ids=torch.tensor([seq.tokens[:-1]])).logits[0]
    torch.testing.assert_close(torch.stack([seq.logits[p] for p in range(len(seq.tokens) - 1)]), ref, atol=1e-4, rtol=0)
    assert seq.tokens[4:] == ref[3:].argmax(-1).tolist()


def test_whisper_activation_refused_naming_the_key(root):
    from support.whisper_checkpoints import tiny_whisper_config

    from omnivox.models.audio.whisper import whisper_model_config

    with pytest.raises(ValueError, match="activation_function"):
        whisper_model_config(tiny_whisper_config(activation_function="relu"))


def test_sliding_window_benchmark_runs(tmp_path):
    from omnivox.benchmarks import sliding_window

    out = tmp_path / "window.json"
    sliding_window.main(["--context", "40", "--window", "16", "--steps", "2", "--batch", "1", "--repeats", "1",
                         "--hidden", "64", "--layers", "1", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert (
        set(result["decode_ms_per_step_median"]) == {"full", "windowed"} and "1" in result["ratio_windowed_over_full"]
    )


@pytest.mark.parametrize("window", [1, 5, 16, 20, 100])
def test_windowed_decode_kernels_agree_with_a_plain_reference(window):
    """The C kernel (CPU float32: decode rows and the fused step) and the gathered path (CUDA, other dtypes) against
    softmax over each query's last `window` keys written out, on scattered blocks and lengths around the window."""
    from omnivox.models import cpu_kernels
    from omnivox.models.attention import AttentionMetadata, _decode_attention_gathered

    torch.manual_seed(window)
    bs, kvh, h, d, blocks = 4, 2, 6, 8, 40
    k_cache, v_cache = torch.randn(blocks * bs, kvh, d), torch.randn(blocks * bs, kvh, d)
    lens = torch.tensor([1, window, window + 1, 37, 90])
    width = -(-int(lens.max()) // bs)
    tables = torch.stack([torch.randperm(blocks)[:width] for _ in lens])  # each row's blocks, scattered
    q = torch.randn(len(lens), h, d)
    want = []
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - window), n)
        slots = tables[b, pos // bs] * bs + pos % bs
        k = k_cache[slots].repeat_interleave(h // kvh, dim=1)  # [n, H, D]
        v = v_cache[slots].repeat_interleave(h // kvh, dim=1)
        p = (torch.einsum("hd,nhd->hn", q[b], k) * 0.3).softmax(-1)
        want.append(torch.einsum("hn,nhd->hd", p, v))
    want = torch.stack(want)
    mask = (torch.arange(width * bs)[None, :] < lens[:, None]).view(len(lens), 1, 1, -1)
    meta = AttentionMetadata(bs, torch.zeros(0, dtype=torch.long), len(lens), tables, mask, lens, [])
    torch.testing.assert_close(_decode_attention_gathered(q, k_cache, v_cache, meta, 0.3, window), want)
    if cpu_kernels.kernel_available():
        got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, bs, 0.3, window)
        torch.testing.assert_close(got, want)
