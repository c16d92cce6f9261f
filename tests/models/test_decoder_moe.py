"""Mixture-of-experts decoders (models/moe.py): Qwen3-MoE, Mixtral and Qwen2-MoE against transformers' own
implementation on tiny random checkpoints saved with save_pretrained: greedy tokens (model.generate) and top-5
log-probabilities, prefill whole and in chunks, paged decode (batch-1 and batched), dense layers among sparse ones,
the streaming loader, refusals of the paths that take no experts (int8 / int4, tensor parallel), and one Generate per
family through gRPC with a chat template. MoE GGUF files: test_gguf_moe.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers
from support.checkpoints import load_reference, make_checkpoint
from support.decoder_parity import LONG, MID, SHORT, XL, assert_matches
from support.engines import tiny_engine
from support.service_harness import served_greedy_equals_generate

from omnivox.engine import SamplingParams
from omnivox.models import quant
from omnivox.models.config import ModelConfig, served_families
from omnivox.models.layers import Linear
from omnivox.models.loading import load_decoder

# id -> (family, checkpoint overrides, engine kwargs, prompts compared)
CASES = {
    # Qwen3-30B-A3B's routing (norm_topk_prob true), every layer sparse, 8-token prefill chunks
    "qwen3-moe-chunked": ("qwen3_moe", {}, {"max_num_batched_tokens": 8}, (SHORT, MID, XL)),
    # layer 0 dense (mlp_only_layers), top-3 weights not renormalised
    "qwen3-moe-dense-layer-top3-unnormalised": (
        "qwen3_moe", {"mlp_only_layers": [0], "norm_topk_prob": False, "num_experts_per_tok": 3}, {}, (MID, LONG)
    ),
    # Mixtral: softmax, top-2, renormalised; a window of 20 on every layer, decode past it
    "mixtral-window-20-chunked": ("mixtral", {"sliding_window": 20}, {"max_num_batched_tokens": 8}, (SHORT, XL)),
    "mixtral-top1-of-4": ("mixtral", {"num_experts_per_tok": 1}, {}, (MID,)),
    # Qwen2-MoE: shared expert with its sigmoid gate, q/k/v biases; decoder_sparse_step 2 makes layer 0 dense
    "qwen2-moe-shared-expert-sparse-step-2": ("qwen2_moe", {"decoder_sparse_step": 2}, {}, (SHORT, LONG)),
}  # fmt: skip


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("moe")


@pytest.fixture(scope="module")
def paths(root) -> dict[str, Path]:
    return {
        case: make_checkpoint(root / case, family, seed=7, with_tokenizer=False, **overrides)
        for case, (family, overrides, _, _) in CASES.items()
    }


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_transformers(paths, case):
    _, _, engine_kwargs, prompts = CASES[case]
    engine = tiny_engine(paths[case], **engine_kwargs)
    assert_matches(engine, load_reference(paths[case]), prompts)


def test_static_decode_twin_equals_dynamic_path(paths):
    """The padded fixed-shape decode step run eagerly (CUDA graphs are not captured for MoE layers: they read their
    per-expert row counts on the host): padded rows are routed too, yet the real rows' tokens and log-probabilities
    equal the dynamic path's, batched with distinct prompts."""
    from omnivox.engine import SamplingParams

    path = paths["qwen2-moe-shared-expert-sparse-step-2"]
    static = tiny_engine(path, static_decode=True, max_num_seqs=4)
    assert static.runner.static is not None and not static.runner.static.use_graphs
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [SHORT, MID, LONG]  # 3 requests padded to a batch bucket of 4
    a, b = static.generate(prompts, params), tiny_engine(path).generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b] and static.runner.static.num_runs >= 7
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(
            torch.tensor([lp.logprob for lp in x.logprobs]), torch.tensor([lp.logprob for lp in y.logprobs])
        )
    static.check_integrity()


def test_configs_read_as_released(paths):
    """Which layers are sparse, each expert's size, the routing flags."""
    read = {case: ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(p)) for case, p in paths.items()}
    moe = read["qwen3-moe-chunked"].moe
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size, moe.norm_topk_prob) == (8, 2, 32, True)
    assert (moe.sparse_layers, read["qwen3-moe-chunked"].qk_norm) == ((0, 1), True)
    assert read["qwen3-moe-dense-layer-top3-unnormalised"].moe.sparse_layers == (1,)
    mixtral = read["mixtral-window-20-chunked"]
    assert (mixtral.moe.num_experts, mixtral.moe.expert_intermediate_size, mixtral.moe.norm_topk_prob) == (4, 48, True)
    assert (mixtral.moe.float32_weights, mixtral.window_everywhere) == (True, 20)
    qwen2 = read["qwen2-moe-shared-expert-sparse-step-2"]
    assert (qwen2.moe.sparse_layers, qwen2.moe.shared_expert_intermediate_size) == ((1,), 48)
    assert (qwen2.attention_bias, qwen2.o_proj_bias) == (True, False)
    for arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"):
        assert arch in served_families()


