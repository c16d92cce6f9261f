"""One normalised, frozen view of a decoder's configuration, whatever checkpoint format it came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",  # Phi-3 / 3.5 / 4-mini: fused qkv_proj and gate_up_proj, split at load
    "GemmaForCausalLM": "gemma",  # Gemma 1 (2B: MQA, 7B), CodeGemma: Llama's layers, GELU-tanh, (1 + w) norms
    "Gemma3ForCausalLM": "gemma3",  # Gemma 3's text decoder (the 1B, or the text part of larger ones)
    "Gemma2ForCausalLM": "gemma2",  # Gemma 3's layers less q/k norms and local rope, plus attention soft-capping
    # Mixture-of-experts MLPs (models/moe.py) on the layers above
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3-30B-A3B / 235B-A22B: Qwen3's attention, routed experts
    "MixtralForCausalLM": "mixtral",  # Mistral's attention, 8 experts, top-2
    "Qwen2MoeForCausalLM": "qwen2_moe",  # Qwen1.5-MoE / Qwen2-57B-A14B: routed experts plus a gated shared expert
}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
# transformers' classes for these never tie the output projection to the token embedding (no _tied_weights_keys):
# their lm_head is its own checkpoint weight whatever tie_word_embeddings says. Tying it here used the embedding
# instead: a tiny Qwen2-Audio saved with tie_word_embeddings true gave other tokens from the first one.
_NEVER_TIED = frozenset({"qwen2_audio", "voxtral"})  # model_type of the top-level config

# Text configs of multimodal checkpoints map to the decoder they use (Qwen2.5-VL's text model is Qwen2 with M-RoPE).
# Mistral (LLaVA-NeXT-Mistral's text model) is Llama's architecture plus an optional sliding window (every layer).
_MODEL_TYPE_TO_FAMILY = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2_5_vl_text": "qwen2",
    "qwen2_vl_text": "qwen2",
    "mistral": "llama",
    "phi3": "phi3",
    "gemma": "gemma",
    "gemma3_text": "gemma3",
    "gemma2": "gemma2",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
}


def served_families() -> str:
    """What omnivox serves, for a refusal that names what it got (a Qwen3-VL folder is not a Qwen2.5-VL one)."""
    from omnivox.models.audio import FAMILIES as AUDIO
    from omnivox.models.vision import FAMILIES as VISION

    return (
        f"omnivox serves text decoders {sorted(SUPPORTED_ARCHITECTURES)} (and Mistral), vision-language checkpoints "
        f"of model_type {sorted(VISION)}, audio-LLMs of model_type {sorted(AUDIO)}, Whisper and Orpheus speech"
    )


class NotApplicable(ValueError):
    """A load option this model cannot take (float-only Whisper asked for int8 weights, 8-bit activations over float
    weights, a draft model of another vocabulary). `field` is the EngineOptions field: an option given for every
    served model (`serve --quantization int8` without NAME=) is dropped for such a model with a warning, one given
    for it by name is an error (services/parts/bundle.py load_manifest)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class MoeConfig:
    """A sparse mixture-of-experts MLP (models/moe.py), as transformers' Qwen3-MoE / Mixtral / Qwen2-MoE route it:
    softmax over every expert's router logit in float32, the top_k largest, renormalised to sum 1 when
    norm_topk_prob (Mixtral always)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int  # each expert's (Qwen: moe_intermediate_size; Mixtral: intermediate_size)
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]  # the others keep a dense MLP of intermediate_size (Qwen's mlp_only_layers)
    shared_expert_intermediate_size: int | None = None  # Qwen2-MoE: a dense expert every token takes, sigmoid-gated
    # Mixtral scales each expert's output by its float32 routing weight (then rounds to the model dtype); Qwen
    # rounds the weight to the model dtype first. Equal in float32, not in bf16.
    float32_weights: bool = False


def moe_config(text: Any, family: str) -> MoeConfig | None:
    """The MoE block of a Qwen3-MoE / Mixtral / Qwen2-MoE text config (None for other families). Qwen's layer i is
    sparse unless listed in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0 (transformers' rule)."""
    if family not in MOE_FAMILIES:
        return None
    layers = int(text.num_hidden_layers)
    experts = int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", 0) or 0)
    top_k = int(text.num_experts_per_tok)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"config num_experts_per_tok {top_k} must be 1..num_experts ({experts}) for {family}")
    if family == "mixtral":
        return MoeConfig(experts, top_k, int(text.intermediate_size), True, tuple(range(layers)), float32_weights=True)
    step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(text, "mlp_only_layers", None) or ())
    sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    shared = int(text.shared_expert_intermediate_size) if family == "qwen2_moe" else None
    return MoeConfig(
        experts,
        top_k,
        int(text.moe_intermediate_size),
        bool(text.norm_topk_prob),
        sparse,
        shared_expert_intermediate_size=shared,
    )


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "qwen2" | "qwen3" | "phi3" | "gemma" | "gemma2" | "gemma3" | "qwen3_moe" | "mixtral" | "qwen2_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    max_model_len: int  # what the engine serves: max_position_embeddings, optionally capped by the user
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama when configured)
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over head_dim on q and k before rope (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    hf_config: Any = field(repr=False, compare=False, default=None)  # the transformers config, for rope init
    o_proj_bias: bool = False  # the attention output projection carries a bias (Llama / Qwen3 `attention_bias`)
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included (transformers' meaning)
    sliding_layers: tuple[int, ...] = ()  # the layers that slide (Mistral, Phi-3: all; Qwen2/3, Gemma 3: layer_types)
    rotary_dim: int | None = None  # leading dims of each head that rotate (Phi-4-mini: 3/4 of it); None: all
    attn_scale: float | None = None  # query scale; None: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)
    hidden_act: str = "silu"  # MLP activation of the gate: "silu" or "gelu_tanh" (Gemma 3)
    # Gemma 3: RMSNorm scales by (1 + weight), folded into the weights at load (models/decoder.py) so every path
    # (torch, fused CPU step, int8, tensor parallel) runs the one RMSNorm; each layer also norms its attention and
    # MLP outputs (post_attention / post_feedforward) and the MLP input (pre_feedforward).
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: float | None = None  # token embeddings times this, rounded to the model dtype (Gemma: sqrt(hidden))
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None  # attention scores likewise, before the mask (Gemma 2)
    local_rope_layers: tuple[int, ...] = ()  # Gemma 3: layers on the local rope ("sliding_attention" parameters)
    moe: MoeConfig | None = None  # the sparse MLP of the mixture-of-experts families
    # Prompt token ids range over this when the input vocabulary is not the output one (CSM: text in, codes out).
    input_vocab_size: int | None = None

    @classmethod
    def from_hf(cls, hf_config: Any, max_model_len: int | None = None) -> ModelConfig:
        """Normalise a transformers config (a multimodal config's `text_config` is unwrapped)."""
        text = getattr(hf_config, "text_config", None) or hf_config
        if hasattr(text, "get_text_config"):
            text = text.get_text_config()
        archs = list(getattr(hf_config, "architectures", None) or [])
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        family = family or _MODEL_TYPE_TO_FAMILY.get(getattr(text, "model_type", ""))
        # the text part of a model we do not serve (PaliGemma's is Gemma 1)
        if family in ("phi3", "gemma", "gemma2", "gemma3") and text is not hf_config:
            family = family if getattr(hf_config, "model_type", None) == "gemma3" else None  # Gemma 3 VLMs we do
        if family is None:
            raise ValueError(
                f"unsupported architecture {archs or getattr(text, 'model_type', '?')} "
                f"(model_type {getattr(hf_config, 'model_type', '?')!r}): {served_families()}"
            )
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        eos = getattr(text, "eos_token_id", None)
        if eos is None:
            eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
        max_pos = int(getattr(text, "max_position_embeddings", 2048))
        window, sliding = attention_window(text)
        check_supported(text, family)
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        tie = getattr(hf_config, "tie_word_embeddings", None)
        if tie is None:
            tie = getattr(text, "tie_word_embeddings", False)
        if getattr(hf_config, "model_type", None) in _NEVER_TIED:
            tie = False
        return cls(
            family=family,
            vocab_size=int(text.vocab_size),
            hidden_size=int(text.hidden_size),
            intermediate_size=int(text.intermediate_size),
            num_layers=int(text.num_hidden_layers),
            num_heads=int(num_heads),
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(text.rms_norm_eps),
            max_position_embeddings=max_pos,
            max_model_len=min(max_pos, max_model_len) if max_model_len else max_pos,
            tie_word_embeddings=bool(tie),
            # Qwen2-MoE names it qkv_bias (default true)
            attention_bias=family == "qwen2" or bool(getattr(text, "attention_bias", getattr(text, "qkv_bias", False))),
            # Llama / Qwen3 / Mistral put `attention_bias` on o_proj too; Qwen2 biases q/k/v only.
            o_proj_bias=family not in ("qwen2", "qwen2_moe") and bool(getattr(text, "attention_bias", False)),
            sliding_window=window,
            sliding_layers=sliding,
            mlp_bias=bool(getattr(text, "mlp_bias", False)),
            qk_norm=family in ("qwen3", "gemma3", "qwen3_moe"),
            eos_token_ids=eos_ids,
            bos_token_id=getattr(text, "bos_token_id", None),
            hf_config=text,
            rotary_dim=rotary_dim(text, int(head_dim)),
            moe=moe_config(text, family),
            **(_gemma_fields(text, family) if family in GEMMA_FAMILIES else {}),
        )

    @property
    def window_everywhere(self) -> int | None:
        """The sliding window when every layer slides (no layer reads a key behind it: the KV blocks there can be
        released), else None."""
        slides = self.sliding_window and len(self.sliding_layers) == self.num_layers
        return self.sliding_window if slides else None

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


# Rope types whose tables are a fixed inv_freq plus an attention scale (models/layers.py RotaryEmbedding).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
SUPPORTED_HIDDEN_ACTS = ("silu",)  # Llama-shaped families: SiLU(gate) * up (Gemma sets its own GELU-tanh below)


GEMMA_HIDDEN_ACTS = ("gelu_pytorch_tanh", "gelu_tanh")  # Gemma's hidden_activation: GELU, tanh approximation
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3")


def rope_parameter_sets(text: Any) -> dict[str | None, dict]:
    """The rope parameters of a text config by layer type: {None: params} for one set shared by every layer,
    {"sliding_attention": ..., "full_attention": ...} for Gemma 3 (local and global rope)."""
    params = getattr(text, "rope_parameters", None) or {}
    if isinstance(params.get("full_attention"), dict):
        return {kind: dict(p or {}) for kind, p in params.items()}
    return {None: params}


def rotary_dim(text: Any, head_dim: int) -> int | None:
    """Rotated dims of each head when only part rotates (`partial_rotary_factor`, Phi-4-mini's 0.75), else None."""
    params = next(iter(rope_parameter_sets(text).values()))
    partial = params.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None))
    if partial is None or float(partial) == 1.0:
        return None
    return int(head_dim * float(partial))


