"""Checks the M-RoPE families (Qwen2-VL, Qwen2.5-VL) pass against transformers: positions and our decoder with 3-D
positions; each test_vision_qwen*.py calls them with its checkpoint and transformers' model of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from omnivox.models.attention import AttentionMetadata, PrefillChunk
from omnivox.models.checkpoint import iter_checkpoint_tensors
from omnivox.models.config import ModelConfig
from omnivox.models.decoder import DecoderModel
from omnivox.models.vision import VisionEncoder, mrope_positions, mrope_span
from support.vision_checkpoints import sample_image
from support.vision_parity import images, prompt

BLOCK = 16


def check_rope_index(enc: VisionEncoder, reference) -> None:
    """Our M-RoPE positions and delta equal transformers' get_rope_index for three images of three sizes."""
    ims = images() + [sample_image(24, 70, seed=5)]
    text = prompt(enc, len(ims))
    batch = enc.processor(text=[text], images=ims, return_tensors="pt")
    items = enc.preprocess(ims)
    ids = enc.expand_prompt(enc.processor.tokenizer(text, add_special_tokens=False).input_ids, items)
    assert ids == batch["input_ids"][0].tolist()
    ours, delta = enc.rope_positions(ids, items)
    theirs, their_delta = reference.model.get_rope_index(
        batch["input_ids"], batch["mm_token_type_ids"], image_grid_thw=batch["image_grid_thw"]
    )
    assert torch.equal(ours, theirs[:, 0])
    assert delta == int(their_delta) < 0
    # Text only: positions are plain indices on all three rows, delta 0.
    pos, d = mrope_positions([5, 6, 7], enc.placeholder_token_id, [], 2)
    assert torch.equal(pos, torch.arange(3).expand(3, 3)) and d == 0
    with pytest.raises(ValueError):
        mrope_positions(ids, enc.placeholder_token_id, [it.extra["grid_thw"] for it in items[:2]], 2)


def _prefill_meta(n: int, start: int = 0) -> AttentionMetadata:
    """One request's chunk of n tokens after `start` cached ones, blocks 0.. in order."""
    ctx = start + n
    blocks = torch.arange((ctx + BLOCK - 1) // BLOCK)
    return AttentionMetadata(
        block_size=BLOCK,
        slot_mapping=torch.arange(start, ctx),
        num_decode=0,
        decode_block_tables=None,
        decode_mask=None,
        decode_lens=None,
        prefills=[PrefillChunk(query_start=0, num_tokens=n, context_len=ctx, block_table=blocks)],
    )


def check_mrope_decoder(path: Path, enc: VisionEncoder, reference) -> None:
    """Our decoder on the family's text config: same inputs_embeds (image features spliced in) and 3-D positions
    give transformers' logits; then two generated tokens at 1-D positions index + delta, through a second chunk
    that reads the first chunk's KV from the paged cache; then the same in chunks cut inside an image."""
    config = transformers.AutoConfig.from_pretrained(path)
    cfg = ModelConfig.from_hf(config)
    assert cfg.family == "qwen2" and cfg.attention_bias
    model = DecoderModel(cfg).eval()
    model.load_weights(iter_checkpoint_tensors(path))

    ims = images()
    text = prompt(enc, len(ims))
    items = enc.preprocess(ims)
    ids = enc.expand_prompt(enc.processor.tokenizer(text, add_special_tokens=False).input_ids, items)
    feats = torch.cat(enc.encode(items))
    pos, delta = enc.rope_positions(ids, items)
    n = len(ids)
    generated = [17, 230]
    all_ids = torch.tensor(ids + generated)
    rows = (torch.tensor(ids) == enc.placeholder_token_id).nonzero().flatten()
    gen_pos = torch.arange(n, n + len(generated)) + delta
    full_pos = torch.cat((pos, gen_pos.expand(3, -1)), dim=1)  # [3, n + 2]

    with torch.no_grad():
        embeds = reference.get_input_embeddings()(all_ids).index_copy(0, rows, feats)
        ref_logits = reference(inputs_embeds=embeds[None], position_ids=full_pos[:, None, :]).logits[0]

        blocks = (n + len(generated)) // BLOCK + 2
        kv = [
            (
                torch.zeros(blocks * BLOCK, cfg.num_kv_heads, cfg.head_dim),
                torch.zeros(blocks * BLOCK, cfg.num_kv_heads, cfg.head_dim),
            )
            for _ in range(cfg.num_layers)
        ]
        hidden = model(torch.tensor(ids), pos, kv, _prefill_meta(n), embed_rows=rows, embed_values=feats)
        ours_prompt = model.compute_logits(hidden)
        # Generated tokens: 1-D positions (all three rows equal) keep working on an M-RoPE config.
        hidden = model(torch.tensor(generated), gen_pos, kv, _prefill_meta(len(generated), start=n))
        ours_gen = model.compute_logits(hidden)

    torch.testing.assert_close(ours_prompt, ref_logits[:n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours_gen, ref_logits[n:], atol=1e-4, rtol=1e-4)
    # M-RoPE matters here: the same prompt at 1-D positions 0..n-1 gives other logits.
    with torch.no_grad():
        kv = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in kv]
        plain = model.compute_logits(
            model(torch.tensor(ids), torch.arange(n), kv, _prefill_meta(n), embed_rows=rows, embed_values=feats)
        )
    assert not torch.allclose(plain, ours_prompt, atol=1e-3)

    # Chunked prefill with the boundary inside the first image, positions from mrope_span, then the generated
    # tokens as two decode-like chunks of one token each: the same logits.
    cut = int(rows[len(rows) // 4])  # a position inside the first image's run
    assert ids[cut] == ids[cut - 1] == enc.placeholder_token_id
    with torch.no_grad():
        kv = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in kv]
        outs = []
        for start, end in ((0, cut), (cut, n), (n, n + 1), (n + 1, n + 2)):
            sel = (rows >= start) & (rows < end)
            hidden = model(
                all_ids[start:end],
                mrope_span(pos, delta, start, end),
                kv,
                _prefill_meta(end - start, start=start),
                embed_rows=rows[sel] - start,
                embed_values=feats[sel],
            )
            outs.append(model.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(outs), ref_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(mrope_span(pos, delta, 0, n + 2), full_pos)