def test_streaming_loader_equals_the_engine_loader_and_quantises_each_expert(paths):
    """load_decoder (the streaming loader) stacks the experts as the engine's does; int8 / int4 at load quantise each
    expert's matrices as they arrive, equal to quantising the loaded float model, routers kept float; the int8
    model's logits are the float model's on its dequantised weights (the decode kernel's rounding apart)."""
    from omnivox.models.moe import QuantizedExperts

    path = paths["qwen2-moe-shared-expert-sparse-step-2"]
    engine = tiny_engine(path)
    ours = load_decoder(path, quantization="none")
    for (name, a), (_, b) in zip(ours.state_dict().items(), engine.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    for mode in ("int8", "int4"):
        loaded = load_decoder(path, quantization=mode)
        converted = quant.quantize_decoder(load_decoder(path, quantization="none"), mode)
        assert loaded.state_dict().keys() == converted.state_dict().keys()
        for (name, a), (_, b) in zip(loaded.state_dict().items(), converted.state_dict().items(), strict=True):
            assert torch.equal(a, b), (mode, name)
        mlp = loaded.layers[1].mlp
        assert isinstance(mlp.experts, QuantizedExperts) and type(mlp.gate) is Linear
        assert type(mlp.shared_expert_gate) is Linear and not isinstance(mlp.shared_expert.down_proj, Linear)
    int8 = tiny_engine(path, quantization="int8")
    assert isinstance(int8.model.layers[1].mlp.experts, QuantizedExperts)
    assert len(int8.generate([XL], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids) == 4
    # our float MoE block on the int8 weights, dequantised: the same outputs
    q, f = int8.model.layers[1].mlp, ours.layers[1].mlp
    with torch.no_grad():
        for e in range(q.experts.num_experts):
            f.experts.gate_up_proj[e].copy_(q.experts.gate_up[e].dequantize())
            f.experts.down_proj[e].copy_(q.experts.down[e].dequantize())
        f.shared_expert.gate_up_proj.weight.copy_(q.shared_expert.gate_up_proj.dequantize())
        f.shared_expert.down_proj.weight.copy_(q.shared_expert.down_proj.dequantize())
    x = torch.randn(5, ours.config.hidden_size)
    torch.testing.assert_close(q(x), f(x), atol=2e-3, rtol=1e-2)


def test_stacked_expert_checkpoint_loads_and_a_missing_expert_is_named(paths, tmp_path):
    """transformers 5's in-memory layout (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]) loads as is; a
    checkpoint missing one expert's matrix is refused naming it."""
    from safetensors.torch import load_file, save_file

    src = paths["mixtral-top1-of-4"]
    tensors = load_file(src / "model.safetensors")
    stacked = dict(tensors)
    for layer in range(2):
        pre = f"model.layers.{layer}.block_sparse_moe.experts"
        w = [[stacked.pop(f"{pre}.{e}.{p}.weight") for e in range(4)] for p in ("w1", "w3", "w2")]
        stacked[f"{pre}.gate_up_proj"] = torch.stack([torch.cat((g, u)) for g, u in zip(w[0], w[1], strict=True)])
        stacked[f"{pre}.down_proj"] = torch.stack(w[2])
    want = tiny_engine(src).model.state_dict()
    for name, drop in (("stacked", None), ("missing", "model.layers.1.block_sparse_moe.experts.3.w3.weight")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text((src / "config.json").read_text())
        save_file(
            stacked if drop is None else {k: v for k, v in tensors.items() if k != drop}, folder / "model.safetensors"
        )
        if drop is None:
            got = tiny_engine(folder).model.state_dict()
            assert all(torch.equal(got[k], want[k]) for k in want)
        else:
            with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.3\.up_proj"):
                tiny_engine(folder)


def test_two_tensor_parallel_ranks_equal_one_process(paths):
    """Each expert's intermediate dimension sharded over 2 ranks (engine/tensor_parallel.py, load_shard): Qwen3-MoE
    with a dense layer among the sparse ones, greedy tokens and KV caches equal to one process."""
    from support.tensor_parallel import two_ranks_equal_one

    from omnivox.models.tensor_parallel import check_divisible

    two_ranks_equal_one(paths["qwen3-moe-dense-layer-top3-unnormalised"], 12)
    cfg = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(paths["qwen2-moe-shared-expert-sparse-step-2"]))
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_intermediate_size=30))
    with pytest.raises(
        ValueError, match=r"--tensor-parallel 4 does not divide the model's expert intermediate size \(30\)"
    ):
        check_divisible(cfg, 4)


