"""A tiny random Gemma 3 vision-language checkpoint (`Gemma3ForConditionalGeneration`) saved with `save_pretrained`,
with its `Gemma3Processor` and a chat template writing `<start_of_image>` per image.

Tower: a 28x28 SigLIP of 7x7 patches (4x4 = 16 patch rows), average-pooled 2x2 into `mm_tokens_per_image` 4 rows;
text: Gemma 3's decoder (q/k norms, sandwich norms, one sliding layer of window 3 (shorter than an image) then a global one, local and global
rope). The tokenizer is the embedded SmolLM2 GGUF's plus Gemma 3's image tokens.
"""

from __future__ import annotations

from pathlib import Path

import transformers

from support.vision_checkpoints import _save, chat_template, tokenizer_with

BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"


def make_gemma3(out: Path, *, mm_tokens: int = 4, sliding_window: int = 3, pan_and_scan: bool = False) -> Path:
    tok = tokenizer_with([BOI, EOI, IMAGE])
    # Gemma 3's tokenizer names these three (transformers reads boi_token / eoi_token / image_token from them).
    tok._set_model_specific_special_tokens({"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE})
    ids = {t: tok.convert_tokens_to_ids(t) for t in (BOI, EOI, IMAGE)}
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=28,
        patch_size=7,
        vision_use_head=False,
    )
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=2048,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=8,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=0,
    )
    config = transformers.Gemma3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        mm_tokens_per_image=mm_tokens,
        boi_token_index=ids[BOI],
        eoi_token_index=ids[EOI],
        image_token_index=ids[IMAGE],
    )
    # Pan-and-scan crops of at least 8 px (the release's 256 would take images larger than the tests'): a 50x30 image
    # is the original plus 2 crops
    pas = dict(pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=3, pan_and_scan_min_ratio_to_activate=1.2)
    ip = transformers.Gemma3ImageProcessorPil(
        size={"height": 28, "width": 28}, do_pan_and_scan=pan_and_scan, **(pas if pan_and_scan else {})
    )
    processor = transformers.Gemma3Processor(
        image_processor=ip, tokenizer=tok, image_seq_length=mm_tokens, chat_template=chat_template(BOI)
    )
    return _save(transformers.Gemma3ForConditionalGeneration, config, processor, out, seed=5)
