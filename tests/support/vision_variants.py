"""Tiny random vision-language checkpoints with any config knob overridden, for the vision sweep.

Each builder takes the family's tiny defaults (tests/support/vision_checkpoints.py) and dicts of overrides for the vision
config, the text config, the top-level config and the image processor, then saves model + processor with
save_pretrained, so the sweep can try the knobs real checkpoints set without a builder per variant.
"""

from __future__ import annotations

from pathlib import Path

import transformers

from omnivox.models.vision.base import image_only_processor_class
from support.vision_checkpoints import _TEXT, _save, chat_template, tokenizer_with

TEXT = _TEXT  # the tiny text decoder the served vision checkpoints use; variants override its keys


def make_llava_variant(
    out: Path,
    *,
    next_: bool = False,
    tower: str = "clip",
    text_family: str = "llama",
    vision: dict | None = None,
    text: dict | None = None,
    top: dict | None = None,
    image_processor: dict | None = None,
    template: str | None = None,
    add_bos: bool = False,
    seed: int = 11,
) -> Path:
    """LLaVA 1.5 / NeXT on a 28x28 (patch 7) CLIP or SigLIP tower; `top` may set vision_feature_layer,
    vision_feature_select_strategy, multimodal_projector_bias, projector_hidden_act, image_grid_pinpoints, ...
    `template`: the processor's chat template (default: ChatML); `add_bos`: the tokenizer adds its BOS, as Llama's
    and Mistral's do."""
    tok = tokenizer_with(["<image>"])
    tok.add_bos_token = add_bos
    top = dict(top or {})
    v = {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=28,
             patch_size=7), **(vision or {})}  # fmt: skip
    t = {**TEXT, "vocab_size": len(tok), **(text or {})}
    size = v["image_size"]
    if tower == "siglip":
        vision_config = transformers.SiglipVisionConfig(**v)
        ip_cls, ip = transformers.SiglipImageProcessor, dict(size={"height": size, "width": size})
    else:
        vision_config = transformers.CLIPVisionConfig(projection_dim=32, **v)
        ip_cls = transformers.CLIPImageProcessor
        ip = dict(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    text_config = transformers.AutoConfig.for_model(text_family, **t)
    strategy = top.setdefault("vision_feature_select_strategy", "default")
    top.setdefault("vision_feature_layer", -2)
    common = dict(vision_config=vision_config, text_config=text_config,
                  image_token_id=tok.convert_tokens_to_ids("<image>"), **top)  # fmt: skip
    proc = dict(tokenizer=tok, patch_size=v["patch_size"], vision_feature_select_strategy=strategy,
                num_additional_image_tokens=0 if tower == "siglip" else 1,
                chat_template=template or chat_template("<image>"))  # fmt: skip
    if next_:
        pinpoints = common.setdefault("image_grid_pinpoints", [[size, 2 * size], [2 * size, size], [2 * size] * 2])
        config = transformers.LlavaNextConfig(**common)
        ip = dict(
            image_grid_pinpoints=pinpoints, size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        )
        processor = transformers.LlavaNextProcessor(
            image_processor=transformers.LlavaNextImageProcessor(**{**ip, **(image_processor or {})}), **proc
        )
        model_cls = transformers.LlavaNextForConditionalGeneration
    else:
        config = transformers.LlavaConfig(**common)
        processor = transformers.LlavaProcessor(image_processor=ip_cls(**{**ip, **(image_processor or {})}), **proc)
        model_cls = transformers.LlavaForConditionalGeneration
    return _save(model_cls, config, processor, out, seed=seed)


# llava-hf/llava-1.5-7b-hf's template (minus its {% generation %} marks): no BOS of its own, every image of a turn
# before the turn's text. Its Llama tokenizer adds the BOS: transformers' processor keeps it.
LLAVA_HF_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def make_idefics3_variant(
    out: Path,
    *,
    smolvlm: bool = True,
    scale_factor: int = 2,
    vision: dict | None = None,
    text: dict | None = None,
    image_processor: dict | None = None,
    seed: int = 12,
) -> Path:
    """SmolVLM / Idefics3 with 7x7 patches; image_seq_len follows from the tile size and scale_factor."""
    v = {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28,
             patch_size=7), **(vision or {})}  # fmt: skip
    tile = v["image_size"]
    ip = {**dict(do_image_splitting=True, size={"longest_edge": 2 * tile}, max_image_size={"longest_edge": tile}), **(image_processor or {})}  # fmt: skip
    grid = max(2, -(-ip["size"]["longest_edge"] // ip["max_image_size"]["longest_edge"]))
    rows_cols = [f"<row_{r}_col_{c}>" for r in range(1, grid + 1) for c in range(1, grid + 1)]
    tok = tokenizer_with(["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>", *rows_cols])
    t = {**TEXT, "vocab_size": len(tok), **(text or {})}
    seq_len = (tile // v["patch_size"]) ** 2 // scale_factor**2
    if smolvlm:
        config_cls, vision_cls = transformers.SmolVLMConfig, transformers.SmolVLMVisionConfig
        model_cls = transformers.SmolVLMForConditionalGeneration
        processor_cls = image_only_processor_class(transformers.SmolVLMProcessor)
        ip_cls = transformers.SmolVLMImageProcessor
    else:
        config_cls, vision_cls = transformers.Idefics3Config, transformers.Idefics3VisionConfig
        model_cls = transformers.Idefics3ForConditionalGeneration
        processor_cls, ip_cls = transformers.Idefics3Processor, transformers.Idefics3ImageProcessor
    config = config_cls(
        vision_config=vision_cls(**v).to_dict(),
        text_config=transformers.LlamaConfig(**t).to_dict(),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=scale_factor,
    )
    processor = processor_cls(
        image_processor=ip_cls(**ip), tokenizer=tok, image_seq_len=seq_len, chat_template=chat_template("<image>")
    )
    return _save(model_cls, config, processor, out, seed=seed)


def make_qwen2_5_vl_variant(
    out: Path,
    *,
    vision: dict | None = None,
    text: dict | None = None,
    top: dict | None = None,
    image_processor: dict | None = None,
    seed: int = 13,
) -> Path:
    """Qwen2.5-VL with patch 4 merged 2x2 (see vision_checkpoints.make_qwen2_5_vl), any knob overridden."""
    specials = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]
    tok = tokenizer_with(specials)
    ids = {s: tok.convert_tokens_to_ids(s) for s in specials}
    v = {**dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, spatial_merge_size=2,
             temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1], out_hidden_size=64,
             tokens_per_second=2), **(vision or {})}  # fmt: skip
    t = {**dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
             bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>")), **(text or {})}  # fmt: skip
    top = {"tie_word_embeddings": False, **(top or {})}
    config = transformers.Qwen2_5_VLConfig(
        vision_config=v,
        text_config=t,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        **top,
    )
    merge, patch = v["spatial_merge_size"], v["patch_size"]
    ip = {**dict(patch_size=patch, merge_size=merge, temporal_patch_size=v["temporal_patch_size"], min_pixels=64,
              max_pixels=4096), **(image_processor or {})}  # fmt: skip
    processor = image_only_processor_class(transformers.Qwen2_5_VLProcessor)(
        image_processor=transformers.Qwen2VLImageProcessor(**ip),
        tokenizer=tok,
        chat_template=chat_template("<|vision_start|><|image_pad|><|vision_end|>"),
    )
    return _save(transformers.Qwen2_5_VLForConditionalGeneration, config, processor, out, seed=seed)
