"""Chain drafting with a small model of the target's family (same tokenizer).

The draft model runs one token at a time, k times. Because any draft distribution q is allowed
(verification corrects for it), the draft may be made cheaper than its checkpoint: weight-only
int4/int8 quantization and a restricted output vocabulary both keep the output exactly the
target's, and only change how often drafts are accepted.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from verispec.drafters.base import LONG_TAIL, Proposal
from verispec.grammar import fit_mask
from verispec.models.kv_cache import KVCache
from verispec.models.transformer import Transformer
from verispec.sampling import SamplingParams, TokenHistory, logits_to_probs, sample

if TYPE_CHECKING:
    from verispec.grammar import Grammar


class DraftModelDrafter:
    source = "draft-model"
    drafts_under_grammar = True  # propose takes a grammar (see Drafter)

    def __init__(self, model: Transformer, target_vocab_size: int, lazy_prefill: bool = False) -> None:
        self.model = model
        self.lazy_prefill = lazy_prefill  # prefill on first use: a fallback drafter may never be asked
        self.target_vocab_size = target_vocab_size  # q is reported over the target's vocabulary
        self.capacity = 0
        self.cache: KVCache | None = None
        self.cached_tokens: list[int] = []  # the tokens whose keys/values the cache holds, in order
        self.known_committed = 0  # length of the committed sequence at the previous proposal
        self.prompt_length = 0  # where generated tokens start (penalties count them)

    def begin(self, prompt_ids: list[int], max_length: int) -> None:
        self.capacity = max_length + 1
        self.cache = self.model.new_cache(1, self.capacity)
        self.cached_tokens = []
        self.known_committed = self.prompt_length = len(prompt_ids)
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

    def _scores_over_target_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """(V',) draft scores -> (V'') indexed by target ids: unchanged unless the head covers a subset
        (then -inf elsewhere, over the target's vocabulary), so penalties find each token where it is."""
        ids = self.model.output_token_ids
        if ids is None:
            return logits
        full = torch.full((self.target_vocab_size,), float("-inf"), dtype=logits.dtype)
        full[ids] = logits
        return full

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
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
        grammar: "Grammar | None" = None,
    ) -> Proposal:
        """grammar (structured output): q is masked by it at every draft position, and drafting stops once the
        document is complete; its state walks the drafts and comes back."""
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
            if grammar is not None and grammar.finished:
                break
            if params.greedy and not params.transforms_scores and grammar is None:
                local = int(torch.argmax(logits))
                token = local if self.model.output_token_ids is None else int(self.model.output_token_ids[local])
            else:  # penalties, logit_bias and a grammar shape q as they shape p: over target ids
                scores = self._scores_over_target_ids(logits)  # (V'',)
                history = TokenHistory(tokens + drafted, self.prompt_length) if params.penalized else None
                allowed = fit_mask(grammar.allowed(), scores.shape[-1]) if grammar is not None else None  # (V'',)
                q = logits_to_probs(scores, params, allowed, history)
                q = q if q.shape[-1] == self.target_vocab_size else self._to_target_vocab(q)  # (V,)
                if not params.greedy:
                    draft_probs.append(q)
                token = int(sample(q[None], generator)[0])
            drafted.append(token)
            if grammar is not None:
                grammar.advance([token])
            if i < k - 1:
                logits = self._feed([token])
                forwards += 1
        if grammar is not None:
            grammar.rollback(len(drafted))  # it advanced once per drafted token
        probs = torch.stack(draft_probs)[None] if draft_probs else None  # (1, k, V)
        return Proposal(torch.tensor([drafted], dtype=torch.long), probs, forwards, self.source, catch_up_seconds)
