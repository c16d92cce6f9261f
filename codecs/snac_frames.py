"""SNAC's framing: what a configuration implies (`CodecShape`), and codes regrouped per frame and per level.

A code "frame" is the group of codes that covers `vq_strides[0]` latent steps: one code of the coarsest level, two of
the next, ... (1 + 2 + 4 = 7 codes and 2048 samples for the 24 kHz model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CodecShape:
    """What a SNAC configuration implies for framing."""

    sample_rate: int
    hop_length: int  # samples per latent step
    vq_strides: tuple[int, ...]  # latent steps per code, per level (coarsest first)
    codebook_size: int

    @property
    def latent_steps_per_frame(self) -> int:
        return self.vq_strides[0]

    @property
    def codes_per_level(self) -> tuple[int, ...]:
        return tuple(self.vq_strides[0] // s for s in self.vq_strides)

    @property
    def codes_per_frame(self) -> int:
        return sum(self.codes_per_level)

    @property
    def frame_samples(self) -> int:
        return self.hop_length * self.latent_steps_per_frame


def snac_config_shape(config: dict) -> CodecShape:
    strides = tuple(int(s) for s in config["vq_strides"])
    if any(strides[0] % s for s in strides):
        raise ValueError(f"vq_strides {strides}: every stride must divide the first")
    return CodecShape(
        sample_rate=int(config["sampling_rate"]),
        hop_length=int(math.prod(config["encoder_rates"])),
        vq_strides=strides,
        codebook_size=int(config["codebook_size"]),
    )


def frames_to_codes(frames: torch.Tensor, frame_levels: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """frames (B x T x F) -> one tensor per level (B x T*len(frame_levels[i])).

    `frame_levels[i]` lists the positions within a frame that hold level i's codes, in time order; e.g. Orpheus'
    ((0,), (1, 4), (2, 3, 5, 6)).
    """
    if frames.dim() != 3:
        raise ValueError(f"frames must be (batch, frames, codes_per_frame), got shape {tuple(frames.shape)}")
    width = sum(len(p) for p in frame_levels)
    if frames.shape[2] != width:
        raise ValueError(f"frames have {frames.shape[2]} codes each, the frame layout has {width}")
    batch, count = frames.shape[0], frames.shape[1]
    return [frames[:, :, list(pos)].reshape(batch, count * len(pos)) for pos in frame_levels]


def codes_to_frames(codes: Sequence[torch.Tensor], frame_levels: Sequence[Sequence[int]]) -> torch.Tensor:
    """The inverse of `frames_to_codes`."""
    batch = codes[0].shape[0]
    count = codes[0].shape[1] // len(frame_levels[0])
    width = sum(len(p) for p in frame_levels)
    frames = torch.empty(batch, count, width, dtype=codes[0].dtype, device=codes[0].device)
    for c, pos in zip(codes, frame_levels, strict=True):
        frames[:, :, list(pos)] = c.reshape(batch, count, len(pos))
    return frames
