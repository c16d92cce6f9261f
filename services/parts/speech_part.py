"""The speech side of a served model: a checkpoint with `speech_layout.json` + a SNAC codec folder (models/orpheus.py)
becomes a SpeechPart (layout, codec, decode worker, token constraint); services/parts/bundle.py attaches it to the bundle."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnivox.codecs.decode_worker import DecodeWorker
    from omnivox.codecs.mimi import MimiDecoder
    from omnivox.codecs.snac import SnacDecoder
    from omnivox.codecs.streaming import StreamingOptions
    from omnivox.models.orpheus import SpeechLayout, SpeechTokenConstraint
    from omnivox.services.parts.csm_part import CsmLayout


def is_speech_checkpoint(path: Path | None) -> bool:
    """An Orpheus-layout folder (speech_layout.json + SNAC); a CSM folder is services/parts/csm_part.py's (services/parts/table.py
    asks both)."""
    from omnivox.models.orpheus import LAYOUT_FILE

    return path is not None and path.is_dir() and (path / LAYOUT_FILE).is_file()


@dataclass
class SpeechPart:
    """The speech side of a bundle: where audio tokens live (layout), the codec, its decode worker, the constraint."""

    layout: SpeechLayout | CsmLayout
    codec: SnacDecoder | MimiDecoder
    worker: DecodeWorker
    # Stateless: shared by every request through engine.params.shared. None for a model whose engine outputs carry
    # whole frames (CSM): it samples codes only.
    constraint: SpeechTokenConstraint | None
    # The engine's tokenizer reading special tokens' spellings as text (models/orpheus.py literal_tokenizer): every
    # speech prompt is tokenized with it. None only for a part loaded without a tokenizer (codec tests).
    text_tokenizer: Any = None

    def sampling_defaults(self) -> dict[str, Any]:
        """The layout's sampling values (they win over the decoder's generation_config.json)."""
        layout = self.layout
        return {
            "temperature": layout.temperature,
            "top_p": layout.top_p,
            "repetition_penalty": layout.repetition_penalty,
        }


def load_speech_part(
    folder: Path,
    vocab_size: int,
    device: str | None = None,
    options: StreamingOptions | None = None,
    tokenizer: Any = None,
) -> SpeechPart:
    """Layout, codec, decode worker and token constraint of the Orpheus-layout speech model in `folder` (blocking;
    a CSM folder loads through services/parts/csm_part.py load_csm_speech_part)."""
    from omnivox.codecs.decode_worker import DecodeWorker
    from omnivox.codecs.snac import SnacDecoder
    from omnivox.codecs.streaming import BatchedStreamDecoder
    from omnivox.models.orpheus import LAYOUT_FILE, SpeechLayout, SpeechTokenConstraint, literal_tokenizer

    layout = SpeechLayout.load(folder)
    if layout is None:
        raise ValueError(f"{folder} has no {LAYOUT_FILE}: it is not a speech model")
    codec = SnacDecoder.from_folder(folder / layout.codec_folder, device=device)
    if codec.sample_rate != layout.sample_rate:
        raise ValueError(f"the codec runs at {codec.sample_rate} Hz, the layout says {layout.sample_rate} Hz")
    static = None
    if codec.device.type == "cuda":  # fixed-shape passes as CUDA graphs, on the codec's own stream, built here at load
        from omnivox.codecs.codec_graphs import StaticCodec, frame_buckets_for
        from omnivox.codecs.streaming import StreamingOptions

        window = (options or StreamingOptions()).window_frames()
        static = StaticCodec(codec, layout.frame_levels, frame_buckets_for(window))
        static.build_all()
    decoder = BatchedStreamDecoder(codec, layout.frame_levels, options, static=static)
    constraint = SpeechTokenConstraint(layout, vocab_size, device=device)
    # Options given (serve --speech-first-hop): every stream starts with them; else sized from the measured rates.
    worker = DecodeWorker(decoder, sized_start=options is None)
    text_tokenizer = literal_tokenizer(tokenizer) if tokenizer is not None else None
    return SpeechPart(layout=layout, codec=codec, worker=worker, constraint=constraint, text_tokenizer=text_tokenizer)
