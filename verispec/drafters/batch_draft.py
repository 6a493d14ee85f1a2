"""Chain drafting for a whole batch: one draft-model forward per draft position for all sequences.

The one draft-model implementation: the scheduler drafts for its rows with it, and `DraftModelDrafter`
(a single request's drafter) is a batch of one of it. Because any draft distribution q is allowed
(verification corrects for it), the draft may be made cheaper than its checkpoint: weight-only
quantization and a restricted output vocabulary (q is zero elsewhere) keep the output exactly the
target's, and only change how often drafts are accepted. Its propose loop (`ChainDrafter`) is the batched
draft head's too (batch_head).

Row b of the draft cache belongs to the sequence in row b of the target cache; the scheduler keeps
both compact (active sequences in rows 0 .. n-1) and moves rows together. Each row rolls itself back
to the longest prefix it shares with the committed tokens, so rejected drafts need no separate call.

Rows are filled lazily: a sequence's prompt and everything committed since its last proposal go
into its draft cache only when it drafts next. In a batch too big for speculation to pay, the
controller chooses plain steps and the draft model then costs nothing, not even a prefill.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from typing import TYPE_CHECKING

import torch

from verispec.drafters.base import LONG_TAIL, BatchedProposer, Proposal
from verispec.grammar import Grammar, fit_mask
from verispec.models.transformer import Transformer
from verispec.sampling import SamplingParams, TokenHistory, logits_to_probs, sample

if TYPE_CHECKING:
    from verispec.drafters.draft_head import HeadLayer

PAD_TOKEN = 0  # fills ragged inputs on the right; its keys/values land in scratch slots never committed
# A row further behind than LONG_TAIL catches up alone, so the others are not padded to its length.


class ChainDrafter(BatchedProposer):
    """Chain drafting for rows 0 .. n-1: one forward of a draft (a model, or a head over the target's hidden
    states) per draft position for all rows, each row drafting from its own q. The propose loop, sampling, grammar
    and per-row faults are here; a subclass keeps its rows' caches and feeds them (_sync, _catch_up, _feed)."""

    # A row stops drafting at a position where its draft's top probability is below this (that token dropped, as
    # llama.cpp's --draft-p-min): no draft positions spent where the draft is unsure. Any rule that reads only the
    # draft's own q keeps verification exact. 0: every row drafts its whole k.
    min_confidence: float = 0.0

    def __init__(self, model: "Transformer | HeadLayer", target_vocab_size: int) -> None:
        super().__init__()
        self.model = model
        self.target_vocab_size = target_vocab_size  # q is reported over the target's vocabulary

    @abstractmethod
    def _sync(self, row: int, tokens: list[int]) -> list[int] | None:
        """Bring the row back to what it shares with its committed `tokens`; return the tokens it still has to be
        fed (the newest always), or None where it cannot draft."""

    @abstractmethod
    def _catch_up(self, row: int, tail: list[int], limit: int | None) -> list[int] | None:
        """Feed a tail longer than LONG_TAIL to the row alone (at most `limit` tokens where it binds); return what is
        left to feed with the batch, or None while it is still behind."""

    @abstractmethod
    def _feed(self, inputs: list[list[int] | None]) -> torch.Tensor:
        """Append each row's tokens (ragged; None = skip the row) to rows 0 .. n-1; draft scores at each row's last
        input, (n, V')."""

    def _to_target_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """(..., V') over the draft's ids -> (..., V) over the target's (the draft's extra ids are never sampled)."""
        extra = self.target_vocab_size - probs.shape[-1]
        return torch.nn.functional.pad(probs, (0, extra)) if extra > 0 else probs[..., : self.target_vocab_size]

    def _scores_over_target_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """(V',) draft scores -> indexed by target ids: unchanged unless the head covers a subset of the vocabulary
        (then (V,), -inf elsewhere), so penalties, logit_bias and a grammar find each token where it is."""
        ids = self.model.output_token_ids
        if ids is None:
            return logits
        full = torch.full((self.target_vocab_size,), float("-inf"), dtype=logits.dtype)
        full[ids] = logits
        return full

    def _draw(
        self, logits: torch.Tensor, tokens: list[int], drafted: torch.Tensor, params: SamplingParams,
        generator: torch.Generator | None, grammar: Grammar | None, probs: list[torch.Tensor],
        prompt_length: int | None,
    ) -> tuple[int, float]:
        """A row's next draft token from its draft scores (V',), after its committed `tokens` and the (i,) tokens it
        `drafted` so far, and the draft's top probability there (1.0 unless min_confidence asks for it); its q (V,)
        appended to probs when sampling."""
        ids = self.model.output_token_ids  # a restricted head: draft position j is target id ids[j]
        if params.greedy and grammar is None and not params.transforms_scores:
            if ids is None:
                logits = logits[: self.target_vocab_size]
            best = logits.max(dim=-1)  # max's index is argmax's (the first maximum), and faster (see verify_greedy)
            index = int(best.indices)
            confidence = float(torch.exp(best.values - torch.logsumexp(logits, -1))) if self.min_confidence else 1.0
            return (int(ids[index]) if ids is not None else index), confidence
        scores = self._scores_over_target_ids(logits)  # (V'',)
        allowed = fit_mask(grammar.allowed(), scores.shape[-1]) if grammar is not None else None  # (V'',)
        history = None
        if params.penalized:
            if prompt_length is None:
                raise ValueError("penalized sampling needs each row's prompt length")
            history = TokenHistory(tokens + drafted.tolist(), prompt_length)
        q = self._to_target_vocab(logits_to_probs(scores, params, allowed, history))  # (V,)
        if not params.greedy:
            probs.append(q)
        return int(sample(q[None], generator)[0]), float(q.max()) if self.min_confidence else 1.0

    def propose(
        self,
        tokens: list[list[int]],
        ks: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        catch_up_limit: int | None = None,
        grammars: list[Grammar | None] | None = None,
        prompt_lengths: list[int] | None = None,
    ) -> list[Proposal]:
        """ks[b] draft tokens for each sequence in rows 0 .. n-1 (tokens[b]: row b's committed tokens), in
        max(ks) forwards.

        Rows with ks[b] = 0 propose nothing and are not brought up to date. A row further
        behind than LONG_TAIL catches up alone first; the rows so behind share at most catch_up_limit
        tokens a call, nearest first (None: all at once); until caught up a row proposes nothing. A
        row with a grammar drafts from q masked by it at every position (its state walks the drafts
        and comes back), and stops drafting once the document is complete. prompt_lengths: where each
        row's generated tokens start, for penalties (which shape q as they shape p).
        """
        grammars = grammars if grammars is not None else [None] * len(tokens)
        n = len(tokens)
        drafting = [k > 0 for k in ks]
        self.catch_up_tokens, self.catch_up_seconds = 0, 0.0
        self.faults = {}
        if not any(drafting):
            return [Proposal(torch.empty(1, 0, dtype=torch.long), None, 0, self.source) for _ in range(n)]
        started = time.perf_counter()
        tails: list[list[int] | None] = [self._sync(b, seq) if drafting[b] else None for b, seq in enumerate(tokens)]
        for b in sorted(range(n), key=lambda b: len(tails[b]) if tails[b] is not None else 0):
            if tails[b] is not None:
                left = None if catch_up_limit is None else catch_up_limit - self.catch_up_tokens
                tails[b] = self._catch_up(b, tails[b], left)
        drafting = [wants and tail is not None for wants, tail in zip(drafting, tails)]
        self.catch_up_seconds = time.perf_counter() - started if self.catch_up_tokens else 0.0
        if not any(drafting):
            return [Proposal(torch.empty(1, 0, dtype=torch.long), None, 0, self.source) for _ in range(n)]
        logits = self._feed(tails)  # (n, V')
        feeds = 1  # draft forwards: fewer than k where every row stopped early (confidence, a complete document)
        k = max(k for k, wants in zip(ks, drafting) if wants)
        drafted = torch.zeros(n, k, dtype=torch.long)  # (n, k)
        lengths = [row_k if wants else 0 for row_k, wants in zip(ks, drafting)]  # a complete document stops early
        probs: list[list[torch.Tensor]] = [[] for _ in range(n)]  # per row: k of (V,) when sampling
        for i in range(k):
            for b in range(n):
                if lengths[b] <= i:
                    continue
                grammar = grammars[b]
                if grammar is not None and grammar.finished:
                    lengths[b] = i
                    continue
                try:
                    token, confidence = self._draw(
                        logits[b], tokens[b], drafted[b, :i], params[b], generators[b], grammar, probs[b],
                        prompt_lengths[b] if prompt_lengths is not None else None,
                    )
                    if confidence < self.min_confidence:  # unsure here: the row's draft ends before this token
                        del probs[b][i:]
                        lengths[b] = i
                        continue
                    drafted[b, i] = token
                    if grammar is not None:
                        grammar.advance([int(drafted[b, i])])
                except Exception as error:  # noqa: BLE001 - this row's failure is its own (see faults)
                    self.faults[b] = error
                    lengths[b] = i  # what it drafted so far is rolled back from its grammar below
                    drafting[b] = False
            if i < k - 1 and any(length > i + 1 for length in lengths):
                rows = [[int(drafted[b, i])] if lengths[b] > i + 1 else None for b in range(n)]
                logits = self._feed(rows)  # (n, V')
                feeds += 1
        for grammar, length in zip(grammars, lengths):
            if grammar is not None:
                grammar.rollback(length)  # it advanced once per drafted token
        return [
            Proposal(
                drafted[b : b + 1, : lengths[b]], torch.stack(probs[b])[None] if probs[b] else None, feeds, self.source
            )
            if drafting[b] and lengths[b]
            else Proposal(torch.empty(1, 0, dtype=torch.long), None, feeds if drafting[b] else 0, self.source)
            for b in range(n)
        ]


