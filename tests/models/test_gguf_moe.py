"""Mixture-of-experts GGUF files in llama.cpp's layout: Mixtral (arch llama with llama.expert_count, Q/K permuted),
Qwen3-MoE (qwen3moe) and Qwen2-MoE (qwen2moe: shared expert, its gate a vector [H]). Written here from tiny random
checkpoints as convert_hf_to_gguf.py writes them: each layer's experts stacked into blk.N.ffn_{gate,up,down}_exps
[E, rows, cols], the router as ffn_gate_inp, the expert sizes under {arch}.expert_feed_forward_length /
expert_shared_feed_forward_length. Checked against transformers on the source checkpoint (F32), on the Q8_0 weights
dequantised by gguf's own code (Q8_0), and as raw K-quant blocks (Q4_K / Q6_K experts, which gguf cannot quantize).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
import transformers
from support.checkpoints import load_reference, make_checkpoint, reference_greedy
from support.decoder_parity import SHORT, XL, assert_matches
from support.engines import tiny_engine
from support.gguf_writer import ARCH, Q4_K, Q6_K, Q8_0, _random_k_blocks, write_moe_gguf
from support.service_harness import ServerThread, user_request

from omnivox.engine import SamplingParams
from omnivox.models import quant
from omnivox.models.checkpoint import iter_checkpoint_tensors, load_hf_config
from omnivox.models.gguf_checkpoint import gguf_tensor_table
from omnivox.models.moe import Experts, QuantizedExperts
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import generation_pb2_grpc


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-moe")
    out = {}
    # Q8_0 rows are 32-wide groups: the expert (and shared expert) sizes of 48 become 64
    sizes = {"mixtral": {"intermediate_size": 64}, "qwen2_moe": {"shared_expert_intermediate_size": 64}}
    for family in ARCH:
        hf = out[f"{family}-hf"] = make_checkpoint(root / family, family, seed=5, **sizes.get(family, {}))
        out[f"{family}-f32"] = write_moe_gguf(hf, root / f"{family}.F32.gguf")
        out[f"{family}-q8"] = write_moe_gguf(hf, root / f"{family}.Q8_0.gguf", Q8_0)
    out["mixtral-per-expert-q8"] = write_moe_gguf(out["mixtral-hf"], root / "old.Q8_0.gguf", Q8_0, stacked=False)
    return out


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIVOX_CACHE", str(tmp_path / "omnivox-cache"))


@pytest.mark.parametrize("family", list(ARCH))
def test_float_moe_gguf_equals_transformers_on_its_source(files, family):
    """Config from the metadata (expert count, top-k, expert sizes, Mixtral from arch llama), every tensor in place:
    greedy tokens and top-5 log-probabilities of transformers on the checkpoint the file was written from."""
    engine = tiny_engine(files[f"{family}-f32"], max_num_batched_tokens=8)
    cfg, source = engine.model_config, transformers.AutoConfig.from_pretrained(files[f"{family}-hf"])
    assert cfg.hf_config.model_type == family
    experts = getattr(source, "num_experts", None) or source.num_local_experts
    inter = getattr(source, "moe_intermediate_size", None) or source.intermediate_size
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.expert_intermediate_size) == (experts, 2, inter)
    assert cfg.moe.shared_expert_intermediate_size == getattr(source, "shared_expert_intermediate_size", None)
    assert isinstance(engine.model.layers[0].mlp.experts, Experts)
    assert_matches(engine, load_reference(files[f"{family}-hf"]), (SHORT, XL))


def _dequantised_reference(hf_dir: Path, qtype) -> transformers.PreTrainedModel:
    """transformers' model of hf_dir with the matrices a `qtype` file quantises replaced by gguf's own round trip."""
    ref = load_reference(hf_dir)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if (
                p.dim() < 2
                or "embed" in name
                or "lm_head" in name
                or name.endswith(("mlp.gate.weight", "_gate.weight"))
            ):
                continue
            w = p.numpy()
            rt = gguf.quants.dequantize(gguf.quants.quantize(w.reshape(-1, w.shape[-1]), qtype), qtype)
            p.copy_(torch.from_numpy(rt.reshape(w.shape)))
    return ref


@pytest.mark.parametrize("family", list(ARCH))
def test_q8_moe_gguf_at_its_own_precision_and_dequantised(files, family):
    """Dequantised to float: transformers on the Q8_0-rounded weights. At its own precision (the CPU default): each
    expert's int8 blocks as stored, routers float; the same greedy tokens as the dequantised file."""
    path = files[f"{family}-q8"]
    dequantised = tiny_engine(path, quantization="none")
    assert_matches(dequantised, _dequantised_reference(files[f"{family}-hf"], Q8_0), (SHORT,))
    native = tiny_engine(path, quantization="auto")
    mlp = native.model.layers[0].mlp
    assert isinstance(mlp.experts, QuantizedExperts)
    assert all(isinstance(m, quant.Int8Linear) for m in [*mlp.experts.gate_up, *mlp.experts.down])
    assert not isinstance(mlp.gate, quant.Int8Linear)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert native.generate([XL], params)[0].token_ids == dequantised.generate([XL], params)[0].token_ids


