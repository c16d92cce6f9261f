"""A draft model for speculative decoding that proposes tokens from any distribution (not the target's), so the
rejection sampler's exactness is tested where drafts are often wrong."""

from __future__ import annotations

import torch

from omnivox.engine.speculative import Proposal


class GeneralDraft:
    """Proposes one token drawn from a fixed distribution q (with q): exercises the general rejection path."""

    def __init__(self, vocab: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.q = torch.softmax(torch.randn(vocab, generator=g) * 4, 0)
        self.gen = torch.Generator().manual_seed(2)
        self.proposed = 0

    def __call__(self, req):
        self.proposed += 1
        token = int(torch.multinomial(self.q, 1, generator=self.gen))
        return Proposal([token], self.q.unsqueeze(0))
