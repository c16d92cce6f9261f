"""SNAC audio decoding: codes -> waveform, deterministic, batched, device and dtype aware.

Loads the published SNAC format (hubertsiuzdak/snac_24khz: `config.json` + `pytorch_model.bin`) from a local folder
through the `snac` package, then makes two changes that do not alter the weights:

- weight norm is folded into plain weights once (the same arithmetic `snac` repeats on every call);
- each decoder block's noise injection (`x + randn * linear(x)`, drawn from the global RNG in `snac`) draws its noise
  from a `NoiseSource` instead (codecs/snac_noise.py). The default, `PositionalNoise`, is a hash of (seed, layer,
  absolute time step), so the noise at a time step does not depend on the window, the batch or the call order:
  decoding a window of a stream gives the same samples as decoding the whole stream, which is what seamless streaming
  and batched decoding rely on. `noise="off"` drops the noise term.

A code "frame" covers `vq_strides[0]` latent steps (7 codes and 2048 samples for the 24 kHz model); the framing
(`CodecShape`, `frames_to_codes`, `codes_to_frames`) is codecs/snac_frames.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from snac import SNAC
from snac.layers import DecoderBlock, NoiseBlock, Snake1d
from torch import nn
from torch.nn.utils import parametrize

from omnivox.codecs.codec_kernels import fuse_snakes
from omnivox.codecs.snac_fast import speed_up_convs
from omnivox.codecs.snac_frames import frames_to_codes, snac_config_shape
from omnivox.codecs.snac_noise import InjectedNoise, NoiseSource, PositionalNoise

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
                        block.block[i] = InjectedNoise(sub, layer, self)
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