class BatchedDraftModel(ChainDrafter):
    source = "draft-model"

    def __init__(self, model: Transformer, target_vocab_size: int, max_batch_size: int, capacity: int) -> None:
        super().__init__(model, target_vocab_size)
        self.cache = model.new_cache(max_batch_size, capacity)
        self.cached_tokens: list[list[int]] = [[] for _ in range(max_batch_size)]  # per row, in cache order
        self.known_committed = [0] * max_batch_size  # committed length at the row's previous proposal
        self.skipped = [0] * max_batch_size  # committed tokens at the start the row never saw (restart_window)

    def add(self, row: int, prompt_ids: list[int], max_length: int) -> None:
        """Start a new sequence in `row` (its prompt is fed with its first proposal)."""
        self.cache.lengths[row] = 0
        self.cached_tokens[row] = []
        self.known_committed[row] = 0
        self.skipped[row] = 0

    def share_prompt(self, source: int, destination: int, prompt_length: int) -> None:
        """Start a new sequence in `destination` with what row `source` holds of the same prompt (n choices)."""
        length = min(len(self.cached_tokens[source]), prompt_length - 1)
        self.cache.copy_prefix(source, destination, length)
        self.cached_tokens[destination] = self.cached_tokens[source][:length]
        self.known_committed[destination] = length
        self.skipped[destination] = 0

    def prefill(self, row: int, token_ids: list[int]) -> None:
        """Feed a new sequence's committed tokens (its prompt but the last token) to `row` now, not at its first proposal."""
        self.model.prefill(token_ids, self.cache.rows(row, row + 1))
        self.cached_tokens[row].extend(token_ids)
        self.known_committed[row] = self.skipped[row] + len(self.cached_tokens[row])

    def restart_window(self, row: int, tokens: list[int], window: int) -> None:
        """Let the row see only the last `window` of its committed `tokens` from now on: its next proposal feeds
        those (at positions from 0) instead of everything it missed. Any draft is verified exactly, so a shorter
        context costs acceptance at most, and the catch-up costs `window` tokens however far behind it was."""
        self.skipped[row] = max(0, len(tokens) - window)
        self.cache.lengths[row] = 0
        self.cached_tokens[row] = []
        self.known_committed[row] = self.skipped[row]

    def behind(self, row: int, tokens: list[int]) -> int:
        """How many committed tokens the row has not seen yet (about; rejected drafts aside)."""
        return len(tokens) - self.known_committed[row]

    def move(self, source: int, destination: int) -> None:
        self.cache.move_row(source, destination)
        self.cached_tokens[destination] = self.cached_tokens[source]
        self.known_committed[destination] = self.known_committed[source]
        self.skipped[destination] = self.skipped[source]

    def _sync(self, row: int, tokens: list[int]) -> list[int]:
        """Roll row back to the prefix it shares with `tokens` (past what it skipped); return the tokens it still has
        to see."""
        cached, skipped = self.cached_tokens[row], self.skipped[row]
        limit = min(len(cached), len(tokens) - skipped - 1)  # the newest token is always fed
        common = max(min(self.known_committed[row] - skipped, limit), 0)
        while common < limit and cached[common] == tokens[skipped + common]:
            common += 1
        self.known_committed[row] = len(tokens)
        del cached[common:]
        self.cache.lengths[row] = common
        return tokens[skipped + common :]

    def _catch_up(self, row: int, tail: list[int], limit: int | None) -> list[int] | None:
        """Feed a long tail (a prompt, or plain steps) to the row alone: all but its last token, or at most
        `limit` tokens of it. Returns what is left to feed with the batch; None while still behind."""
        if len(tail) <= LONG_TAIL:
            return tail
        if limit is not None and limit <= 0:  # this step's catch-up budget is spent: the rest next time
            self.known_committed[row] = self.skipped[row] + len(self.cached_tokens[row])
            return None
        fed = tail[: len(tail) - 1 if limit is None else min(len(tail) - 1, limit)]
        self.catch_up_tokens += len(fed)
        view = self.cache.rows(row, row + 1)
        self.model.forward(torch.tensor([fed]), view, last_only=True)
        view.commit(len(fed))
        self.cached_tokens[row].extend(fed)
        rest = tail[len(fed) :]
        if len(rest) > LONG_TAIL:  # the rest next time: no draft from this row this step
            self.known_committed[row] = self.skipped[row] + len(self.cached_tokens[row])
            return None
        return rest

    def _feed(self, inputs: list[list[int] | None]) -> torch.Tensor:
        """Append each row's tokens (ragged; None = skip the row) to rows 0 .. n-1.

        Returns logits at each row's last token, (n, V'); a skipped row gets a pad whose keys
        and values are never committed, and its logits mean nothing.
        """
        n = len(inputs)
        width = max(len(row) for row in inputs if row is not None)
        ids = torch.full((n, width), PAD_TOKEN, dtype=torch.long)  # (n, T)
        lengths = torch.zeros(n, dtype=torch.long)  # (n,) tokens to commit per row
        for b, row in enumerate(inputs):
            if row is not None:
                ids[b, : len(row)] = torch.tensor(row)
                lengths[b] = len(row)
                self.cached_tokens[b].extend(row)
        view = self.cache.rows(0, n)
        logits = self.model.forward(ids, view)  # (n, T, V')
        view.commit(lengths)
        return logits[torch.arange(n), (lengths - 1).clamp(min=0)]  # (n, V')
