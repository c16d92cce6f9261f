"""Channels to mono as ffmpeg mixes them, and what a WAV header says about its channels and length.

Speech models take mono. openai-whisper (and most pipelines users compare us with) decode through
`ffmpeg -ac 1 -f s16le`: libswresample's rematrix with its defaults (center_mix_level and surround_mix_level
-3 dB, lfe_mix_level 0: the LFE channel is left out), each row then scaled so its weights sum to 1 (the integer
output's normalisation). That gives, for mono out of:
- front left / right, front left / right of centre: 1/sqrt(2) each; front centre: 1 (center_mix_level x sqrt(2));
- back / side left and right, back centre: 1/2 each (surround_mix_level / sqrt(2));
- LFE: 0 (a rumble channel: averaged in, it adds 1/6 of a 5.1 file's bass and nothing of its speech);
then normalised. Stereo comes out as the plain mean, as before.

Which channel is which: a WAVE_FORMAT_EXTENSIBLE header's channel mask when present; else ffmpeg's guess for the
count, used here only for 6 and 8 channels (5.1 and 7.1, the LFE 4th in WAV / FLAC order, 6th or 8th in Ogg's
Vorbis order); any other count without a mask is averaged (every channel 1/n).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_SQRT1_2 = 0.5**0.5
# WAVE_FORMAT_EXTENSIBLE speaker bits (ksmedia.h), in the order channels are stored, with their mono weight.
_SPEAKERS: tuple[tuple[str, float], ...] = (
    ("FL", _SQRT1_2),
    ("FR", _SQRT1_2),
    ("FC", 1.0),
    ("LFE", 0.0),
    ("BL", 0.5),
    ("BR", 0.5),
    ("FLC", _SQRT1_2),
    ("FRC", _SQRT1_2),
    ("BC", 0.5),
    ("SL", 0.5),
    ("SR", 0.5),
)
_WEIGHT = dict(_SPEAKERS)
# ffmpeg's default layouts for a count with no mask (av_channel_layout_default), in each container's order.
_GUESSED = {
    ("WAV", 6): ("FL", "FR", "FC", "LFE", "BL", "BR"),
    ("WAV", 8): ("FL", "FR", "FC", "LFE", "BL", "BR", "SL", "SR"),
    ("OGG", 6): ("FL", "FC", "FR", "BL", "BR", "LFE"),  # Vorbis I channel order
    ("OGG", 8): ("FL", "FC", "FR", "SL", "SR", "BL", "BR", "LFE"),
}
_GUESSED[("FLAC", 6)], _GUESSED[("FLAC", 8)] = _GUESSED[("WAV", 6)], _GUESSED[("WAV", 8)]


# Writers that cannot seek back put a placeholder in the data chunk's size: 0, 0xFFFFFFFF (ffmpeg, ours), 0x7FFFFFFF
# (arecord) or thereabouts; any size this close to 2 GiB is one (the files we take are at most 64 MiB).
_UNKNOWN_SIZE = 0x7FFF0000


@dataclass(frozen=True)
class WavFacts:
    """What a WAV header says: the channel mask (None without WAVE_FORMAT_EXTENSIBLE or when 0), and the data
    chunk's declared size against the bytes that follow it (`declared` None: a streaming placeholder, 0 or near
    2^31 / 2^32, meaning "to the end of the file")."""

    channel_mask: int | None
    declared: int | None
    available: int
    size_field: int  # offset of the data chunk's size in the file
    zero_size: bool  # the size says 0 (libsndfile then reads no samples; ffmpeg reads to the end)

    @property
    def missing_bytes(self) -> int:
        return max(0, self.declared - self.available) if self.declared is not None else 0


def with_data_to_the_end(data: bytes, facts: WavFacts) -> bytes:
    """The file with a data size of 0 replaced by the bytes that follow (what ffmpeg reads: Python's `wave` module and
    other writers that cannot seek back leave 0 there); other files unchanged."""
    if not facts.zero_size or facts.available <= 0:
        return data
    return data[: facts.size_field] + struct.pack("<I", facts.available) + data[facts.size_field + 4 :]


def wav_facts(data: bytes) -> WavFacts | None:
    """The channel mask and data sizes of a RIFF/WAVE file's header; None when its chunks cannot be walked."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    pos, mask = 12, None
    while pos + 8 <= len(data):
        kind, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        if kind == b"fmt " and size >= 24 and pos + 28 <= len(data):
            tag = struct.unpack("<H", data[pos + 8 : pos + 10])[0]
            if tag == 0xFFFE:
                mask = struct.unpack("<I", data[pos + 28 : pos + 32])[0] if pos + 32 <= len(data) else None
        if kind == b"data":
            available = len(data) - (pos + 8)
            declared = None if size == 0 or size >= _UNKNOWN_SIZE else size
            return WavFacts(mask or None, declared, available, pos + 4, size == 0)
        pos += 8 + size + size % 2
    return None


def mono_weights(channels: int, container: str, channel_mask: int | None = None) -> np.ndarray | None:
    """[channels] float32 weights summing to 1 for the mono mix, or None for the plain mean."""
    names: tuple[str, ...] | None = None
    if channel_mask:
        bits = [name for i, (name, _) in enumerate(_SPEAKERS) if channel_mask >> i & 1]
        # Speakers past SR (top channels, ...) or a mask that does not name every channel: the plain mean.
        if channel_mask < 1 << len(_SPEAKERS) and len(bits) == channels:
            names = tuple(bits)
    elif (container, channels) in _GUESSED:
        names = _GUESSED[(container, channels)]
    if names is None or channels < 2:
        return None
    w = np.array([_WEIGHT[n] for n in names], dtype=np.float64)
    if w.sum() <= 0:  # only LFE channels: nothing else to hear
        return None
    return (w / w.sum()).astype(np.float32)


def to_mono(pcm: np.ndarray, container: str, channel_mask: int | None = None) -> np.ndarray:
    """pcm [frames, channels] float32 -> [frames] float32, mixed as ffmpeg mixes to mono (see the module doc)."""
    channels = pcm.shape[1]
    if channels == 1:
        return pcm[:, 0]
    weights = mono_weights(channels, container, channel_mask)
    if weights is None:
        return pcm.mean(axis=1, dtype=np.float32)
    return (pcm @ weights).astype(np.float32)