def test_mixtral_gguf_with_one_tensor_per_expert(files):
    """Mixtral GGUFs converted before llama.cpp stacked the experts (blk.N.ffn_gate.E.weight; TheBloke's, still
    loaded by llama.cpp): the same tensors as the stacked file, served at their int8 precision with its tokens."""
    old, new = files["mixtral-per-expert-q8"], files["mixtral-q8"]
    assert "blk.0.ffn_gate.3.weight" in {name for name, *_ in gguf_tensor_table(old)[1]}
    ours, stacked = dict(iter_checkpoint_tensors(old)), dict(iter_checkpoint_tensors(new))
    assert sorted(ours) == sorted(stacked) and all(torch.equal(ours[n], stacked[n]) for n in ours)
    native = tiny_engine(old, quantization="auto")
    assert isinstance(native.model.layers[1].mlp.experts, QuantizedExperts)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = tiny_engine(new, quantization="auto").generate([XL], params)[0].token_ids
    assert native.generate([XL], params)[0].token_ids == want


def test_tensor_parallel_shard_of_a_moe_gguf_equals_the_folders(files):
    """`--tensor-parallel 2` reads a MoE GGUF as it reads the folder: rank 1's shard (its slice of every expert's
    intermediate rows, router whole) tensor for tensor the shard load_shard makes of the source checkpoint."""
    from omnivox.models.tensor_parallel import load_shard

    for family in ARCH:
        shards = [load_shard(files[f"{family}-{k}"], 1, 2, torch.device("cpu"), torch.float32) for k in ("hf", "f32")]
        want, got = (s.state_dict() for s in shards)
        assert sorted(got) == sorted(want), family
        assert all(torch.equal(got[n], want[n]) for n in want), family


def test_qwen_moe_expert_sizes_from_the_tensors_without_their_keys(files, tmp_path):
    """A file without expert_feed_forward_length / expert_shared_feed_forward_length (llama.cpp sizes experts by
    their tensors): the sizes from ffn_gate_exps / ffn_gate_shexp, not Qwen2MoeConfig's defaults (1408 / 5632)."""
    path = write_moe_gguf(files["qwen2_moe-hf"], tmp_path / "nosizes.gguf", sizes=False)
    assert "qwen2moe.expert_feed_forward_length" not in gguf.GGUFReader(path).fields
    config = load_hf_config(path)
    assert (config.moe_intermediate_size, config.shared_expert_intermediate_size) == (32, 64)


