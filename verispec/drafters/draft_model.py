"""Chain drafting with a small model of the target's family (same tokenizer).

The draft model runs one token at a time, k times. Because any draft distribution q is allowed
(verification corrects for it), the draft may be made cheaper than its checkpoint: weight-only
int4/int8 quantization and a restricted output vocabulary both keep the output exactly the
target's, and only change how often drafts are accepted.
"""

from __future__ import annotations

import time

import torch

from verispec.drafters.base import LONG_TAIL, Proposal
from verispec.models.kv_cache import KVCache
from verispec.models.transformer import Transformer
from verispec.sampling import SamplingParams, logits_to_probs, sample


class DraftModelDrafter:
    source = "draft-model"

    def __init__(self, model: Transformer, target_vocab_size: int, lazy_prefill: bool = False) -> None:
        self.model = model
        self.lazy_prefill = lazy_prefill  # prefill on first use: a fallback drafter may never be asked
        self.target_vocab_size = target_vocab_size  # q is reported over the target's vocabulary
        self.capacity = 0
        self.cache: KVCache | None = None
        self.cached_tokens: list[int] = []  # the tokens whose keys/values the cache holds, in order
        self.known_committed = 0  # length of the committed sequence at the previous proposal

    def begin(self, prompt_ids: list[int], max_length: int) -> None:
        self.capacity = max_length + 1
        self.cache = self.model.new_cache(1, self.capacity)
        self.cached_tokens = []
        self.known_committed = len(prompt_ids)
        if len(prompt_ids) > 1 and not self.lazy_prefill:
            self._feed(prompt_ids[:-1], last_only=True)

    def _feed(self, token_ids: list[int], last_only: bool = True) -> torch.Tensor:
        """Append tokens to the draft cache; returns logits at the last one, (V',)."""
        if len(self.cached_tokens) + len(token_ids) + 1 > self.capacity:
            self._grow(len(self.cached_tokens) + len(token_ids) + 64)
        logits = self.model.forward(torch.tensor([token_ids]), self.cache, last_only=last_only)  # (1, 1, V')
        self.cache.commit(len(token_ids))
        self.cached_tokens.extend(token_ids)
        return logits[0, -1]

    def _grow(self, needed: int) -> None:
        """Recompute into a larger cache (rare: the engine sizes caches for the whole request)."""
        tokens = self.cached_tokens
        self.capacity = max(needed, 2 * self.capacity)
        self.cache = self.model.new_cache(1, self.capacity)
        self.cached_tokens = []
        if tokens:
            self._feed(tokens)

    def _sync(self, tokens: list[int]) -> None:
        """Roll the cache back to the longest prefix it shares with the committed tokens.

        Everything before `known_committed` was committed at the previous call, so only the
        speculative tail after it (at most k tokens) is compared.
        """
        limit = min(len(self.cached_tokens), len(tokens) - 1)  # the newest token is always fed
        common = min(self.known_committed, limit)
        while common < limit and self.cached_tokens[common] == tokens[common]:
            common += 1
        self.known_committed = len(tokens)
        if common < len(self.cached_tokens):
            self.cache.truncate(common)
            del self.cached_tokens[common:]

    def _to_target_vocab(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """(V',) probabilities over the draft's output ids -> (V,) over the target vocabulary."""
        ids = self.model.output_token_ids
        if ids is None and draft_probs.shape[-1] == self.target_vocab_size:
            return draft_probs
        full = torch.zeros(self.target_vocab_size, dtype=draft_probs.dtype)
        if ids is None:
            ids = torch.arange(draft_probs.shape[-1])
        full[ids] = draft_probs
        return full

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        if k == 0:
            return Proposal(torch.empty(1, 0, dtype=torch.long), None, 0, self.source)
        self._sync(tokens)
        tail = tokens[len(self.cached_tokens):]
        started = time.perf_counter()
        logits = self._feed(tail)  # (V',)
        catch_up_seconds = time.perf_counter() - started if len(tail) > LONG_TAIL else 0.0
        forwards = 1
        drafted: list[int] = []
        draft_probs: list[torch.Tensor] = []
        for i in range(k):
            if params.greedy:
                local = int(torch.argmax(logits))
            else:
                q = self._to_target_vocab(logits_to_probs(logits, params))  # (V,)
                draft_probs.append(q)
                local = None
            if local is not None:
                token = local if self.model.output_token_ids is None else int(self.model.output_token_ids[local])
            else:
                token = int(sample(draft_probs[-1][None], generator)[0])
            drafted.append(token)
            if i < k - 1:
                logits = self._feed([token])
                forwards += 1
        probs = torch.stack(draft_probs)[None] if draft_probs else None  # (1, k, V)
        return Proposal(torch.tensor([drafted]), probs, forwards, self.source, catch_up_seconds)
