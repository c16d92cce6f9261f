"""A LLaVA 1.5 checkpoint folder assembled from parts: a DINOv2 tower folder, a Llama-family text model (SmolLM2, read
from its GGUF by transformers and dequantised to float32) and a trained 2-layer projector. The result is a standard
transformers `LlavaForConditionalGeneration` folder (config, safetensors, processor, chat template), which omnivox
serves through its LLaVA path like any other and transformers' own `generate` reads as is.

The same image processor and chat template serve the training (benchmarks/train_image_model.py) and the folder, so the
prompt a served request builds is the prompt the projector was trained on.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from omnivox.models.checkpoint import load_tokenizer

IMAGE_SIZE = 112  # 8x8 DINOv2 patches of 14 px: 64 image tokens, cheap enough for SmolLM2 on a CPU
IMAGE_TOKEN = "<image>"
ADAPTER_PREFIX = "lora."  # LoRA keys beside the projector's (benchmarks/image_lora.py writes them)
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # DINOv2's normalisation
FEATURE_LAYER = -1  # the last encoder layer's hidden states (before DINOv2's final layernorm)
# "default" drops DINOv2's CLS row (64 rows); "full" keeps it first (65). Run 5 trained with "full" and the question
# before the image (a linear probe reads the one circle's colour off the CLS row at 97 %) and did not beat run 2.
FEATURE_SELECT_STRATEGY = "default"
# No system prompt of its own: SmolLM2's default one costs 20 tokens per request and the projector never saw it.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def image_processor() -> transformers.CLIPImageProcessor:
    """The whole image resized to IMAGE_SIZE square (no crop: a shape at the edge stays in), ImageNet-normalised."""
    return transformers.CLIPImageProcessor(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_center_crop=False,
        image_mean=IMAGENET_MEAN,
        image_std=IMAGENET_STD,
    )


def tokenizer_with_image_token(gguf_path: str | Path) -> transformers.PreTrainedTokenizerBase:
    tok = load_tokenizer(gguf_path)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def load_text_model(gguf_path: str | Path) -> transformers.PreTrainedModel:
    """The GGUF's model as a transformers causal LM in float32 (its quantised blocks dequantised by transformers)."""
    path = Path(gguf_path)
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


def load_token_embeddings(gguf_path: str | Path) -> torch.Tensor:
    """The GGUF's token embedding table [V, D] float32 alone, read and dequantised without building the model (4 s
    for SmolLM2 against 12.5 s for `load_text_model`; equal to its `get_input_embeddings().weight`)."""
    import gguf
    import numpy as np

    (tensor,) = [t for t in gguf.GGUFReader(str(gguf_path)).tensors if t.name == "token_embd.weight"]
    table = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(table, dtype=np.float32))


def merge_adapter(text_state: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`text_state` (the decoder's `.model` state dict) with each LoRA update added: W + B @ A, B already scaled.

    Raises KeyError for an adapter module the text model lacks, ValueError for a lone A or B."""
    merged = dict(text_state)
    names = {k[len(ADAPTER_PREFIX) : k.rindex(".")] for k in adapter}
    for name in sorted(names):
        a, b = adapter.get(f"{ADAPTER_PREFIX}{name}.lora_A"), adapter.get(f"{ADAPTER_PREFIX}{name}.lora_B")
        if a is None or b is None:
            raise ValueError(f"adapter module {name!r} needs both lora_A and lora_B")
        weight = merged[f"{name}.weight"]  # [out, in]
        merged[f"{name}.weight"] = weight + (b.float() @ a.float()).to(weight.dtype)  # [out, r] @ [r, in]
    return merged


def assemble_llava(
    dinov2_dir: str | Path,
    gguf_path: str | Path,
    projector: dict[str, torch.Tensor],
    out_dir: str | Path,
    text_model: transformers.PreTrainedModel | None = None,
) -> Path:
    """Write the LLaVA folder; `projector` holds `linear_1.{weight,bias}` and `linear_2.{weight,bias}`, and
    optionally a LoRA of the text model (`lora.<module>.lora_A` / `lora_B` keys), merged into its weights."""
    adapter = {k: v for k, v in projector.items() if k.startswith(ADAPTER_PREFIX)}
    projector = {k: v for k, v in projector.items() if k not in adapter}
    tok = tokenizer_with_image_token(gguf_path)
    lm = text_model if text_model is not None else load_text_model(gguf_path)
    vision = transformers.Dinov2Model.from_pretrained(dinov2_dir)
    text_config = lm.config
    text_config.vocab_size = len(tok)
    config = transformers.LlavaConfig(
        vision_config=vision.config,
        text_config=text_config,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=FEATURE_LAYER,
        vision_feature_select_strategy=FEATURE_SELECT_STRATEGY,
        projector_hidden_act="gelu",
        tie_word_embeddings=text_config.tie_word_embeddings,
    )
    with torch.device("meta"):
        model = transformers.LlavaForConditionalGeneration(config)
    embed = lm.get_input_embeddings().weight.detach()  # [49152, 576]
    # The image token's row is never read as an embedding (features replace it); as a (tied) output row it is zero, so
    # its logit is 0, below the answer tokens' (not guaranteed for every prompt).
    embed = torch.cat([embed, torch.zeros(len(tok) - embed.shape[0], embed.shape[1])])
    state = {f"model.vision_tower.{k}": v for k, v in vision.state_dict().items()}
    state |= {f"model.multi_modal_projector.{k}": v for k, v in projector.items()}
    text_state = merge_adapter(lm.model.state_dict(), adapter)
    state |= {f"model.language_model.{k}": v for k, v in text_state.items() if k != "embed_tokens.weight"}
    state["model.language_model.embed_tokens.weight"] = embed
    state["lm_head.weight"] = embed if config.tie_word_embeddings else torch.cat([lm.lm_head.weight, embed[-1:] * 0])
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    out = Path(out_dir)
    model.save_pretrained(out)
    processor = transformers.LlavaProcessor(
        image_processor=image_processor(),
        tokenizer=tok,
        patch_size=vision.config.patch_size,
        vision_feature_select_strategy=FEATURE_SELECT_STRATEGY,
        num_additional_image_tokens=1,  # DINOv2's CLS row, dropped by the "default" strategy
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )
    processor.save_pretrained(out)
    return out
