"""Chain drafting for a whole batch: one draft-model forward per draft position for all sequences.

Row b of the draft cache belongs to the sequence in row b of the target cache; the scheduler keeps
both compact (active sequences in rows 0 .. n-1) and moves rows together. Like the single-request
`DraftModelDrafter`, each row rolls itself back to the longest prefix it shares with the committed
tokens, so rejected drafts need no separate call.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Proposal
from verispec.models.transformer import Transformer
from verispec.sampling import SamplingParams, logits_to_probs, sample

PAD_TOKEN = 0  # fills ragged inputs on the right; its keys/values land in scratch slots never committed
LONG_TAIL = 8  # a row further behind than this catches up alone, so the others are not padded to its length


class BatchedDraftModel:
    source = "draft-model"

    def __init__(self, model: Transformer, target_vocab_size: int, max_batch_size: int, capacity: int) -> None:
        if model.output_token_ids is not None:
            raise ValueError("batched drafting needs the draft's full output vocabulary")
        self.model = model
        self.target_vocab_size = target_vocab_size
        self.cache = model.new_cache(max_batch_size, capacity)
        self.cached_tokens: list[list[int]] = [[] for _ in range(max_batch_size)]  # per row, in cache order
        self.known_committed = [0] * max_batch_size  # committed length at the row's previous proposal

    def add(self, row: int, prompt_ids: list[int]) -> None:
        """Start a sequence in `row`: prefill all prompt tokens but the last (it is fed with the first draft)."""
        self.cache.lengths[row] = 0
        self.cached_tokens[row] = []
        self.known_committed[row] = len(prompt_ids)
        if len(prompt_ids) > 1:
            view = self.cache.rows(row, row + 1)
            self.model.forward(torch.tensor([prompt_ids[:-1]]), view, last_only=True)
            view.commit(len(prompt_ids) - 1)
            self.cached_tokens[row] = list(prompt_ids[:-1])

    def move(self, source: int, destination: int) -> None:
        self.cache.move_row(source, destination)
        self.cached_tokens[destination] = self.cached_tokens[source]
        self.known_committed[destination] = self.known_committed[source]

    def _sync(self, row: int, tokens: list[int]) -> list[int]:
        """Roll row back to the prefix it shares with `tokens`; return the tokens it still has to see."""
        cached = self.cached_tokens[row]
        limit = min(len(cached), len(tokens) - 1)  # the newest token is always fed
        common = min(self.known_committed[row], limit)
        while common < limit and cached[common] == tokens[common]:
            common += 1
        self.known_committed[row] = len(tokens)
        del cached[common:]
        self.cache.lengths[row] = common
        return tokens[common:]

    def _catch_up(self, row: int, tail: list[int]) -> list[int]:
        """Feed all but the last token of a long tail (after plain steps) to the row alone; return the rest."""
        if len(tail) <= LONG_TAIL:
            return tail
        view = self.cache.rows(row, row + 1)
        self.model.forward(torch.tensor([tail[:-1]]), view, last_only=True)
        view.commit(len(tail) - 1)
        self.cached_tokens[row].extend(tail[:-1])
        return tail[-1:]

    def _feed(self, inputs: list[list[int]]) -> torch.Tensor:
        """Append each row's tokens (ragged) to rows 0 .. n-1; logits at each row's last token, (n, V')."""
        n, width = len(inputs), max(len(row) for row in inputs)
        ids = torch.full((n, width), PAD_TOKEN, dtype=torch.long)  # (n, T)
        for b, row in enumerate(inputs):
            ids[b, : len(row)] = torch.tensor(row)
            self.cached_tokens[b].extend(row)
        view = self.cache.rows(0, n)
        logits = self.model.forward(ids, view)  # (n, T, V')
        lengths = torch.tensor([len(row) for row in inputs])  # (n,)
        view.commit(lengths)
        return logits[torch.arange(n), lengths - 1]  # (n, V')

    def _to_target_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """(..., V') over the draft's ids -> (..., V) over the target's (the draft's extra ids are never sampled)."""
        extra = self.target_vocab_size - probs.shape[-1]
        return torch.nn.functional.pad(probs, (0, extra)) if extra > 0 else probs[..., : self.target_vocab_size]

    def propose(
        self,
        tokens: list[list[int]],
        k: int,
        params: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> list[Proposal]:
        """k draft tokens for each of the sequences in rows 0 .. n-1 (tokens[b]: row b's committed tokens)."""
        n = len(tokens)
        tails = [self._catch_up(b, self._sync(b, seq)) for b, seq in enumerate(tokens)]
        logits = self._feed(tails)  # (n, V')
        drafted = torch.empty(n, k, dtype=torch.long)  # (n, k)
        probs: list[list[torch.Tensor]] = [[] for _ in range(n)]  # per row: k of (V,) when sampling
        for i in range(k):
            for b in range(n):
                if params[b].greedy:
                    drafted[b, i] = int(torch.argmax(logits[b, : self.target_vocab_size]))
                else:
                    q = self._to_target_vocab(logits_to_probs(logits[b], params[b]))  # (V,)
                    probs[b].append(q)
                    drafted[b, i] = int(sample(q[None], generators[b])[0])
            if i < k - 1:
                logits = self._feed([[int(t)] for t in drafted[:, i]])  # (n, V')
        return [
            Proposal(drafted[b : b + 1], torch.stack(probs[b])[None] if probs[b] else None, k, self.source)
            for b in range(n)
        ]
