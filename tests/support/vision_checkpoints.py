"""Tiny random vision-language checkpoints saved with `save_pretrained`, each with its processor and chat template.

The tokenizer is the embedded SmolLM2 GGUF's, plus the family's special tokens. Every parameter is perturbed a little
so that no weight sits at an init value that could hide a mistake (norms at 1, biases at 0).
"""

from __future__ import annotations

import io
from pathlib import Path

import torch
import transformers
from PIL import Image

from omnivox.models.checkpoint import load_tokenizer
from omnivox.models.vision.base import image_only_processor_class
from omnivox.services.parts.defaults import ensure_default_model

# One template for every family: the image marker is whatever `image_marker` the processor uses.
_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{IMAGE}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def tokenizer_with(special: list[str]) -> transformers.PreTrainedTokenizerBase:
    tok = load_tokenizer(ensure_default_model(progress=False))
    tok.add_special_tokens({"additional_special_tokens": special})
    return tok


def chat_template(image_marker: str) -> str:
    return _TEMPLATE.replace("{IMAGE}", image_marker)


def _save(model_cls, config, processor, out: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def make_llava(
    out: Path, *, next_: bool = False, siglip: bool = False, dinov2: bool = False, feature_layer=-2, strategy="default"
) -> Path:
    """LLaVA 1.5 (or NeXT with `next_`): a 28x28 CLIP (or SigLIP, or DINOv2) tower with 7x7 patches, Llama (or Qwen2)
    text. The DINOv2 variant is the embedded image model's layout: its image processor resizes to the square (no crop),
    with ImageNet's mean and std."""
    tok = tokenizer_with(["<image>"])
    image_token_id = tok.convert_tokens_to_ids("<image>")
    vision_kwargs = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=28, patch_size=7
    )
    if dinov2:
        vision = transformers.Dinov2Config(layerscale_value=0.5, **vision_kwargs)
        text = transformers.LlamaConfig(vocab_size=len(tok), **_TEXT)
        ip_cls = transformers.CLIPImageProcessor
        ip_kwargs = dict(
            size={"height": 28, "width": 28},
            do_center_crop=False,
            image_mean=[0.485, 0.456, 0.406],
            image_std=[0.229, 0.224, 0.225],
        )
    elif siglip:
        vision = transformers.SiglipVisionConfig(**vision_kwargs)
        text = transformers.Qwen2Config(vocab_size=len(tok), **_TEXT)
        ip_cls = transformers.SiglipImageProcessor
        ip_kwargs = dict(size={"height": 28, "width": 28})
    else:
        vision = transformers.CLIPVisionConfig(projection_dim=32, **vision_kwargs)
        text = transformers.LlamaConfig(vocab_size=len(tok), **_TEXT)
        ip_cls = transformers.CLIPImageProcessor
        ip_kwargs = dict(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    common = dict(
        vision_config=vision,
        text_config=text,
        image_token_id=image_token_id,
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy=strategy,
    )
    extra_tokens = 0 if siglip else 1  # CLIP has a CLS row, SigLIP none
    if next_:
        pinpoints = [[28, 56], [56, 28], [56, 56], [28, 84]]
        config = transformers.LlavaNextConfig(image_grid_pinpoints=pinpoints, **common)
        ip = transformers.LlavaNextImageProcessor(
            image_grid_pinpoints=pinpoints, size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
        )
        processor = transformers.LlavaNextProcessor(
            image_processor=ip,
            tokenizer=tok,
            patch_size=7,
            vision_feature_select_strategy=strategy,
            num_additional_image_tokens=extra_tokens,
            chat_template=chat_template("<image>"),
        )
        model_cls = transformers.LlavaNextForConditionalGeneration
    else:
        config = transformers.LlavaConfig(**common)
        processor = transformers.LlavaProcessor(
            image_processor=ip_cls(**ip_kwargs),
            tokenizer=tok,
            patch_size=7,
            vision_feature_select_strategy=strategy,
            num_additional_image_tokens=extra_tokens,
            chat_template=chat_template("<image>"),
        )
        model_cls = transformers.LlavaForConditionalGeneration
    return _save(model_cls, config, processor, out, seed=1)


def make_idefics3(out: Path, *, smolvlm: bool = True) -> Path:
    """SmolVLM (or Idefics3): 28x28 tiles of 7x7 patches, pixel shuffle by 2 -> 4 rows per tile; images up to 56 px
    on the longest side are split into at most 2x2 tiles plus the global image."""
    rows_cols = [f"<row_{r}_col_{c}>" for r in range(1, 3) for c in range(1, 3)]
    specials = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>", *rows_cols]
    tok = tokenizer_with(specials)
    vision_kwargs = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28, patch_size=7
    )
    text = transformers.LlamaConfig(vocab_size=len(tok), **_TEXT)
    ip_kwargs = dict(do_image_splitting=True, size={"longest_edge": 56}, max_image_size={"longest_edge": 28})
    image_token_id = tok.convert_tokens_to_ids("<image>")
    config_cls, vision_cls, model_cls = (
        (transformers.SmolVLMConfig, transformers.SmolVLMVisionConfig, transformers.SmolVLMForConditionalGeneration)
        if smolvlm
        else (
            transformers.Idefics3Config,
            transformers.Idefics3VisionConfig,
            transformers.Idefics3ForConditionalGeneration,
        )
    )
    config = config_cls(
        vision_config=vision_cls(**vision_kwargs).to_dict(),
        text_config=text.to_dict(),
        image_token_id=image_token_id,
        scale_factor=2,
    )
    if smolvlm:
        ip = transformers.SmolVLMImageProcessor(**ip_kwargs)
        processor = image_only_processor_class(transformers.SmolVLMProcessor)(
            image_processor=ip, tokenizer=tok, image_seq_len=4, chat_template=chat_template("<image>")
        )
    else:
        processor = transformers.Idefics3Processor(
            image_processor=transformers.Idefics3ImageProcessor(**ip_kwargs),
            tokenizer=tok,
            image_seq_len=4,
            chat_template=chat_template("<image>"),
        )
    return _save(model_cls, config, processor, out, seed=2)


