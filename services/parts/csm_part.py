"""The speech side of a CSM checkpoint (a transformers `CsmForConditionalGeneration` folder): its prompt, voices,
sampling defaults and Mimi codec, as the SpeechService's speech part (services/parts/speech_part.py loads it for a folder
whose config.json says model_type "csm").

CSM's step is a whole frame (engine/frame_step.py), so the engine's outputs carry the frames (`new_frames`) and the
service pushes them to the codec as they come; `CsmLayout` gives the service what it reads of a speech layout
(voices, language, rate, sampling defaults, prompts) and turns the engine's frames into the codec's.

Voices are CSM's speaker ids: "0".."9" (the model takes any integer speaker; a conversation's speakers are its
numbers). A prompt is one CSM turn, `<bos>[speaker]text<eos>`, as the processor's chat template writes it, with the
text tokenized as text (a special token's spelling in it stays characters: no `<|AUDIO|>` injection).

Created voices (CreateVoice) and streamed clauses speak after a context turn with its audio, as transformers'
CsmProcessor builds a conversation: `<bos>[speaker]text<eos>` then one `<|AUDIO|>` per code frame and `<|audio_eos|>`,
whose positions take the frames' summed codebook embeddings (an embedding segment, keyed by the codes: the engine's
prefix cache then holds a voice's reference turn after its first request). services/processing/csm_voice.py builds them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPEAKERS = tuple(str(i) for i in range(10))


def is_csm_folder(path: Path | None) -> bool:
    if path is None or not path.is_dir() or not (path / "config.json").is_file():
        return False
    try:
        return json.loads((path / "config.json").read_text()).get("model_type") == "csm"
    except (OSError, json.JSONDecodeError):
        return False


@dataclass(frozen=True)
class CsmLayout:
    """What the speech service reads of a CSM model (the counterpart of models/orpheus.py SpeechLayout)."""

    num_codebooks: int
    codebook_size: int  # of the codec; the model's vocabulary adds CSM's special codes after it
    eos_code: int
    sample_rate: int
    voices: tuple[str, ...] = SPEAKERS
    default_voice: str = "0"
    language_code: str = "en"
    frame_size: int = 1  # engine tokens per frame: one (codebook 0), the rest come with it
    temperature: float = 0.9  # sesame/csm-1b's generation config; a folder's own generation_config.json wins
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    audio_token_id: int = -1  # <|AUDIO|>: one per context frame
    audio_eos_token_id: int = -1  # <|audio_eos|>: the end frame after a context turn's audio
    # codes (T x N) -> (T x hidden) on the engine's device: the backbone's frame embedding (run on the engine thread)
    embed_frames: Callable[[Sequence[Sequence[int]]], Any] | None = field(default=None, compare=False, repr=False)

    def build_prompt(self, tokenizer: Any, text: str, voice: str | None = None) -> list[int]:
        """One turn of `voice` (a speaker id) saying `text`."""
        speaker = voice or self.default_voice
        ids = tokenizer(f"[{speaker}]{text}", add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return [tokenizer.bos_token_id, *ids, tokenizer.eos_token_id]

    def build_reference_prompt(
        self, tokenizer: Any, reference_text: str, reference_frames: Sequence[Sequence[int]], text: str, voice: str = ""
    ) -> list[int]:
        """`voice` (a speaker id; "" the default) saying `text` after a turn of the same speaker saying
        `reference_text` with `reference_frames` as its audio (a created voice's reference, or the clause before in
        StreamingSynthesizeSpeech): token ids carrying the context's frame embeddings (services/processing/csm_voice.py)."""
        from omnivox.services.processing.csm_voice import context_prompt

        speaker = voice or self.default_voice
        return context_prompt(self, tokenizer, [(speaker, reference_text, reference_frames)], text, speaker)

    def codec_frames(self, frames: Sequence[Sequence[int]]) -> list[list[int]]:
        """The engine's frames as the codec's: a frame of end codes only is not audio (transformers' decode stops
        before it), and special codes past the codebooks (which a trained model does not emit in speech; random
        weights do) become code 0."""
        out = []
        for frame in frames:
            if all(c == self.eos_code for c in frame):
                break
            out.append([c if c < self.codebook_size else 0 for c in frame])
        return out


def load_csm_speech_part(
    folder: Path, device: str | None = None, options=None, tokenizer: Any = None, embed_frames=None
):
    """The SpeechPart of the CSM folder: layout, Mimi codec (its `codec_model.` weights) and decode worker.
    `embed_frames`: the served backbone's frame embedding (CsmLayout.embed_frames), for context turns."""
    from omnivox.codecs.decode_worker import DecodeWorker
    from omnivox.codecs.mimi import MimiDecoder
    from omnivox.codecs.mimi_streaming import MimiStreamDecoder
    from omnivox.services.parts.speech_part import SpeechPart

    config = json.loads((folder / "config.json").read_text())
    codec = MimiDecoder.from_folder(folder, prefix="codec_model.", device=device)
    layout = CsmLayout(
        num_codebooks=int(config["num_codebooks"]),
        codebook_size=codec.codebook_size,
        eos_code=int(config["codebook_eos_token_id"]),
        sample_rate=codec.sample_rate,
        audio_token_id=int(config.get("audio_token_id", -1)),
        audio_eos_token_id=int(config.get("audio_eos_token_id", -1)),
        embed_frames=embed_frames,
    )
    if codec.num_codebooks < layout.num_codebooks:
        raise ValueError(f"the Mimi codec has {codec.num_codebooks} codebooks, the model emits {layout.num_codebooks}")
    if options is not None:  # serve --speech-first-hop: its hops; Mimi decodes exactly, with no context around
        options = dataclasses.replace(options, left_context_frames=0, lookahead_frames=0, crossfade_samples=0)
    worker = DecodeWorker(MimiStreamDecoder(codec, options, layout.num_codebooks), sized_start=options is None)
    return SpeechPart(layout=layout, codec=codec, worker=worker, constraint=None, text_tokenizer=tokenizer)
