"""Prompt lookup: copy what followed the latest earlier occurrence of the current n-gram.

No draft model. The context's last n tokens (n from max_ngram down to min_ngram) are searched for
in the prompt and the text generated so far; the tokens that followed the most recent earlier
match are proposed. A deterministic proposal is a point mass (q = 1), so verification stays
lossless in sampling mode too.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Drafter, Proposal
from verispec.sampling import SamplingParams


def find_continuation(tokens: torch.Tensor, k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Up to k tokens that followed the longest, most recent earlier match of the context's suffix.

    tokens: (L,) the whole context. Returns [] when no n-gram of at least min_ngram tokens recurs.
    """
    length = tokens.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n:]  # (n,)
        windows = tokens[: length - 1].unfold(0, n, 1)  # (L - n, n): every earlier n-gram, not the suffix itself
        starts = torch.nonzero((windows == suffix).all(dim=1)).flatten()  # (M,)
        for start in reversed(starts.tolist()):  # most recent first
            follow = tokens[start + n: start + n + k]
            if follow.numel() > 0:
                return follow.tolist()
    return []


class PromptLookupDrafter(Drafter):
    source = "prompt-lookup"
    tells_if_it_proposes = True

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def begin(self, prompt_ids: list[int], max_length: int) -> None:
        pass

    def can_propose(self, tokens: list[int]) -> bool:
        """Whether propose(tokens, ...) would find a recurring n-gram."""
        return bool(find_continuation(torch.tensor(tokens), 1, self.min_ngram, self.max_ngram))

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        found = find_continuation(torch.tensor(tokens), k, self.min_ngram, self.max_ngram)
        return Proposal(torch.tensor([found], dtype=torch.long).reshape(1, -1), None, 0, self.source)
