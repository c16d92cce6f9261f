"""A tiny random Voxtral checkpoint as the hub ships one: config + safetensors + the Tekken tokenizer (tekken.json) +
the processor (WhisperFeatureExtractor + transformers' `MistralCommonBackend` over the tekken file).

The tekken file is built here (no download): mistral_common's schema (`Tekkenizer.from_file`): a byte-level vocab
(the 256 bytes, then a few merges, each a base64 `token_bytes` at its rank), special tokens at the ranks the real
Voxtral tokenizer uses ([INST] 3, [/INST] 4, [AUDIO] 24, [BEGIN_AUDIO] 25, [TRANSCRIBE] 34; fillers elsewhere),
version v7 (system prompts as turns of their own, transcription requests) and the real audio section (16 kHz, 12.5
embeddings per second, 30 s chunks): 375 [AUDIO] per started 30 s, as the encoder gives.
"""

from __future__ import annotations

import base64
import json
import tempfile
from pathlib import Path

import transformers

from support.audio_checkpoints import make_voxtral

_NAMED = {
    0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]", 5: "[AVAILABLE_TOOLS]", 6: "[/AVAILABLE_TOOLS]",
    7: "[TOOL_RESULTS]", 8: "[/TOOL_RESULTS]", 9: "[TOOL_CALLS]", 10: "[IMG]", 11: "<pad>", 12: "[IMG_BREAK]",
    13: "[IMG_END]", 14: "[PREFIX]", 15: "[MIDDLE]", 16: "[SUFFIX]", 17: "[SYSTEM_PROMPT]", 18: "[/SYSTEM_PROMPT]",
    19: "[TOOL_CONTENT]", 24: "[AUDIO]", 25: "[BEGIN_AUDIO]", 32: "[ARGS]", 33: "[CALL_ID]", 34: "[TRANSCRIBE]",
}  # fmt: skip
NUM_SPECIAL = 40
# Each merge joins two tokens already in the vocab (tiktoken's rule for mergeable ranks).
_MERGES = [b"th", b"he", b"the", b" t", b" the", b"an", b"in", b"er", b"on", b"re", b"at", b"en", b" a", b"is", b"ng",
           b"ing", b"ou", b"you", b" you", b"wh", b"what", b" is"]  # fmt: skip
# Tekken's pre-tokenisation pattern (the real file's).
_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
AUDIO_SECTION = {
    "sampling_rate": 16000,
    "frame_rate": 12.5,
    "audio_encoding_config": {"num_mel_bins": 128, "hop_length": 160, "window_size": 400},
    "chunk_length_s": 30.0,
}


def write_tekken(path: Path, audio: dict | None = None, version: str = "v7") -> int:
    """Write a tiny tekken.json at `path`; returns its vocabulary size (special tokens + byte-level vocab).
    `version`: mistral_common's tokenizer version (v11+ writes calls as `[TOOL_CALLS]name[ARGS]{...}`)."""
    vocab = [bytes([i]) for i in range(256)] + _MERGES
    data = {
        "config": {
            "pattern": _PATTERN,
            "num_vocab_tokens": len(vocab),
            "default_vocab_size": NUM_SPECIAL + len(vocab),
            "default_num_special_tokens": NUM_SPECIAL,
            "version": version,
        },
        "vocab": [
            {"rank": i, "token_bytes": base64.b64encode(b).decode(), "token_str": b.decode("utf-8", "replace")}
            for i, b in enumerate(vocab)
        ],
        "special_tokens": [
            {"rank": i, "token_str": _NAMED.get(i, f"<SPECIAL_{i}>"), "is_control": True} for i in range(NUM_SPECIAL)
        ],
        "audio": AUDIO_SECTION if audio is None else audio,
        "version": 1,
        "type": "Tekken",
    }
    path.write_text(json.dumps(data))
    return NUM_SPECIAL + len(vocab)


def make_voxtral_bundle(out: Path, seed: int = 0, audio: dict | None = None, version: str = "v7") -> Path:
    """The tiny Voxtral of `make_voxtral` with its tekken.json and processor saved next to it (AutoProcessor loads
    a VoxtralProcessor whose tokenizer is a MistralCommonBackend)."""
    with tempfile.TemporaryDirectory() as d:  # save_pretrained copies the tokenizer's own file
        vocab_size = write_tekken(Path(d) / "tekken.json", audio, version)
        tokenizer = transformers.MistralCommonBackend.from_pretrained(d)
        make_voxtral(out, seed=seed, vocab_size=vocab_size)
        fe = transformers.WhisperFeatureExtractor(feature_size=128)
        transformers.VoxtralProcessor(feature_extractor=fe, tokenizer=tokenizer).save_pretrained(out)
    return out
