"""A draft model as a proposer: a small checkpoint with the same tokenizer, its own paged KV blocks, run for k steps.

Each target request has a shadow request in the draft's own block pool. Before proposing, the shadow's computed length
is taken back to what it shares with the target's committed tokens (drafts the target rejected are rolled back like
the target's), the new committed tokens are computed, then k tokens are drawn one step at a time: greedy for greedy
requests, otherwise from the draft's softmax at the request's temperature, which is the q the verifier needs.
Proposals are made request by request (k small forward passes each); batching them across requests is left for later.
"""

from __future__ import annotations

from pathlib import Path

import torch

from omnivox.engine.block_pool import BlockPool
from omnivox.engine.kv_manager import KVCacheManager
from omnivox.engine.params import SamplingParams
from omnivox.engine.request import Request
from omnivox.engine.runner import ModelRunner
from omnivox.engine.scheduler import ScheduledChunk, SchedulePlan
from omnivox.engine.speculative import Proposal
from omnivox.models.decoder import DecoderModel


class DraftModelProposer:
    def __init__(self, model: DecoderModel, k: int = 4, kv_cache_gib: float = 0.25, block_size: int = 16) -> None:
        param = next(model.parameters())
        cfg = model.config
        num_blocks = max(4, int(kv_cache_gib * 2**30 // (cfg.kv_bytes_per_token(param.element_size()) * block_size)))
        self.model, self.k, self.vocab_size = model.eval(), k, cfg.vocab_size
        self.max_model_len = min(cfg.max_model_len, num_blocks * block_size)
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching=False)
        self.kv = KVCacheManager(self.pool)
        self.runner = ModelRunner(model, num_blocks, block_size, param.device, param.dtype, 1, static_decode=False)
        # As the target's: on CUDA the FlexAttention decode compiles (or falls back) now, not at the first proposal.
        self.runner.prepare()
        self._shadows: dict[str, Request] = {}

    @classmethod
    def from_pretrained(cls, path: str | Path, device=None, dtype=None, k: int = 4, kv_cache_gib: float = 0.25):
        from omnivox.engine.loading import build_model, default_device, resolve_dtype
        from omnivox.models.checkpoint import iter_checkpoint_tensors, load_hf_config
        from omnivox.models.config import ModelConfig

        device = torch.device(device) if device is not None else default_device()
        model = build_model(ModelConfig.from_hf(load_hf_config(path)), device, resolve_dtype(dtype, device))
        model.load_weights(iter_checkpoint_tensors(path))
        return cls(model, k=k, kv_cache_gib=kv_cache_gib)

    def forget(self, request_id: str) -> None:
        shadow = self._shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)

    def _shadow(self, req: Request) -> Request:
        shadow = self._shadows.get(req.request_id)
        if shadow is None:
            shadow = Request(req.request_id, list(req.prompt_token_ids), SamplingParams(), 1, ())
            self._shadows[req.request_id] = shadow
        committed = req.prompt_token_ids + req.output_token_ids
        have = shadow.prompt_token_ids + shadow.output_token_ids
        same = next(
            (i for i, (a, b) in enumerate(zip(have, committed, strict=False)) if a != b), min(len(have), len(committed))
        )
        shadow.output_token_ids = list(req.output_token_ids)
        self.kv.rollback(shadow, min(shadow.num_computed_tokens, same, shadow.num_tokens - 1))
        return shadow

    def _step(self, shadow: Request, n: int, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Compute the shadow's next n tokens (input_ids: their ids on the device, when the host does not hold them
        yet); returns the logits [vocab] after the last one."""
        if not self.kv.allocate(shadow, n):
            raise MemoryError("draft KV pool full")
        chunk = ScheduledChunk(shadow, shadow.num_computed_tokens, n, 1)
        logits, _ = self.runner.execute(SchedulePlan(prefills=[chunk]), input_ids=input_ids)  # over the cached context
        shadow.num_computed_tokens += n
        return logits[0].float()

    @torch.inference_mode()
    def __call__(self, req: Request) -> Proposal:
        if req.segments or req.rope_positions is not None or req.num_tokens + self.k >= self.max_model_len:
            return Proposal([])  # the draft sees text only
        shadow = self._shadow(req)
        temperature = 0.0 if req.params.is_greedy else req.params.temperature
        drawn: list[torch.Tensor] = []  # [1] each, on the device: read back once, after the k steps
        qs: list[torch.Tensor] = []
        try:
            logits = self._step(shadow, shadow.num_tokens - shadow.num_computed_tokens)
            for j in range(self.k):
                if temperature == 0.0:
                    token = logits.argmax().view(1)
                else:
                    q = (logits / temperature).softmax(dim=-1)
                    token = torch.multinomial(q, 1, generator=req.generator)
                    qs.append(q)
                drawn.append(token)
                shadow.output_token_ids.append(-1)  # a placeholder: the next step reads the id from `token`
                if j + 1 < self.k:
                    logits = self._step(shadow, 1, input_ids=token)
        except MemoryError:
            self.forget(req.request_id)
            return Proposal([])
        tokens = [int(t) for t in torch.cat(drawn).tolist()]  # one host read per proposal (was one per token)
        shadow.output_token_ids[-self.k :] = tokens
        return Proposal(tokens, torch.stack(qs) if qs else None)


def build_proposer(spec: str, k: int, vocab_size: int, device=None, dtype=None):
    """A proposer from its spec: `ngram` (prompt lookup) or `draft:PATH` (a draft checkpoint with the same vocabulary).
    Raises ValueError with a one-line reason."""
    from omnivox.engine.speculative import NgramProposer
    from omnivox.models.config import NotApplicable

    if k < 1:
        raise ValueError(f"the number of speculative tokens must be >= 1, got {k}")
    if spec == "ngram":
        return NgramProposer(k=k)
    kind, _, path = spec.partition(":")
    if kind != "draft" or not path:
        raise ValueError(f"speculative must be 'ngram' or 'draft:PATH', got {spec!r}")
    draft = DraftModelProposer.from_pretrained(path, device=device, dtype=dtype, k=k)
    if draft.vocab_size != vocab_size:
        raise NotApplicable(
            "speculative", f"the draft model {path} has {draft.vocab_size} tokens, the target {vocab_size}"
        )
    return draft
