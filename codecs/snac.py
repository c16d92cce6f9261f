"""SNAC audio decoding: codes -> waveform, deterministic, batched, device and dtype aware.

Loads the published SNAC format (hubertsiuzdak/snac_24khz: `config.json` + `pytorch_model.bin`) from a local folder
through the `snac` package, then makes two changes that do not alter the weights:

- weight norm is folded into plain weights once (the same arithmetic `snac` repeats on every call);
- each decoder block's noise injection (`x + randn * linear(x)`, drawn from the global RNG in `snac`) draws its noise
  from a `NoiseSource` instead. The default, `PositionalNoise`, is a hash of (seed, layer, absolute time step), so the
  noise at a time step does not depend on the window, the batch or the call order: decoding a window of a stream gives
  the same samples as decoding the whole stream, which is what seamless streaming and batched decoding rely on.
  `noise="off"` drops the noise term.

A code "frame" is the group of codes that covers `vq_strides[0]` latent steps: one code of the coarsest level, two of
the next, ... (1 + 2 + 4 = 7 codes and 2048 samples for the 24 kHz model).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from snac import SNAC
from snac.layers import DecoderBlock, NoiseBlock, Snake1d
from torch import nn
from torch.nn.utils import parametrize

from omnivox.codecs.codec_kernels import fuse_snakes
from omnivox.codecs.snac_fast import speed_up_convs

# hubertsiuzdak/snac_24khz config.json: the codec of Orpheus.
SNAC_24KHZ_CONFIG: dict = {
    "sampling_rate": 24000,
    "encoder_dim": 48,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "pytorch_model.bin"


class NoiseSource(Protocol):
    """Noise for the decoder's noise-injection layers.

    `noise(layer, start_steps, num_steps, dtype, device)` returns a tensor (B x 1 x T) for the `layer`-th noise block;
    row b covers that layer's time steps [start_steps[b], start_steps[b] + num_steps).
    """

    def __call__(
        self, layer: int, start_steps: torch.Tensor, num_steps: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...


_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix on int64 tensors holding values in [0, 2^32); no product exceeds 2^60."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def _hash32_int(x: int) -> int:
    """`_hash32` on one Python int: the same bits, no tensor, no device sync (usable inside a CUDA graph capture)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


class PositionalNoise:
    """Standard normal noise that is a pure function of (seed, layer, absolute time step) (Box-Muller on a hash)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)

    def __call__(
        self, layer: int, start_steps: torch.Tensor, num_steps: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        salt = _hash32_int((self.seed * 131 + layer * 7919 + 12345) & _MASK32)  # no .item(): graph-capturable
        steps = start_steps.to(device=device, dtype=torch.int64)[:, None] + torch.arange(num_steps, device=device)
        key = (steps * 2) & _MASK32  # (B x T)
        u1 = _hash32(key ^ salt)
        u2 = _hash32(((key + 1) & _MASK32) ^ salt)
        u1 = (u1.to(torch.float32) + 0.5) * 2.0**-32  # in (0, 1): log is finite
        u2 = (u2.to(torch.float32) + 0.5) * 2.0**-32
        normal = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
        return normal.to(dtype)[:, None, :]  # (B x 1 x T)


class _EagerSnake(nn.Module):
    """snac's Snake1d, x + 1/alpha * sin(alpha x)^2, computed in place in eager mode: the same arithmetic in the same
    order (so the same bits), without TorchScript's per-shape profiling recompiles (seconds per new window length on
    CPU) and with one temporary instead of five (the activations dominate CPU decode time)."""

    def __init__(self, snake: Snake1d) -> None:
        super().__init__()
        self.alpha = snake.alpha  # (1 x C x 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B x C x T)
        inv_alpha = (self.alpha + 1e-9).reciprocal()
        t = torch.mul(self.alpha, x)
        t.sin_().square_().mul_(inv_alpha)
        return t.add_(x)


class _InjectedNoise(nn.Module):
    """Replaces snac's NoiseBlock: `x + noise * linear(x)` with noise from a NoiseSource (or none)."""

    def __init__(self, block: NoiseBlock, layer: int, owner: SnacDecoder) -> None:
        super().__init__()
        self.linear = block.linear
        self.layer = layer
        self._owner = [owner]  # a list, so that the owner is not registered as a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B x C x T)
        owner = self._owner[0]
        if owner.noise is None:
            return x
        upsample = owner._steps_per_latent[self.layer]
        start = owner._call_start_latent * upsample  # (B,)
        noise = owner.noise(self.layer, start, x.shape[-1], x.dtype, x.device)
        # one fused pass: `x + noise * linear(x)` broadcast (B x 1 x T) over the channels at ~1/10 the speed here
        # (2 x 128 x 18432, one thread: 26.8 vs 2.8 ms); the same value up to the fused multiply-add's rounding
        return torch.addcmul(x, noise, self.linear(x))


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


