"""SNAC encoding: a reference recording -> code frames, for voices created from reference audio.

The encoder is loaded on first use from the same codec folder as the decoder (codecs/snac.py drops its copy of the
encoder: decoding never needs it), so a server that never creates a voice never holds it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from snac import SNAC
from torch.nn.utils import parametrize

from omnivox.codecs.snac import CONFIG_FILE, WEIGHTS_FILE
from omnivox.codecs.snac_frames import codes_to_frames


class SnacEncoder:
    """Audio (mono float32 at the codec's rate) -> frames (T x codes_per_frame) in a frame layout. Thread-safe."""

    def __init__(self, model: SNAC, config: dict) -> None:
        model.decoder = None  # encoding only
        model.eval()
        for module in model.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        self.model = model
        self.sample_rate = int(config["sampling_rate"])
        self._lock = threading.Lock()

    @classmethod
    def from_folder(cls, path: str | Path) -> SnacEncoder:
        path = Path(path)
        config = json.loads((path / CONFIG_FILE).read_text())
        model = SNAC(**config)
        model.load_state_dict(torch.load(path / WEIGHTS_FILE, map_location="cpu", weights_only=True))
        return cls(model, config)

    @torch.inference_mode()
    def encode_frames(self, samples: np.ndarray, frame_levels: Sequence[Sequence[int]]) -> torch.Tensor:
        """samples (N,) -> frames (T x codes_per_frame), int64; the audio is zero-padded to whole frames."""
        audio = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))[None, None, :]  # (1 x 1 x N)
        with self._lock:
            codes = self.model.encode(audio)  # one (1 x T*codes_per_level[i]) per level
        return codes_to_frames([c.to(torch.int64) for c in codes], frame_levels)[0]