def make_qwen2_5_vl(out: Path) -> Path:
    """Qwen2.5-VL: 4x4 patches merged 2x2 (8 px per token), windows of 2x2 merged tokens, full attention in block 1
    of 3; images resized to 64..4096 pixels; text head_dim 16 with mrope_section [2, 3, 3]."""
    tok = tokenizer_with(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"])
    ids = {
        t: tok.convert_tokens_to_ids(t)
        for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>")
    }
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=16,  # pixels: 16 / 4 / 2 = 2 merged tokens per window side
        fullatt_block_indexes=[1],
        out_hidden_size=64,
        tokens_per_second=2,
    )
    text = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
    )
    config = transformers.Qwen2_5_VLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    ip = transformers.Qwen2VLImageProcessor(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=4096
    )
    processor = image_only_processor_class(transformers.Qwen2_5_VLProcessor)(
        image_processor=ip, tokenizer=tok, chat_template=chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    )
    return _save(transformers.Qwen2_5_VLForConditionalGeneration, config, processor, out, seed=3)


def make_qwen2_vl(
    out: Path,
    *,
    released_layout: bool = False,
    vision: dict | None = None,
    text: dict | None = None,
    top: dict | None = None,
    image_processor: dict | None = None,
) -> Path:
    """Qwen2-VL: a LayerNorm / QuickGELU tower of width 32 (embed_dim) whose merger folds 2x2 patches of 4x4 pixels
    into rows of 64 (vision hidden_size = the text width); images resized to 64..4096 pixels; text head_dim 16 with
    mrope_section [2, 3, 3]. `released_layout`: config.json rewritten as the hub's releases spell it (text keys at the
    top level, rope_scaling {"type": "mrope"}, vision `in_chans`); `vision`, `text`, `top` (the top-level config) and
    `image_processor` override keys."""
    specials = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]
    tok = tokenizer_with(specials)
    ids = {t: tok.convert_tokens_to_ids(t) for t in specials}
    v = {**dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=4, patch_size=4, spatial_merge_size=2,
                temporal_patch_size=2), **(vision or {})}  # fmt: skip
    t = {**dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>")), **(text or {})}  # fmt: skip
    config = transformers.Qwen2VLConfig(
        vision_config=v,
        text_config=t,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        **{"tie_word_embeddings": False, **(top or {})},
    )
    ip = {**dict(patch_size=v["patch_size"], merge_size=v["spatial_merge_size"], temporal_patch_size=2, min_pixels=64,
                 max_pixels=4096), **(image_processor or {})}  # fmt: skip
    processor = image_only_processor_class(transformers.Qwen2VLProcessor)(
        image_processor=transformers.Qwen2VLImageProcessor(**ip),
        tokenizer=tok,
        chat_template=chat_template("<|vision_start|><|image_pad|><|vision_end|>"),
    )
    path = _save(transformers.Qwen2VLForConditionalGeneration, config, processor, out, seed=4)
    return _released_qwen2_vl_config(path) if released_layout else path


def _released_qwen2_vl_config(path: Path) -> Path:
    """Rewrite config.json as Qwen/Qwen2-VL-*-Instruct spell it (transformers 4.4x): the text keys at the top level,
    rope_scaling {"type": "mrope", "mrope_section"} with a top-level rope_theta, a disabled 32768 window, `in_chans`
    and no model_type in vision_config."""
    import json

    file = path / "config.json"
    config = json.loads(file.read_text())
    text = config.pop("text_config")
    params = text.pop("rope_parameters")
    for key in ("layer_types", "model_type", "dtype"):
        text.pop(key, None)
    vision = config["vision_config"]
    for key in ("rope_parameters", "model_type", "dtype"):
        vision.pop(key, None)
    vision["in_chans"] = vision.pop("in_channels")
    config.pop("dtype", None)
    config.update(text)
    config.update(
        rope_theta=params["rope_theta"],
        rope_scaling={"type": "mrope", "mrope_section": params["mrope_section"]},
        sliding_window=32768,
        use_sliding_window=False,
        max_window_layers=28,
        torch_dtype="float32",
        transformers_version="4.41.2",
    )
    file.write_text(json.dumps(config, indent=1))
    return path


def relayout(src: Path, dst: Path, renames: list[tuple[str, str]]) -> Path:
    """A copy of the checkpoint at src whose tensor names are rewritten by the first matching (regex, replacement):
    e.g. transformers 5's `model.vision_tower.` as the hub's `vision_tower.`."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        out = {}
        for name, t in tensors.items():
            for pattern, repl in renames:
                if re.match(pattern, name):
                    name = re.sub(pattern, repl, name, count=1)
                    break
            out[name] = t
        save_file(out, file, metadata={"format": "pt"})
    return dst


def reference_features(model, processor, images: list[Image.Image], text: str) -> tuple[dict, torch.Tensor]:
    """The processor's batch for (text, images) and transformers' image features for it, all rows in order."""
    nested = type(processor).__name__ in ("SmolVLMProcessor", "Idefics3Processor")
    batch = processor(text=[text], images=[images] if nested else images, return_tensors="pt")
    kwargs = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    with torch.no_grad():
        out = model.model.get_image_features(**kwargs).pooler_output
    feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in out])  # a list per image, or [images, rows, D] (Gemma 3)
    return batch, feats


def sample_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A deterministic RGB image with structure in both directions (so a transpose changes it)."""
    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(height, width, 3, generator=g) * 255).to(torch.uint8)
    arr[: height // 3, :, 0] = 255
    return Image.fromarray(arr.numpy())


def png_bytes(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()