def _gemma_fields(text: Any, family: str) -> dict:
    """Gemma's knobs. Gemma 1 keeps Llama's layer and query scale: GELU-tanh, (1 + w) norms and the scaled embedding
    only. Gemma 2 / 3 add the sandwich norms, query_pre_attn_scalar and soft-caps; only Gemma 3 gives its sliding
    layers a rope of their own."""
    common = {"hidden_act": "gelu_tanh", "norm_offset": 1.0, "embed_scale": float(text.hidden_size) ** 0.5}
    if family == "gemma":
        return common
    cap = getattr(text, "final_logit_softcapping", None)
    attn_cap = getattr(text, "attn_logit_softcapping", None)
    kinds = list(text.layer_types)[: text.num_hidden_layers]
    local = None not in rope_parameter_sets(text)
    return {
        "local_rope_layers": tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention") if local else (),
        "attn_logit_softcapping": float(attn_cap) if attn_cap else None,
        "attn_scale": float(text.query_pre_attn_scalar) ** -0.5,
        "sandwich_norms": True,
        "final_logit_softcapping": float(cap) if cap else None,
    } | common


def check_supported(text: Any, family: str = "llama") -> None:
    """Refuse, naming the config key, what our decoder would compute differently from transformers."""
    if family in GEMMA_FAMILIES:
        # Gemma 1's modeling reads hidden_act (its config turns the releases' legacy "gelu" into the tanh GELU they
        # were trained with); Gemma 2 / 3's reads hidden_activation
        key = "hidden_act" if family == "gemma" else "hidden_activation"
        act = getattr(text, key, None) or "gelu_pytorch_tanh"
        if act not in GEMMA_HIDDEN_ACTS:
            raise ValueError(f"config {key} {act!r} is not supported (Gemma: {', '.join(GEMMA_HIDDEN_ACTS)})")
        if getattr(text, "use_bidirectional_attention", False):
            raise ValueError(
                "config use_bidirectional_attention true is not supported (an embedding model, not a decoder)"
            )
    else:
        act = getattr(text, "hidden_act", "silu")
        if act not in SUPPORTED_HIDDEN_ACTS:
            raise ValueError(
                f"config hidden_act {act!r} is not supported (omnivox computes {', '.join(SUPPORTED_HIDDEN_ACTS)})"
            )
    for kind, params in rope_parameter_sets(text).items():
        key = "rope_parameters" + (f"[{kind!r}]" if kind else "")
        rope_type = params.get("rope_type", "default")
        if rope_type == "dynamic":
            raise ValueError(
                f"config {key}['rope_type'] 'dynamic' is not supported (NTK scaling that changes with the length)"
            )
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"config {key}['rope_type'] {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        partial = params.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None))
        if partial is not None and float(partial) != 1.0 and family != "phi3":  # Phi-3 rotates part of each head
            raise ValueError(
                f"config partial_rotary_factor {partial} is not supported for {family} (only 1.0: the whole head rotates)"
            )


