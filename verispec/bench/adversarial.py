"""A drafter that cannot pay: the real draft model with its guesses scrambled.

Each proposed token is sent through a fixed random permutation of the vocabulary (and q with it,
so verification stays exact). Acceptance drops to about zero while drafting costs what it always
costs: the worst case a controller must notice, measured on real models.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Drafter, Proposal
from verispec.sampling import SamplingParams


class ScrambledDrafter:
    def __init__(self, inner: Drafter, vocab_size: int, seed: int = 0) -> None:
        self.inner = inner
        self.permutation = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))  # (V,)

    def begin(self, prompt_ids: list[int], max_length: int) -> None:
        self.inner.begin(prompt_ids, max_length)

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        proposal = self.inner.propose(tokens, k, params, generator)
        scrambled = self.permutation[proposal.token_ids]  # (1, k)
        probs = None
        if proposal.probs is not None:
            probs = torch.empty_like(proposal.probs)
            probs[..., self.permutation] = proposal.probs  # q'(perm[x]) = q(x)
        return Proposal(scrambled, probs, proposal.forwards, "unrelated")
