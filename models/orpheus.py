"""Orpheus-style speech output: the audio-token layout of a TTS decoder, its prompt and its token constraint.

An Orpheus checkpoint (canopylabs/orpheus-3b-0.1-ft: Llama 3.2 3B) extends the Llama 3 vocabulary of 128256 ids with
special tokens and 7 x 4096 audio tokens `<custom_token_N>` = id 128256 + N. The prompt is

    start-of-human 128259, tokenizer("{voice}: {text}") (with its BOS), end-of-text 128009, end-of-human 128260,
    start-of-AI 128261, start-of-speech 128257

and the model answers with audio tokens until end-of-speech 128258. The k-th audio token of the answer sits at frame
position k mod 7 and carries SNAC code N - 10 - 4096 (k mod 7); a frame of 7 codes feeds SNAC's three levels as
level 0 = [c0], level 1 = [c1, c4], level 2 = [c2, c3, c5, c6].

All of these numbers are data of a `SpeechLayout` (Orpheus' values are the defaults), read from `speech_layout.json`
in the checkpoint folder when present, so that a model with another tokenizer declares its own.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

LAYOUT_FILE = "speech_layout.json"


@dataclass(frozen=True)
class SpeechLayout:
    """Where the audio lives in a speech decoder's vocabulary and how its prompt is framed."""

    name: str = "orpheus"
    prompt_prefix: tuple[int, ...] = (128259,)  # start of human
    prompt_suffix: tuple[int, ...] = (128009, 128260, 128261, 128257)  # end of text/human, start of AI/speech
    # `{voice}` and `{text}`; without a voice only the text is used. Tokenized as plain text (control tokens belong in
    # prompt_prefix / prompt_suffix, as ids): the user's text must never spell one.
    prompt_template: str = "{voice}: {text}"
    add_special_tokens: bool = True  # tokenize the text with the tokenizer's own BOS (Orpheus: <|begin_of_text|>)
    start_of_speech: int = 128257  # the prompt's last token
    end_of_speech: int = 128258
    end_of_ai: int = 128262  # closes a prior turn's answer (a created voice's reference turn)
    audio_token_base: int = 128266  # id of code 0 at frame position 0 (<custom_token_10>)
    codebook_size: int = 4096  # codes per frame position; position k's ids follow position k-1's
    frame_levels: tuple[tuple[int, ...], ...] = ((0,), (1, 4), (2, 3, 5, 6))  # frame positions of each codec level
    voices: tuple[str, ...] = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
    default_voice: str = "tara"
    language_code: str = "en"  # BCP-47 language of the voices
    sample_rate: int = 24000  # of the codec
    codec_folder: str = "snac"  # the codec checkpoint (config.json + pytorch_model.bin), relative to the model folder
    temperature: float = 0.6  # default sampling for speech
    top_p: float = 0.8
    repetition_penalty: float = 1.3

    def __post_init__(self) -> None:
        positions = sorted(p for level in self.frame_levels for p in level)
        if positions != list(range(len(positions))) or not positions:
            raise ValueError(f"frame_levels {self.frame_levels} must use each frame position 0..n-1 exactly once")
        if self.codebook_size < 1 or self.audio_token_base < 0:
            raise ValueError("codebook_size must be >= 1 and audio_token_base >= 0")
        audio = range(self.audio_token_base, self.audio_token_base + self.frame_size * self.codebook_size)
        for name in ("start_of_speech", "end_of_speech"):
            if getattr(self, name) in audio:
                raise ValueError(f"{name} {getattr(self, name)} lies inside the audio token range")
        if self.default_voice and self.voices and self.default_voice not in self.voices:
            raise ValueError(f"default_voice {self.default_voice!r} is not one of the voices {self.voices}")
        if "{text}" not in self.prompt_template:
            raise ValueError("prompt_template must contain {text}")

    # --- sizes ---------------------------------------------------------------------------------------------------
    @property
    def frame_size(self) -> int:
        """Audio tokens per frame (7 for SNAC 24 kHz)."""
        return sum(len(level) for level in self.frame_levels)

    @property
    def audio_token_end(self) -> int:
        """One past the last audio token id."""
        return self.audio_token_base + self.frame_size * self.codebook_size

    @property
    def min_vocab_size(self) -> int:
        """The smallest vocabulary that holds every id of the layout."""
        ids = (*self.prompt_prefix, *self.prompt_suffix, self.start_of_speech, self.end_of_speech)
        return max(self.audio_token_end, max(ids) + 1)

    # --- tokens <-> codes ----------------------------------------------------------------------------------------
    def audio_token(self, position: int, code: int) -> int:
        """The token id of `code` at frame position `position`."""
        if not (0 <= position < self.frame_size and 0 <= code < self.codebook_size):
            raise ValueError(
                f"position {position} / code {code} outside [0, {self.frame_size}) / [0, {self.codebook_size})"
            )
        return self.audio_token_base + position * self.codebook_size + code

    def code_of(self, token_id: int, index: int) -> int:
        """The codec code carried by `token_id` as the `index`-th audio token of an answer (raises if misplaced)."""
        position = index % self.frame_size
        code = token_id - self.audio_token_base - position * self.codebook_size
        if not (0 <= code < self.codebook_size):
            raise ValueError(
                f"token {token_id} at audio index {index} is not an audio token of frame position {position}"
            )
        return code

    def frames_to_tokens(self, frames: Sequence[Sequence[int]]) -> list[int]:
        """Frames of codes (in frame-position order) -> the answer's token ids."""
        return [self.audio_token(k, int(c)) for frame in frames for k, c in enumerate(frame)]

    def tokens_to_frames(self, token_ids: Sequence[int], strict: bool = True) -> list[list[int]]:
        """The answer's token ids -> complete frames of codes. A trailing end-of-speech ends the audio; a trailing
        partial frame is dropped. `strict=False` also stops at the first token that is not an audio token of its
        position (instead of raising)."""
        frames: list[list[int]] = []
        frame: list[int] = []
        for i, tok in enumerate(token_ids):
            if tok == self.end_of_speech:
                break
            try:
                frame.append(self.code_of(int(tok), i))
            except ValueError:
                if strict:
                    raise
                break
            if len(frame) == self.frame_size:
                frames.append(frame)
                frame = []
        return frames

    # --- prompt --------------------------------------------------------------------------------------------------
    def prompt_text(self, text: str, voice: str | None) -> str:
        if voice:
            return self.prompt_template.format(voice=voice, text=text)
        return text

    def build_prompt(self, tokenizer: Any, text: str, voice: str | None = None) -> list[int]:
        """Token ids of the speech prompt for `text` in `voice` (the default voice when None; "" for none).

        `tokenizer` is a transformers tokenizer; serving passes `literal_tokenizer(engine.tokenizer)`. The text is
        spoken as text: an added or special token's spelling in it ("<|begin_of_text|>", "<custom_token_5>") is
        tokenized as the characters it is made of (`split_special_tokens`), never as that control or audio token,
        which would inject into the audio-token layout. Text without such spellings tokenizes as before.
        """
        if voice is None:
            voice = self.default_voice
        text = self.prompt_text(text, voice)
        ids = tokenizer(text, add_special_tokens=self.add_special_tokens, split_special_tokens=True)["input_ids"]
        return [*self.prompt_prefix, *ids, *self.prompt_suffix]

    def build_reference_prompt(
        self,
        tokenizer: Any,
        reference_text: str,
        reference_frames: Sequence[Sequence[int]],
        text: str,
        voice: str = "",
    ) -> list[int]:
        """The prompt for `text` in a voice cloned from a reference: the reference as a prior turn (its transcript as
        the human turn, its codes as the answer, closed by end-of-speech and end-of-AI), then `text` without a voice
        name. This is the zero-shot cloning prompt of Orpheus' pretrained checkpoints; the reference turn comes first,
        so every request in that voice shares it as a prompt prefix (the prefix cache computes it once). `voice`
        names a built-in voice in both turns (streamed text: the previous clause as context), "" for none."""
        reference = self.build_prompt(tokenizer, reference_text, voice=voice)
        answer = self.frames_to_tokens(reference_frames)
        return [
            *reference,
            *answer,
            self.end_of_speech,
            self.end_of_ai,
            *self.build_prompt(tokenizer, text, voice=voice),
        ]

    # --- persistence ---------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> SpeechLayout:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown speech layout keys: {sorted(unknown)}")
        data = dict(data)
        for key in ("prompt_prefix", "prompt_suffix", "voices"):
            if key in data:
                data[key] = tuple(data[key])
        if "frame_levels" in data:
            data["frame_levels"] = tuple(tuple(level) for level in data["frame_levels"])
        return cls(**data)

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / LAYOUT_FILE
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, folder: str | Path) -> SpeechLayout | None:
        """The layout declared in `folder/speech_layout.json`, or None when the folder declares none."""
        path = Path(folder) / LAYOUT_FILE
        if not path.is_file():
            return None
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from e


