"""The step head of models whose step emits a frame of codes (CSM): the rest of the frame after codebook 0.

A frame model's backbone runs in the engine like any decoder (paged KV, continuous batching, chunked prefill): each
step samples one token per request, codebook 0 of its next frame, with the request's own sampling settings. Then,
once per step, `FrameStep.complete` runs the model's depth decoder for every request of the step together (one
batch, N-1 positions) from the backbone's last hidden state of each request (the runner keeps those rows), sampling
codebooks 1..N-1 with the model's depth-decoder settings (its generation config; greedy for a greedy request) from
the request's own seeded generator, so a request's frames do not depend on what it is batched with.

The frame is then the unit everything else sees: it is one output token (codebook 0) for max_tokens, deadlines,
metrics and the stop rules, its codes ride along (`Request.output_frames`, `RequestOutput.new_frames`), and it enters
the next backbone step as the sum of its codebook embeddings, through an embedding segment at its position (the
runner's own path for vision and audio embeddings; the segment's key, the codes, goes into the block hashes). A frame
whose first N-1 codes are all the end code ends the stream (`Request.frames_ended`), as transformers' generate does.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from omnivox.engine.request import EmbeddingSegment, Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DepthSampling:
    """How codebooks 1..N-1 are drawn (transformers' `depth_decoder_*` generation settings)."""

    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0: the whole vocabulary

    @classmethod
    def from_folder(cls, path) -> DepthSampling:
        """From a checkpoint's generation_config.json: its `depth_decoder_` keys (CsmForConditionalGeneration's
        save_pretrained writes them there), transformers' GenerationConfig defaults where absent."""
        file = Path(path) / "generation_config.json"
        config = json.loads(file.read_text()) if file.is_file() else {}
        return cls(
            bool(config.get("depth_decoder_do_sample", False)),
            float(config.get("depth_decoder_temperature", 1.0)),
            int(config.get("depth_decoder_top_k", 50)),
        )


class FrameStep:
    """Completes each sampled frame with the model's depth decoder (see the module docstring)."""

    def __init__(self, model, sampling: DepthSampling | None = None) -> None:
        self.model = model
        self.layout = model.layout
        self.sampling = sampling or getattr(model, "depth_sampling", None) or DepthSampling()
        self._default_generator: torch.Generator | None = None

    def _generator(self, req: Request, device: torch.device) -> torch.Generator:
        if req.generator is not None:
            return req.generator
        if self._default_generator is None:
            self._default_generator = torch.Generator(device=device)
            self._default_generator.seed()
        return self._default_generator

    def _draw(self, logits: torch.Tensor, noise: torch.Tensor | None, greedy: torch.Tensor) -> torch.Tensor:
        """logits (B x V) float32, noise (B x V) Exp(1) draws or None -> codes (B,).

        Sampling by the exponential-noise trick: argmax(p / E) with E ~ Exp(1) is a draw from p, and each row's
        noise comes from its own request's generator (batch-invariant)."""
        best = logits.argmax(dim=-1)
        if noise is None:
            return best
        s = self.sampling
        scaled = logits / max(s.temperature, 1e-6)
        if 0 < s.top_k < scaled.shape[-1]:
            kth = scaled.topk(s.top_k, dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        drawn = (scaled.softmax(dim=-1) / noise).argmax(dim=-1)
        return torch.where(greedy, best, drawn)

    @torch.inference_mode()
    def complete(self, reqs: list[Request], first_codes: list[int], hidden: torch.Tensor) -> list[tuple[int, ...]]:
        """The frames of `reqs` (rows of `hidden`, (B x hidden), the backbone's last hidden state; `first_codes`
        the codebook-0 codes just sampled): each request gets its frame appended and embedded for the next step."""
        n, v = self.layout.num_codebooks, self.layout.vocab_size
        dev = hidden.device
        greedy = torch.tensor([r.params.temperature == 0 for r in reqs], device=dev)
        noise = None
        if self.sampling.do_sample and not bool(greedy.all()):
            # (B x N-1 x V): one draw per request per frame, from its own generator
            noise = torch.stack([
                torch.empty(n - 1, v, device=dev).exponential_(generator=self._generator(r, dev)) for r in reqs
            ])  # fmt: skip
        depth = self.model.depth_decoder
        codes = [torch.tensor(first_codes, device=dev)]
        logits, state = depth.start(hidden, codes[0])
        for i in range(1, n):
            codes.append(self._draw(logits, None if noise is None else noise[:, i - 1], greedy))
            if i < n - 1:
                logits = depth.advance(codes[-1], state)
        frame_codes = torch.stack(codes, dim=1)  # (B x N)
        embeds = self.model.frame_embeddings(frame_codes)  # (B x hidden)
        frames = [tuple(row) for row in frame_codes.tolist()]
        for i, (req, frame) in enumerate(zip(reqs, frames, strict=True)):
            req.output_frames.append(frame)
            position = req.num_tokens - 1  # the frame's token: computed by the next step
            key = "frame:" + ",".join(map(str, frame))
            req.segments.append(EmbeddingSegment(position, 1, key, embeds=embeds[i : i + 1].clone()))
            if all(c == self.layout.eos_code for c in frame[:-1]):
                req.frames_ended = True
        return frames