class SnacDecoder:
    """Decodes SNAC codes to audio. Thread-safe (one decode at a time); inference only.

    Shapes: codes are a list with one int tensor (B x T*codes_per_level[i]) per level; `decode` returns (B x samples)
    float audio in [-1, 1]. `decode_frames` takes frames (B x T x codes_per_frame) in a frame layout (see
    `frames_to_codes`). `start_frames` (B,) places each row on the stream's timeline (used only by the noise).
    """

    def __init__(
        self,
        model: SNAC,
        config: dict,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        noise: str | NoiseSource | None = "positional",
        noise_seed: int = 0,
        fast_convs: bool = True,
        c_kernels: bool = True,
    ) -> None:
        self.config = dict(config)
        self.shape = snac_config_shape(config)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype or torch.float32
        if noise == "positional":
            self.noise: NoiseSource | None = PositionalNoise(noise_seed)
        elif noise == "off" or noise is None:
            self.noise = None
        elif callable(noise):
            self.noise = noise
        else:
            raise ValueError(f"noise must be 'positional', 'off' or a NoiseSource, got {noise!r}")
        model.encoder = None  # decoding only
        model.eval()
        for module in model.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        for module in list(model.modules()):
            for name, child in module.named_children():
                if isinstance(child, Snake1d):
                    setattr(module, name, _EagerSnake(child))
        # Latent -> each decoder block's time resolution, for the noise positions.
        self._steps_per_latent: list[int] = []
        rate = 1
        layer = 0
        for block in model.decoder.model:
            if isinstance(block, DecoderBlock):
                rate *= int(block.block[1].stride[0])
                for i, sub in enumerate(block.block):
                    if isinstance(sub, NoiseBlock):
                        block.block[i] = _InjectedNoise(sub, layer, self)
                        self._steps_per_latent.append(rate)
                        layer += 1
        if fast_convs:  # the same convolutions in faster CPU forms (codecs/snac_fast.py: measured there)
            speed_up_convs(model.decoder, c_kernels)
            if c_kernels:  # Snake in one C pass (codecs/codec_kernels.py)
                fuse_snakes(model.decoder, _EagerSnake)
        self.model = model.to(device=self.device, dtype=self.dtype)
        self._call_start_latent = torch.zeros(1, dtype=torch.int64)
        self._lock = threading.Lock()

    @classmethod
    def from_folder(
        cls,
        path: str | Path,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        noise: str | NoiseSource | None = "positional",
        noise_seed: int = 0,
        fast_convs: bool = True,
        c_kernels: bool = True,
    ) -> SnacDecoder:
        """Load `config.json` + `pytorch_model.bin` (the published SNAC format) from a local folder."""
        path = Path(path)
        config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
        if not config_path.is_file() or not weights_path.is_file():
            raise FileNotFoundError(f"{path}: a SNAC folder needs {CONFIG_FILE} and {WEIGHTS_FILE}")
        config = json.loads(config_path.read_text())
        model = SNAC(**config)
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
        model.load_state_dict(state)  # the legacy weight_g/weight_v names are converted by torch's weight_norm hook
        return cls(
            model,
            config,
            device=device,
            dtype=dtype,
            noise=noise,
            noise_seed=noise_seed,
            fast_convs=fast_convs,
            c_kernels=c_kernels,
        )

    @property
    def sample_rate(self) -> int:
        return self.shape.sample_rate

    @property
    def frame_samples(self) -> int:
        return self.shape.frame_samples

    @torch.inference_mode()
    def decode(self, codes: Sequence[torch.Tensor], start_frames: torch.Tensor | None = None) -> torch.Tensor:
        """codes[i]: (B x T*codes_per_level[i]) -> audio (B x T*frame_samples), float32 on the decoder's device."""
        if len(codes) != len(self.shape.vq_strides):
            raise ValueError(f"expected {len(self.shape.vq_strides)} code levels, got {len(codes)}")
        batch = codes[0].shape[0]
        frames = codes[0].shape[1] // self.shape.codes_per_level[0]
        for level, (c, per) in enumerate(zip(codes, self.shape.codes_per_level, strict=True)):
            if c.dim() != 2 or c.shape[0] != batch or c.shape[1] != frames * per:
                raise ValueError(f"level {level}: expected shape ({batch}, {frames * per}), got {tuple(c.shape)}")
        for level, c in enumerate(codes):
            if c.numel() and (int(c.min()) < 0 or int(c.max()) >= self.shape.codebook_size):
                raise ValueError(f"level {level}: codes must be in [0, {self.shape.codebook_size})")
        if start_frames is None:
            start_frames = torch.zeros(batch, dtype=torch.int64)
        codes = [c.to(device=self.device, dtype=torch.int64) for c in codes]
        start_latent = start_frames.to(self.device, torch.int64) * self.shape.latent_steps_per_frame
        return self.decode_unchecked(codes, start_latent)

    @torch.inference_mode()
    def decode_unchecked(self, codes: Sequence[torch.Tensor], start_latent: torch.Tensor) -> torch.Tensor:
        """`decode` without its checks and host syncs (codecs/codec_graphs.py captures it in CUDA graphs): codes
        already valid and on the device, `start_latent` (B,) int64 on the device, in latent steps."""
        with self._lock:
            self._call_start_latent = start_latent
            z_q = self._codes_to_latent(codes)  # (B x D x T_latent)
            audio = self.model.decoder(z_q)  # (B x 1 x samples)
        return audio[:, 0, :].float()

    def _codes_to_latent(self, codes: Sequence[torch.Tensor]) -> torch.Tensor:
        """snac's `quantizer.from_codes` with each level's `repeat_interleave` written as expand + reshape: the same
        values, and no output-size computation that could read the device (capturable in a CUDA graph)."""
        z_q: torch.Tensor | None = None
        for c, quant in zip(codes, self.model.quantizer.quantizers, strict=True):
            z = quant.out_proj(quant.decode_code(c))  # (B x D x T_level)
            if quant.stride > 1:
                z = z.unsqueeze(-1).expand(*z.shape, quant.stride).reshape(z.shape[0], z.shape[1], -1)
            z_q = z if z_q is None else z_q + z
        assert z_q is not None
        return z_q

    def decode_frames(
        self,
        frames: torch.Tensor,
        frame_levels: Sequence[Sequence[int]],
        start_frames: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """frames (B x T x codes_per_frame) in the layout `frame_levels` -> audio (B x T*frame_samples)."""
        return self.decode(frames_to_codes(frames, frame_levels), start_frames)

    def decode_windows(
        self, windows: Sequence[tuple[torch.Tensor, int]], frame_levels: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """Decode several windows (frames (T_i x codes_per_frame), start frame) from any streams.

        Windows of equal length go through one forward pass together (in steady-state streaming every window has the
        same length, so that is one pass for all streams). Returns audio (T_i*frame_samples,) per window, in order.
        """
        out: list[torch.Tensor | None] = [None] * len(windows)
        by_length: dict[int, list[int]] = {}
        for i, (frames, _) in enumerate(windows):
            by_length.setdefault(int(frames.shape[0]), []).append(i)
        for length, idx in by_length.items():
            if length == 0:
                for i in idx:
                    out[i] = torch.zeros(0, device=self.device)
                continue
            frames = torch.stack([windows[i][0] for i in idx])  # (B x T x 7)
            starts = torch.tensor([windows[i][1] for i in idx], dtype=torch.int64)
            audio = self.decode_frames(frames, frame_levels, starts)
            for row, i in enumerate(idx):
                out[i] = audio[row]
        return out  # type: ignore[return-value]


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


def save_random_snac(
    out_dir: str | Path, config: dict | None = None, seed: int = 0, legacy_weight_norm: bool = False
) -> Path:
    """Save a randomly initialised SNAC (default: the 24 kHz shape) in the published format.

    `legacy_weight_norm=True` writes the `weight_g`/`weight_v` names of the old `torch.nn.utils.weight_norm`, as older
    published checkpoints use; both load.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = dict(SNAC_24KHZ_CONFIG if config is None else config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SNAC(**config)
        # Random codebooks and weights give speech-free noise; keep the output away from tanh saturation.
        for name, p in model.named_parameters():
            if "alpha" in name:
                continue
            if name.endswith("original0"):  # weight-norm magnitude
                p.data.mul_(0.5)
    state = model.state_dict()
    if legacy_weight_norm:
        state = {
            k.replace("parametrizations.weight.original0", "weight_g").replace(
                "parametrizations.weight.original1", "weight_v"
            ): v
            for k, v in state.items()
        }
    torch.save(state, out_dir / WEIGHTS_FILE)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out_dir
