"""A draft model with a different tokenizer from the target's.

The draft reads the committed text in its own vocabulary, writes k tokens of its own, and its text
is re-encoded in the target's vocabulary. The re-encoded tokens are a deterministic proposal, so
they are verified as point masses (q = 1): lossless, whatever the draft's tokenizer does.

Token boundaries need care on both sides. Draft side: the committed text is re-encoded every step
and only the longest prefix that still tokenizes the same is kept in the draft's KV cache (the
last word may tokenize differently once more text arrives). Target side: the draft's text is
encoded together with the text of the last few committed target tokens, so that a word split
across the boundary is encoded as the target would encode it.
"""

from __future__ import annotations

import time

import torch

from verispec.drafters.base import LONG_TAIL, Drafter, Proposal
from verispec.models.kv_cache import KVCache
from verispec.models.loading import LoadedModel
from verispec.sampling import SamplingParams

BOUNDARY_TOKENS = 3  # committed target tokens re-encoded with the draft's text


class CrossTokenizerDrafter(Drafter):
    source = "cross-tokenizer"

    def __init__(self, draft: LoadedModel, target: LoadedModel) -> None:
        self.draft, self.target = draft, target
        self.model = draft.model
        self.cache: KVCache | None = None
        self.cached_ids: list[int] = []  # draft-vocabulary tokens whose keys/values the cache holds
        self.draft_eos = set(draft.eos_token_ids)

    def begin(self, prompt_ids: list[int], max_length: int) -> None:
        self.cache = self.model.new_cache(1, min(4 * max_length + 64, self.model.config.max_position_embeddings))
        self.cached_ids = []

    def _draft_context(self, tokens: list[int]) -> list[int]:
        text = self.target.tokenizer.decode(tokens, skip_special_tokens=False)
        return self.draft.tokenizer.encode(text, add_special_tokens=False)

    def _feed(self, ids: list[int]) -> torch.Tensor:
        """Append draft tokens to the cache; logits at the last one, (V_draft,)."""
        logits = self.model.forward(torch.tensor([ids]), self.cache, last_only=True)  # (1, 1, V_draft)
        self.cache.commit(len(ids))
        self.cached_ids.extend(ids)
        return logits[0, -1]

    def _sync(self, context: list[int]) -> list[int]:
        """Keep the cached prefix that still matches; return the context tokens still to feed (>= 1)."""
        common = 0
        limit = min(len(self.cached_ids), len(context) - 1)
        while common < limit and self.cached_ids[common] == context[common]:
            common += 1
        if common < len(self.cached_ids):
            self.cache.truncate(common)
            del self.cached_ids[common:]
        return context[common:]

    def _to_target(self, tokens: list[int], draft_text: str, k: int) -> list[int]:
        tail = tokens[-BOUNDARY_TOKENS:]
        tail_text = self.target.tokenizer.decode(tail, skip_special_tokens=False)
        joined = self.target.encode(tail_text + draft_text)
        if joined[: len(tail)] == tail:
            return joined[len(tail):][:k]
        return self.target.encode(draft_text)[:k]

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        context = self._draft_context(tokens)
        if len(context) + k + 1 > self.cache.capacity:
            return Proposal(torch.empty(1, 0, dtype=torch.long), None, 0, self.source)
        tail = self._sync(context)
        started = time.perf_counter()
        logits = self._feed(tail)
        catch_up_seconds = time.perf_counter() - started if len(tail) > LONG_TAIL else 0.0
        drafted: list[int] = []
        forwards = 1
        for i in range(k):
            token = int(torch.argmax(logits))
            if token in self.draft_eos:
                break
            drafted.append(token)
            if i < k - 1:
                logits = self._feed([token])
                forwards += 1
        draft_text = self.draft.tokenizer.decode(drafted, skip_special_tokens=True)
        proposal = self._to_target(tokens, draft_text, k) if draft_text else []
        return Proposal(
            torch.tensor([proposal], dtype=torch.long).reshape(1, -1), None, forwards, self.source, catch_up_seconds
        )
