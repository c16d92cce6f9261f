"""Tiny randomly initialised checkpoints saved with save_pretrained: what every parity test loads."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

# Each family: the transformers config class and the overrides that make it tiny.
_BASE = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    # Mistral text models run on our Llama decoder (LLaVA-NeXT-Mistral's decoder); no window unless a test sets one
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    # Phi-3: fused qkv_proj / gate_up_proj in the checkpoint; original_max_position_embeddings below the served
    # length so that longrope cases take their long factors (Phi3Config's default of 4096 would not)
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"original_max_position_embeddings": 64}),
    # Gemma 1 (2B's shape): one KV head (MQA), head_dim 32 (heads x head_dim != hidden, as 7B's 16 x 256 of 3072)
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, {"head_dim": 32, "num_key_value_heads": 1}),
    # Gemma 3's text decoder: head_dim 16 (not 256), a query scale of its own, one sliding and one full layer
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 20,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),  # fmt: skip
    # Gemma 2: soft-capped attention scores and logits (caps small enough to bite on a tiny random model)
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 20,
            "attn_logit_softcapping": 0.05,
            "final_logit_softcapping": 3.0,
        },
    ),  # fmt: skip
    # Mixture of experts (models/moe.py): 8 / 4 experts, top-2, each expert narrower than the dense MLP
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),  # fmt: skip
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        # head_dim written out: transformers 5.24 validates yarn / longrope with MixtralConfig.head_dim None as a number
        {
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 48,
            "sliding_window": None,
        },
    ),  # fmt: skip
    # Qwen2-MoE: a sigmoid-gated shared expert beside the routed ones, q/k/v biases (qkv_bias)
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        },
    ),  # fmt: skip
}


def make_checkpoint(
    out_dir: Path,
    family: str = "llama",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str = "5GB",
    with_tokenizer: bool = True,
    **overrides,
) -> Path:
    """Save a tiny random `family` model (config + safetensors) to out_dir and return out_dir."""
    config_cls, model_cls, family_overrides = FAMILIES[family]
    kwargs = {**_BASE, **family_overrides, **overrides}
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    # Random init leaves norms at 1.0; perturb every parameter a little so that every weight matters.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    if with_tokenizer:
        make_tokenizer(out_dir, config.vocab_size)
    return out_dir


_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello there! How are you today? I am fine, thank you.",
    "Speech synthesis turns text into audio; vision models read images.",
    "東京は日本の首都です。北京是中国的首都。 😀🎉👍 café naïve",
    "def main():\n    return 42\n",
]


def make_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A real byte-level BPE tokenizer trained on a few lines, with a ChatML chat template, saved to out_dir.

    Byte-level tokens split multi-byte characters (emoji, CJK) across tokens, which the UTF-8 tests rely on.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 16, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(out_dir)


def load_reference(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' own implementation of the checkpoint at path."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


def reference_greedy(ref, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and each step's top-5 log-probabilities."""
    gen = ref.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    top = torch.stack([lg[0].float().log_softmax(-1).topk(5).values for lg in gen.logits])
    return gen.sequences[0, len(prompt) :].tolist(), top
