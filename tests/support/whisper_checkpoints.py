"""A tiny random Whisper checkpoint saved with its processor, for the service tests (Transcribe, streaming, cascade).

The tokenizer is the embedded SmolLM2 GGUF's plus Whisper's special tokens in Whisper's order (<|endoftext|>,
<|startoftranscript|>, the language tokens, <|translate|>, <|transcribe|>, <|startoflm|>, <|startofprev|>,
<|nospeech|>, <|notimestamps|>, then the timestamps <|0.00|> ... <|30.00|>); generation_config.json carries what
transformers' Whisper generate reads (lang_to_id, task_to_id, no_timestamps_token_id, suppress_tokens, ...).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

from omnivox.models.attention import AttentionMetadata, PrefillChunk
from omnivox.models.audio.whisper import WhisperModel
from omnivox.models.checkpoint import load_tokenizer
from omnivox.services.parts.defaults import ensure_default_model

N_MELS = 16
LANGUAGES = ("en", "de", "fr", "es")
SPECIALS = (
    ["<|endoftext|>", "<|startoftranscript|>"]
    + [f"<|{c}|>" for c in LANGUAGES]
    + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
)
TIMESTAMPS = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]


def whisper_tokenizer() -> transformers.PreTrainedTokenizerBase:
    tok = load_tokenizer(ensure_default_model(progress=False))
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.add_tokens(TIMESTAMPS)  # as Whisper's tokenizer: plain added tokens after the specials
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        return transformers.AutoTokenizer.from_pretrained(d)


def make_whisper(out: Path, seed: int = 0, multilingual: bool = True, **config) -> Path:
    """A random Whisper (d_model 64, 2 + 2 layers, 16 mel bins) with its tokenizer and processor files.
    multilingual False: English-only, without timestamp tokens (its vocabulary ends at <|notimestamps|>)."""
    tok = whisper_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    vocab = len(tok) if multilingual else ids["<|notimestamps|>"] + 1
    kw = dict(
        vocab_size=vocab,
        num_mel_bins=N_MELS,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=1500,
        max_target_positions=448,
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|endoftext|>"],
        decoder_start_token_id=ids["<|startoftranscript|>"],
        suppress_tokens=None,
        begin_suppress_tokens=None,
        init_std=0.1,  # large enough that greedy choices are far from ties
    )
    kw.update(config)
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(WhisperConfig(**kw)).eval()
    gen = GenerationConfig(
        decoder_start_token_id=ids["<|startoftranscript|>"],
        eos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
        is_multilingual=multilingual,
        lang_to_id={f"<|{c}|>": ids[f"<|{c}|>"] for c in LANGUAGES},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"],
        prev_sot_token_id=ids["<|startofprev|>"],
        max_initial_timestamp_index=50,
        # A few text tokens and the task tokens, as a real checkpoint's list; " " and end-of-text at the start.
        suppress_tokens=[5, 7, 11, ids["<|translate|>"], ids["<|transcribe|>"], ids["<|startofprev|>"]],
        begin_suppress_tokens=[tok.convert_tokens_to_ids("Ġ"), ids["<|endoftext|>"]],
    )
    model.generation_config = gen
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    WhisperFeatureExtractor(feature_size=N_MELS).save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "whisper"
    return out


BLOCK = 16


def tiny_whisper_config(**overrides) -> WhisperConfig:
    """d_model 64, 2 + 2 layers, 4 heads, vocab 300; 3000 mel frames (max_source_positions 1500) of 16 mel bins."""
    kw = dict(
        vocab_size=300,
        num_mel_bins=16,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=1500,
        max_target_positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        decoder_start_token_id=2,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        init_std=0.1,  # large enough that greedy choices are far from ties
    )
    kw.update(overrides)
    return WhisperConfig(**kw)


def save_tiny_whisper(path, seed: int = 0) -> WhisperForConditionalGeneration:
    torch.manual_seed(seed)
    hf = WhisperForConditionalGeneration(tiny_whisper_config()).eval()
    hf.save_pretrained(path)
    return hf


class _Seq:
    """One request of the hand-driven engine: its tokens, how many are in the cache, its blocks and cross kv."""

    def __init__(self, prompt: list[int], blocks: list[int], kv: torch.Tensor) -> None:
        self.tokens, self.computed, self.blocks, self.kv = list(prompt), 0, blocks, kv
        self.logits: dict[int, torch.Tensor] = {}  # position -> logits predicting the next token

    def slot(self, pos: int) -> int:
        return self.blocks[pos // BLOCK] * BLOCK + pos % BLOCK


def _step(model: WhisperModel, caches, decodes: list[_Seq], prefills: list[tuple[_Seq, int]]) -> None:
    """One engine step: decode rows first (one per request), then the prefill chunks; greedy token appended to
    every request whose tokens are all in the cache after the step."""
    ids, pos, slots, cross, chunks = [], [], [], [], []
    for s in decodes:
        assert s.computed == len(s.tokens) - 1
        cross.append((len(ids), 1, s.kv))
        ids.append(s.tokens[s.computed]), pos.append(s.computed), slots.append(s.slot(s.computed))
    for s, n in prefills:
        ctx = s.computed + n
        chunks.append(PrefillChunk(len(ids), n, ctx, torch.tensor(s.blocks[: math.ceil(ctx / BLOCK)])))
        cross.append((len(ids), n, s.kv))
        for p in range(s.computed, ctx):
            ids.append(s.tokens[p]), pos.append(p), slots.append(s.slot(p))
    nd = len(decodes)
    width = max((len(s.blocks) for s in decodes), default=1)
    tables = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in decodes] or [[0]])[:nd]
    lens = torch.tensor([s.computed + 1 for s in decodes], dtype=torch.long)
    mask = (torch.arange(width * BLOCK)[None, :] < lens[:, None]).view(nd, 1, 1, width * BLOCK)
    meta = AttentionMetadata(
        block_size=BLOCK,
        slot_mapping=torch.tensor(slots),
        num_decode=nd,
        decode_block_tables=tables if nd else None,
        decode_mask=mask if nd else None,
        decode_lens=lens if nd else None,
        prefills=chunks,
    )
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.tensor(pos), caches, meta, cross=cross)
        logits = model.compute_logits(hidden)
    row = 0
    for s, n in [(s, 1) for s in decodes] + prefills:
        for p in range(s.computed, s.computed + n):
            s.logits[p] = logits[row]
            row += 1
        s.computed += n
        if s.computed == len(s.tokens):
            s.tokens.append(int(s.logits[s.computed - 1].argmax()))