def test_k_quant_experts_split_per_expert_and_served_as_int4_and_int8(tmp_path):
    """Q4_K_M's usual mix: gate/up experts Q4_K, down experts Q6_K. Each expert's matrix is its slice of the stacked
    blocks (gguf's dequantizer on the raw blocks, never the loader); served natively, gate_up as int4 and down as
    int8 groups, computing what float experts on the dequantised blocks compute."""
    hf = make_checkpoint(tmp_path / "hf", "qwen3_moe", seed=2, hidden_size=256, moe_intermediate_size=256,
                         num_hidden_layers=1, num_experts=4, head_dim=64)  # fmt: skip
    e, h, i = 4, 256, 256
    raw = {"blk.0.ffn_gate_exps.weight": (_random_k_blocks(e * i, h, Q4_K, 1).reshape(e, i, -1), Q4_K),
           "blk.0.ffn_up_exps.weight": (_random_k_blocks(e * i, h, Q4_K, 2).reshape(e, i, -1), Q4_K),
           "blk.0.ffn_down_exps.weight": (_random_k_blocks(e * h, i, Q6_K, 3).reshape(e, h, -1), Q6_K)}  # fmt: skip
    path = write_moe_gguf(hf, tmp_path / "k.gguf", raw=raw)
    ours = dict(iter_checkpoint_tensors(path))
    for proj, (blocks, qtype) in (("gate", raw["blk.0.ffn_gate_exps.weight"]), ("down", raw["blk.0.ffn_down_exps.weight"])):  # fmt: skip
        for expert in range(e):
            want = torch.from_numpy(gguf.quants.dequantize(blocks[expert], qtype))
            assert torch.equal(ours[f"model.layers.0.mlp.experts.{expert}.{proj}_proj.weight"], want), (proj, expert)
    assert not torch.equal(
        ours["model.layers.0.mlp.experts.0.up_proj.weight"], ours["model.layers.0.mlp.experts.1.up_proj.weight"]
    )
    native = tiny_engine(path, quantization="auto")  # the file's own precision
    experts = native.model.layers[0].mlp.experts
    assert all(isinstance(m, quant.Int4Linear) for m in experts.gate_up)
    assert all(isinstance(m, quant.Int8Linear) for m in experts.down)
    # The served int4 / int8 experts compute what float experts on the dequantised blocks do (Q4_K regrouped to
    # 32-wide groups: 1.5 % of the weights' norm on these random blocks, as for dense Q4_K matrices; Q6_K to 8 bits:
    # 0.45 %), on 5 rows through all 4 experts: 2.1 % of the output's norm here.
    float_experts = tiny_engine(path, quantization="none").model.layers[0].mlp.experts
    x = torch.randn(5, h, generator=torch.Generator().manual_seed(0))
    ids, weights = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [1, 3]]), torch.full((5, 2), 0.5)
    want, got = float_experts(x, ids, weights), experts(x, ids, weights)
    assert (got - want).norm() / want.norm() < 0.03, (got - want).norm() / want.norm()
    # --quantization int8 on the same file: the Q4_K blocks regrouped to int8 as well
    forced = tiny_engine(path, quantization="int8").model.layers[0].mlp.experts
    assert all(isinstance(m, quant.Int8Linear) for m in [*forced.gate_up, *forced.down])


def test_mixtral_gguf_served_through_grpc_with_its_own_template(files):
    """The GGUF alone (its tokenizer and chat template from the metadata, no folder beside it): a chat Generate's
    greedy tokens are transformers' on the source checkpoint for the prompt the template builds."""
    path = files["mixtral-f32"]
    text = "The capital of France is Paris. The capital of Italy is"
    with ServerThread([ModelSpec(path=path, name="mixtral-gguf")], EngineOptions(kv_cache_gib=0.01)) as server:
        stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
        request = user_request(text, model="mixtral-gguf", max_output_tokens=6, ignore_eos=True)
        request.sampling.temperature = 0.0
        ours = [t for r in stub.Generate(request, timeout=60) if r.WhichOneof("response") == "delta"
                for t in r.delta.token_ids]  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(files["mixtral-hf"])
    chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    ref = load_reference(files["mixtral-hf"])
    ref.generation_config.eos_token_id = None
    assert ours == reference_greedy(ref, tok.encode(chat, add_special_tokens=False), 6)[0]
