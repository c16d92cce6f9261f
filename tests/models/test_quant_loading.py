"""`load_decoder` at 8 and 4 bits: tiny decoders agree with float32 on greedy tokens, GGUF files are served at their
own precision (rows of blocks un-permuted, equal to the dequantised float path), and no float copy is ever held."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from support.checkpoints import make_checkpoint
from support.gguf_writer import write_gguf

from omnivox.benchmarks.quality import SequenceCache, greedy
from omnivox.models import quant
from omnivox.models.loading import GGUFBlocks, _PendingLinear, load_decoder

T = gguf.GGMLQuantizationType
PROMPTS = [[5, 17, 33, 9], [100, 4, 250, 61, 7, 7], [3], [301, 302, 303, 304, 305, 306, 307, 308]]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """The GGUF metadata of the files these tests write goes to a private cache, not the user's."""
    monkeypatch.setenv("OMNIVOX_CACHE", str(tmp_path / "omnivox-cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", seed=3)


def _logits(model, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    with torch.inference_mode():
        return SequenceCache(model, len(ids)).forward(model, ids)


def _agreement(reference, other, margin: float) -> tuple[int, int]:
    """Teacher-forced on float32's own greedy continuation: positions where float32's top-2 margin exceeds `margin`,
    and how many of them the other model also ranks first."""
    agree = total = 0
    for prompt in PROMPTS:
        ids = prompt + greedy(reference, prompt, 16)
        ref, got = _logits(reference, ids)[len(prompt) - 1 : -1], _logits(other, ids)[len(prompt) - 1 : -1]
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > margin
        total += int(clear.sum())
        agree += int((got.argmax(-1) == ref.argmax(-1))[clear].sum())
    return agree, total


@pytest.mark.parametrize(
    ("mode", "margin", "bound"),
    # Measured on this random tiny llama (4 prompts x 16 tokens, teacher-forced on float32's greedy tokens): int8
    # agrees at 40/40 positions where float32's top-2 margin is > 0.02 (59/64 over all positions), int4 at 26/27
    # where it is > 0.05 (34/40 above 0.02, 43/64 over all). Random tiny models have small margins; 4-bit weights
    # move these logits by ~0.02-0.05.
    [("int8", 0.02, 0.95), ("int4", 0.05, 0.85)],
)
def test_quantised_tiny_decoder_agrees_with_float(tiny, mode, margin, bound):
    reference = load_decoder(tiny, quantization="none")
    model = load_decoder(tiny, quantization=mode)
    assert all(isinstance(layer.mlp.down_proj, quant.Int8Linear | quant.Int4Linear) for layer in model.layers)
    agree, total = _agreement(reference, model, margin)
    assert total >= 20
    assert agree >= bound * total, f"{mode}: {agree}/{total} clear-margin positions agree with float32"


def test_load_time_quantisation_equals_quantize_decoder(tiny):
    """Quantising tensor by tensor while loading gives the same model as quantising a loaded float model."""
    loaded = load_decoder(tiny, quantization="int4", quantize_lm_head=True)
    converted = quant.quantize_decoder(load_decoder(tiny, quantization="none"), "int4", quantize_lm_head=True)
    ids = PROMPTS[1]
    torch.testing.assert_close(_logits(loaded, ids), _logits(converted, ids), rtol=0, atol=0)


def test_float_load_equals_the_engine_loader(tiny):
    from omnivox.engine import Engine

    ours = load_decoder(tiny, quantization="none")
    engine = Engine.from_pretrained(tiny, device="cpu", kv_cache_gib=0.01)
    for (name, a), (_, b) in zip(ours.state_dict().items(), engine.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------------------------------
# GGUF at its own precision


def _qkv_blocks_equal_float_rows(native, dequantised) -> None:
    for ln, lf in zip(native.layers, dequantised.layers, strict=True):
        for qmod, fmod in ((ln.self_attn.qkv_proj, lf.self_attn.qkv_proj), (ln.mlp.gate_up_proj, lf.mlp.gate_up_proj)):
            w = fmod.weight.detach()
            if isinstance(qmod, quant.Int4Linear):  # 4-bit blocks carried over: exactly the dequantised values
                assert torch.equal(quant.dequantize_q4(qmod.blocks, w.shape[1]), w)


@pytest.mark.parametrize(
    ("family", "qtype", "layer_kind"),
    [("llama", T.Q4_0, quant.Int4Linear), ("llama", T.Q4_1, quant.Int4Linear), ("qwen2", T.Q8_0, quant.Int8Linear)],
)
def test_gguf_served_at_own_precision(tmp_path, family, qtype, layer_kind):
    hf = make_checkpoint(tmp_path / "hf", family, seed=1, tie_word_embeddings=True)
    names = [f"blk.{i}.{n}.weight" for i in range(2) for n in ("attn_q", "attn_k", "attn_v", "attn_output")]
    names += [f"blk.{i}.{n}.weight" for i in range(2) for n in ("ffn_gate", "ffn_up", "ffn_down")]
    path = write_gguf(
        hf, tmp_path / f"tiny.{qtype.name}.gguf", {**dict.fromkeys(names, qtype), "token_embd.weight": T.Q8_0}
    )
    native = load_decoder(path)
    dequantised = load_decoder(path, quantization="none")
    assert isinstance(native.layers[0].self_attn.qkv_proj, layer_kind)
    assert isinstance(native.layers[1].mlp.down_proj, layer_kind)
    assert isinstance(native.lm_head, quant.Int8Linear)  # the Q8_0 tied embedding: int8 output + int8 lookup
    assert isinstance(native.embed_tokens, quant.Int8Embedding)
    # rows of blocks un-permuted exactly as the float path un-permutes values (Q/K of llama)
    _qkv_blocks_equal_float_rows(native, dequantised)
    # and the whole model computes what the dequantised float model does, up to int16 activations (and, for Q8_0,
    # the per-channel requantisation): measured 1-3 % relative error on the logits here
    ids = list(range(3, 40))
    a, b = _logits(native, ids), _logits(dequantised, ids)
    assert float((a - b).norm() / b.norm()) < 0.06
    # no float32 matrix is held: quantised bytes only (norms and rotary tables aside)
    float_bytes = quant.weight_bytes(dequantised)
    assert quant.weight_bytes(native) < 0.5 * float_bytes


def test_q4_k_and_q6_k_blocks_convert_within_half_a_level():
    rng = np.random.default_rng(0)

    def blocks(qtype: T, n: int, k: int, head: slice) -> GGUFBlocks:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(n, k // block * size), dtype=np.uint8)
        raw = raw.reshape(n, k // block, size)
        raw[..., head] = np.array([0.01], dtype=np.float16).view(np.uint8)  # a finite super-block scale d
        return GGUFBlocks(int(qtype), raw.reshape(n, -1), (n, k))

    q4k = blocks(T.Q4_K, 8, 512, slice(0, 2))
    q4k.raw.reshape(8, 2, 144)[..., 2:4] = np.array([0.02], dtype=np.float16).view(np.uint8)  # dmin
    want = q4k.dequantize()
    got = quant.dequantize_q4(q4k.as_int4(), 512)
    step = (want.view(8, -1, 32).amax(-1) - want.view(8, -1, 32).amin(-1)) / 15
    assert ((got - want).abs().view(8, -1, 32) <= step[..., None] * 0.5 + 1e-3).all()

    q6k = blocks(T.Q6_K, 4, 256, slice(208, 210))
    layer = _PendingLinear(256, {"": 4}, False, None)
    layer.load_part("", "weight", q6k)
    int8 = layer.build(torch.device("cpu"), torch.float32)
    assert isinstance(int8, quant.Int8Linear)
    x = torch.randn(2, 256)
    ref = x @ q6k.dequantize().T
    with torch.inference_mode():
        assert float((int8(x) - ref).norm() / ref.norm()) < 0.04


# ---------------------------------------------------------------------------------------------------------------------
# The embedded default: memory at its own precision

_PROBE = textwrap.dedent(
    """
    import sys
    from omnivox.models.loading import load_decoder
    from omnivox.models.quant import weight_bytes
    load_decoder(sys.argv[2])  # lazy imports and the GGUF metadata cache are not loading
    def peak_mib():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = peak_mib()
    model = load_decoder(sys.argv[1])
    print(weight_bytes(model) / 2**20, peak_mib() - before)
    """
)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak-RSS reset needs Linux /proc")
def test_default_model_at_own_precision_under_40_percent_of_float32(default_gguf, tmp_path):
    from omnivox.models.checkpoint import load_hf_config
    from omnivox.models.config import ModelConfig

    cfg = ModelConfig.from_hf(load_hf_config(default_gguf))
    layer = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    layer += cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    float32_mib = 4 * (cfg.num_layers * layer + cfg.vocab_size * cfg.hidden_size) / 2**20  # tied: one vocab matrix
    tiny = write_gguf(make_checkpoint(tmp_path / "hf", "llama"), tmp_path / "tiny.gguf", {})
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(default_gguf), str(tiny)], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    held, growth = map(float, out.stdout.split())
    # measured: 92 MiB held (Q4_1 layers, one Q8_0 matrix for output and embedding), loading peak +106 MiB, against
    # 513 MiB of float32 weights
    assert held < 0.3 * float32_mib
    assert growth < 0.4 * float32_mib, f"loading grew {growth:.0f} MiB; float32 weights are {float32_mib:.0f} MiB"


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_engine_serves_a_quantised_decoder(tiny, mode):
    """The engine takes a quantised model as it is (what `Engine.from_pretrained(..., quantization=)` will build)."""
    from omnivox.engine import Engine, SamplingParams

    model = load_decoder(tiny, quantization=mode, quantize_lm_head=True)
    engine = Engine(model, None, kv_cache_gib=0.01)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = engine.generate(PROMPTS[:3], [params] * 3)
    for prompt, out in zip(PROMPTS[:3], outs, strict=True):
        assert list(out.token_ids) == greedy(model, prompt, 8)