def test_grpc_greedy_matches_transformers(root):
    """One Generate per MoE family through a real server: the ChatML prompt the service builds, greedy tokens as
    transformers' generate gives them."""
    paths = {
        family: make_checkpoint(root / f"grpc-{family}", family, seed=3, with_tokenizer=True)
        for family in ("qwen3_moe", "mixtral", "qwen2_moe")
    }
    served_greedy_equals_generate(paths)


BLOCKS = {
    "mixtral": ("MixtralConfig", "mixtral.modeling_mixtral.MixtralSparseMoeBlock", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock", "Qwen2MoeForCausalLM"),
}


@pytest.mark.cpu_paths
@pytest.mark.parametrize("family", list(BLOCKS))
def test_sparse_block_equals_transformers_float32_within_rounding_bf16_bitwise(family):
    """Our SparseMoeBlock against transformers' own on 37 rows and on 1, in float32 (within 1e-5) and bf16 (bit for bit): the routing weights'
    dtype differs by family (Mixtral scales expert outputs by float32 weights, Qwen by model-dtype ones; red in
    bf16 with Mixtral's weights rounded first)."""
    import importlib

    from omnivox.models.decoder import make_mlp

    config_name, block_path, arch = BLOCKS[family]
    module, _, block_name = block_path.rpartition(".")
    block_cls = getattr(importlib.import_module(f"transformers.models.{module}"), block_name)
    experts_key = "num_local_experts" if family == "mixtral" else "num_experts"
    hf = getattr(transformers, config_name)(
        architectures=[arch], hidden_size=64, intermediate_size=64, moe_intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_experts_per_tok=2, shared_expert_intermediate_size=64, **{experts_key: 8},
    )  # fmt: skip
    torch.manual_seed(0)
    ref = block_cls(hf)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = make_mlp(ModelConfig.from_hf(hf), 0)
    sd = ref.state_dict()
    with torch.no_grad():
        ours.gate.weight.copy_(sd["gate.weight"])
        ours.experts.gate_up_proj.copy_(sd["experts.gate_up_proj"])
        ours.experts.down_proj.copy_(sd["experts.down_proj"])
        if family == "qwen2_moe":
            ours.shared_expert_gate.weight.copy_(sd["shared_expert_gate.weight"])
            shared = torch.cat([sd["shared_expert.gate_proj.weight"], sd["shared_expert.up_proj.weight"]])
            ours.shared_expert.gate_up_proj.weight.copy_(shared)
            ours.shared_expert.down_proj.weight.copy_(sd["shared_expert.down_proj.weight"])
    for rows in (37, 1):  # one row: the batch-1 decode path (no grouping)
        x = torch.randn(1, rows, 64)
        for dtype in (torch.float32, torch.bfloat16):
            with torch.no_grad():
                want = ref.to(dtype)(x.to(dtype))
                got = ours.to(dtype)(x[0].to(dtype))
            if dtype == torch.float32:
                # One row: our C matrix-vector kernel sums in its own order. 37 rows: each expert's matmul gets the
                # rows routed to it, transformers' gets them in another grouping, and MKL's AVX2 sgemm gives a row a
                # result that depends on how many rows share the call (bit-equal on AVX-512 hosts, 1 ulp off on AVX2:
                # issue 26). bfloat16 rounds those differences away and stays exact.
                torch.testing.assert_close(got, want.reshape(rows, 64), atol=1e-5, rtol=1e-5)
            else:
                assert torch.equal(got, want.reshape(rows, 64)), (rows, dtype)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_bandwidth_floor_counts_the_active_experts(family):
    """benchmarks/bandwidth.py's bytes per batch-1 step: every parameter but the embedding and the experts a token
    does not choose (num_experts - top_k per sparse layer)."""
    from support.checkpoints import _BASE, FAMILIES

    from omnivox.benchmarks.bandwidth import weight_bytes_per_step

    config_cls, model_cls, overrides = FAMILIES[family]
    config = config_cls(**{**_BASE, **overrides, "decoder_sparse_step": 2, "num_hidden_layers": 3})
    with torch.device("meta"):
        model = model_cls(config)
    params = {n: p.numel() for n, p in model.named_parameters()}
    moe = ModelConfig.from_hf(config).moe
    idle = len(moe.sparse_layers) * (moe.num_experts - moe.top_k) * 3 * 64 * moe.expert_intermediate_size
    assert len(moe.sparse_layers) == (3 if family == "mixtral" else 1)  # Mixtral: every layer sparse
    assert weight_bytes_per_step(config, 2) == 2 * (sum(params.values()) - params["model.embed_tokens.weight"] - idle)