ORPHEUS_LAYOUT = SpeechLayout()


def literal_tokenizer(tokenizer: Any) -> Any:
    """A copy of `tokenizer` that reads added and special tokens' spellings as plain text (`split_special_tokens`).

    A copy, not the engine's tokenizer with the flag per call: a fast tokenizer applies `split_special_tokens` by
    setting its Rust backend's shared `encode_special_tokens` before each encode, so flipping it on a tokenizer that a
    chat prompt is tokenized with in a worker thread (Generate) would race. The copy's flag is set once and stays.
    """
    literal = copy.deepcopy(tokenizer)
    literal.split_special_tokens = True
    return literal


class SpeechTokenConstraint:
    """The engine's per-request token mask for speech answers (engine TokenConstraint protocol).

    The prompt ends with start-of-speech, so the k-th output token is at frame position k mod frame_size: only the
    `codebook_size` audio tokens of that position are allowed, plus end-of-speech at a frame boundary once
    `min_frames` frames exist. The frame_size + 1 masks are built once and shared by every step (and every request
    that shares this object: it holds no per-request state).
    """

    def __init__(
        self,
        layout: SpeechLayout,
        vocab_size: int,
        device: torch.device | str | None = None,
        min_frames: int = 1,
    ) -> None:
        if vocab_size < layout.min_vocab_size:
            raise ValueError(f"vocab_size {vocab_size} cannot hold the speech layout (needs {layout.min_vocab_size})")
        if min_frames < 0:
            raise ValueError("min_frames must be >= 0")
        self.layout = layout
        self.vocab_size = vocab_size
        self.min_frames = min_frames
        device = torch.device(device) if device is not None else torch.device("cpu")
        masks = torch.zeros(layout.frame_size + 1, vocab_size, dtype=torch.bool, device=device)
        for k in range(layout.frame_size):
            start = layout.audio_token_base + k * layout.codebook_size
            masks[k, start : start + layout.codebook_size] = True
        masks[layout.frame_size] = masks[0]
        masks[layout.frame_size, layout.end_of_speech] = True
        self._position_masks = list(masks[: layout.frame_size])
        self._boundary_mask = masks[layout.frame_size]
        # The same sets as id lists (4096 or 4097 of ~157k): a sampler may work on these logits alone.
        self._position_ids = [m.nonzero().flatten() for m in self._position_masks]
        self._boundary_ids = self._boundary_mask.nonzero().flatten()
        self._position_spans = [(int(ids[0]), int(ids[-1]) + 1) for ids in self._position_ids]
        self._boundary_span = (int(self._boundary_ids[0]), int(self._boundary_ids[-1]) + 1)

    def _at_boundary(self, n: int) -> bool:
        return n % self.layout.frame_size == 0 and n // self.layout.frame_size >= self.min_frames

    def allowed(self, output_token_ids: Sequence[int]) -> torch.Tensor:
        n = len(output_token_ids)
        return self._boundary_mask if self._at_boundary(n) else self._position_masks[n % self.layout.frame_size]

    def allowed_ids(self, output_token_ids: Sequence[int]) -> torch.Tensor:
        """The ids `allowed` admits, ascending (int64, on the masks' device): an optional fast path for samplers."""
        n = len(output_token_ids)
        return self._boundary_ids if self._at_boundary(n) else self._position_ids[n % self.layout.frame_size]

    def allowed_span(self, output_token_ids: Sequence[int]) -> tuple[int, int]:
        """[lo, hi) holding every id `allowed_ids` gives: the engine projects only these vocabulary rows."""
        n = len(output_token_ids)
        return self._boundary_span if self._at_boundary(n) else self._position_spans[n % self.layout.frame_size]

    def advance(self, token_ids: Sequence[int]) -> None:
        """Nothing to track: the frame position is the number of output tokens."""

    def rollback(self, num_tokens: int) -> None:
        """Nothing to take back (see advance)."""