def attention_window(text: Any) -> tuple[int | None, tuple[int, ...]]:
    """(sliding window, the layers it applies to) of a text config; (None, ()) when every layer attends to every
    earlier token.

    Mistral, Mixtral, Qwen3-MoE and Phi-3 slide every layer by `sliding_window`; Gemma 2 / 3 the layers their `layer_types` mark
    "sliding_attention"; Qwen2 / Qwen3 likewise (from `use_sliding_window` and `max_window_layers`), and transformers
    clears their `sliding_window` when `use_sliding_window` is false (the Qwen2.5 / Qwen3 releases: full attention
    everywhere)."""
    window = getattr(text, "sliding_window", None)
    if not window or window >= int(getattr(text, "max_position_embeddings", 0) or window + 1):
        return None, ()  # a window no shorter than every context masks nothing (Phi-4-mini's 262144 of 131072)
    layers = int(text.num_hidden_layers)
    # Qwen3-MoE's attention slides on every layer too when use_sliding_window (layer_types unused), unlike Qwen3's
    if getattr(text, "model_type", "") in ("mistral", "phi3", "mixtral", "qwen3_moe"):
        return int(window), tuple(range(layers))
    layer_types = list(getattr(text, "layer_types", None) or ())
    sliding = tuple(i for i, kind in enumerate(layer_types[:layers]) if kind == "sliding_attention")
    return (int(window), sliding) if sliding else (None, ())
