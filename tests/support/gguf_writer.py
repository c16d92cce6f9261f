"""What every test GGUF writer puts in a file the same way: the decoder's shape keys and the test BPE tokenizer.

tests/test_checkpoint.py (dense), tests/test_decoder_families_gguf.py (Phi-3, Gemma) and tests/test_gguf_moe.py (MoE)
each add their family's own keys and tensors around these, as llama.cpp's convert_hf_to_gguf.py does.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import transformers


def add_shape(writer: gguf.GGUFWriter, config: transformers.PretrainedConfig) -> None:
    """Layer count, context, widths, heads, RMS epsilon and vocabulary size."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)


def add_norm_and_vocab(writer: gguf.GGUFWriter, config: transformers.PretrainedConfig) -> None:
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


def add_bpe_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, *, chat_template: bool = True) -> None:
    """The folder's byte-level BPE tokenizer.json as llama.cpp's "gpt2" model (BOS 1, EOS 2, PAD 0); with
    `chat_template`, BOS not added and the folder's template too (what a served file carries)."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tokens = sorted(tok["model"]["vocab"], key=tok["model"]["vocab"].get)
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    if chat_template:
        writer.add_add_bos_token(False)
        writer.add_chat_template(transformers.AutoTokenizer.from_pretrained(hf_dir).chat_template)
