"""Tiny random audio-LLM checkpoints saved with `save_pretrained`, each with its processor and chat template, and
the audio the tests make (tones, chirps, noise; espeak-ng speech where installed).

The tokenizer is the embedded SmolLM2 GGUF's plus the family's audio tokens. Every parameter is perturbed a little so
that no weight sits at an init value that could hide a mistake (norms at 1, biases at 0).
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import soundfile
import torch
import transformers
from transformers.models.qwen3_asr.feature_extraction_qwen3_asr import Qwen3ASRFeatureExtractor

from omnivox.models.checkpoint import load_tokenizer
from omnivox.services.parts.defaults import ensure_default_model

QWEN2_AUDIO_TOKENS = {
    "audio_token": "<|AUDIO|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
QWEN3_ASR_TOKENS = {
    "audio_token": "<|audio_pad|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
# Qwen3-ASR's shape of prompt (system context, the audio in the user turn, the assistant answers
# "language X<asr_text>..."); a real checkpoint brings its own template.
QWEN3_ASR_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)


def tokenizer_with(tokens: dict[str, str]) -> transformers.PreTrainedTokenizerBase:
    """SmolLM2's tokenizer with the named audio tokens added (as `tokenizer.audio_token` etc.)."""
    tok = load_tokenizer(ensure_default_model(progress=False))
    tok.add_special_tokens({"additional_special_tokens": list(tokens.values())})
    with tempfile.TemporaryDirectory() as d:  # named special tokens are set at load time only
        tok.save_pretrained(d)
        return transformers.AutoTokenizer.from_pretrained(d, extra_special_tokens=tokens)


def _save(model_cls, config, processor, out: Path, seed: int, adjust=None) -> Path:
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        if adjust is not None:
            adjust(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def make_qwen2_audio(out: Path, seed: int = 0) -> Path:
    """Qwen2-Audio: 128 mel bins, the real 30 s window (1500 positions), d_model 32, Qwen2 text of width 32."""
    tok = tokenizer_with(QWEN2_AUDIO_TOKENS)
    config = transformers.Qwen2AudioConfig(
        audio_config=dict(
            num_mel_bins=128,
            encoder_layers=2,
            encoder_attention_heads=4,
            encoder_ffn_dim=64,
            d_model=32,
            max_source_positions=1500,
        ),
        text_config=dict(model_type="qwen2", vocab_size=len(tok), **_TEXT),
        audio_token_id=tok.convert_tokens_to_ids(QWEN2_AUDIO_TOKENS["audio_token"]),
    )
    fe = transformers.WhisperFeatureExtractor(feature_size=128)
    processor = transformers.Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok)  # its default chat template
    return _save(transformers.Qwen2AudioForConditionalGeneration, config, processor, out, seed)


def make_qwen3_asr(out: Path, seed: int = 0) -> Path:
    """Qwen3-ASR: 128 mel bins, 1 s conv chunks, attention windows of 2 s (real: 8 s) so short clips span several."""
    tok = tokenizer_with(QWEN3_ASR_TOKENS)
    config = transformers.Qwen3ASRConfig(
        audio_config=dict(
            num_mel_bins=128,
            encoder_layers=2,
            encoder_attention_heads=4,
            encoder_ffn_dim=64,
            d_model=32,
            output_dim=32,
            n_window=50,
            n_window_infer=200,
            downsample_hidden_size=16,
        ),
        # Untied (the real 0.6B ties): a tiny tied Qwen3 repeats one token whatever its input.
        text_config=dict(model_type="qwen3", vocab_size=len(tok), head_dim=16, tie_word_embeddings=False, **_TEXT),
        tie_word_embeddings=False,
        audio_token_id=tok.convert_tokens_to_ids(QWEN3_ASR_TOKENS["audio_token"]),
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
        eos_token_id=tok.eos_token_id,
    )
    fe = Qwen3ASRFeatureExtractor(feature_size=128, n_window=50)
    processor = transformers.Qwen3ASRProcessor(feature_extractor=fe, tokenizer=tok, chat_template=QWEN3_ASR_TEMPLATE)
    return _save(transformers.Qwen3ASRForConditionalGeneration, config, processor, out, seed, _audio_that_matters)


def _audio_that_matters(model) -> None:
    """At init scale (std 0.02) Qwen3-ASR's three convolutions shrink the mel content to nothing next to the sinusoidal
    positions added after them, and the projector's output is ~0.006 against text embeddings of 0.02: greedy tokens
    came out the same for a chirp, noise and a tone (only the clip's length mattered), so a parity test could not see
    a wrong feature. Fan-in-scaled convolutions and a 10x projector make the content decide the tokens."""
    tower = model.model.audio_tower
    for conv in (tower.conv2d1, tower.conv2d2, tower.conv2d3, tower.conv_out):
        conv.weight.normal_(0.0, conv.weight[0].numel() ** -0.5)
    model.model.multi_modal_projector.linear_2.weight.mul_(10.0)


def make_voxtral(out: Path, seed: int = 0, vocab_size: int = 512) -> Path:
    """Voxtral: 128 mel bins, the real 30 s chunk (1500 positions), d_model 32 (4 frames per embedding), Llama text.

    The feature extractor alone is saved (preprocessor_config.json); tests/support/voxtral_checkpoint.py adds the Tekken
    tokenizer and processor that serving needs."""
    config = transformers.VoxtralConfig(
        audio_config=dict(
            num_mel_bins=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            hidden_size=32,
            intermediate_size=128,
            max_source_positions=1500,
        ),
        text_config=dict(model_type="llama", vocab_size=vocab_size, head_dim=8, **_TEXT),
        audio_token_id=24,
    )
    torch.manual_seed(seed)
    model = transformers.VoxtralForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    transformers.WhisperFeatureExtractor(feature_size=128).save_pretrained(out)
    return out


# --- audio the tests make --------------------------------------------------------------------------------------------
def tone(seconds: float, rate: int = 16000, freq: float = 440.0, amp: float = 0.3) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def chirp(seconds: float, rate: int = 16000, f0: float = 100.0, f1: float = 6000.0, amp: float = 0.4) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    phase = 2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * max(seconds, 1e-9)))
    return (amp * np.sin(phase)).astype(np.float32)


def noise(seconds: float, rate: int = 16000, amp: float = 0.1, seed: int = 0) -> np.ndarray:
    return (amp * np.random.default_rng(seed).standard_normal(round(seconds * rate))).astype(np.float32)


def encode(samples: np.ndarray, rate: int, fmt: str, subtype: str = "PCM_16") -> bytes:
    """samples [N] or [N, channels] as a WAV / FLAC / OGG / MP3 file's bytes."""
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def espeak_wav(text: str) -> bytes | None:
    """espeak-ng speech as WAV bytes, or None when espeak-ng is not installed."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        return None
    return subprocess.run([exe, "--stdout", text], capture_output=True, check=True, timeout=60).stdout