def save_random_speech_decoder(
    out_dir: str | Path,
    layout: SpeechLayout = ORPHEUS_LAYOUT,
    seed: int = 0,
    hidden_size: int = 32,
    num_layers: int = 2,
    max_position_embeddings: int = 4096,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Save a small randomly initialised Llama with the layout's vocabulary, a byte-level tokenizer (with a BOS it
    adds, as Llama 3's does) and `speech_layout.json`: a speech decoder that runs end to end and speaks noise.

    The vocabulary must hold every layout id (Orpheus: 156939), so the embedding dominates the size: keep the hidden
    size small (32 -> about 5M parameters, embeddings tied).
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = layout.min_vocab_size
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=256,
        eos_token_id=layout.end_of_speech,
        pad_token_id=257,
    )
    with torch.device("meta"):  # skip transformers' slow init; every weight is drawn below
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.to(dtype).save_pretrained(out_dir)

    # Byte-level BPE without merges: one token per UTF-8 byte, <|begin_of_text|> = 256 prepended to every text.
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in zip(range(256), _byte_level_chars(), strict=True)}
    assert set(byte_to_char.values()) == set(byte_chars)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|begin_of_text|>", "<|pad|>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 256)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", pad_token="<|pad|>"
    )
    fast.save_pretrained(out_dir)
    layout.save(out_dir)
    return out_dir


def _byte_level_chars() -> list[str]:
    """GPT-2's byte -> printable character table (byte order), as the ByteLevel pre-tokenizer uses it."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars
