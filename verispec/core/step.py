"""The step: plan -> propose -> one target forward -> verify -> commit, returning its record.

The target cache invariant is the engine's: each row holds its committed tokens except the newest (pending) one,
which is the first input of the next verify pass. Greedy output is therefore the target's own argmax chain, the
same tokens a single request gets through the library. A batch-invariant target packs each row's [pending,
drafts...] as it is, beside a prompt's chunk (Transformer.forward_packed); any other pads rows to the longest draft
(padding is never committed).
"""

from __future__ import annotations

import time

import torch

from verispec.core.requests import Sequence
from verispec.core.step_record import RowStep, StepRecord
from verispec.drafters.base import Proposal
from verispec.drafters.batch_draft import PAD_TOKEN
from verispec.models.machine import forget_choice
from verispec.cost_model import moving_average
from verispec.sampling import TokenHistory, logits_to_probs, token_logprobs
from verispec.verify import verify, verify_greedy


class Stepping:
    """The scheduler's room for the step (a mixin of Scheduler: it reads the rows, the target and its cache, the
    draft and the controller; the rooms for drafting, admission and lifecycle do the rest)."""

    def _step(self) -> StepRecord:
        """Every active row advances by one speculative step in one target forward; what happened is returned and
        handed to the metrics and the step observers."""
        active, n = self.active, len(self.active)
        started = time.perf_counter()
        sources, k_per_row, probing = self._plan(n)
        proposals, draft_seconds = self._draft(k_per_row, sources, probing)
        verifying = time.perf_counter()
        row_tokens = [[s.tokens[-1], *p.token_ids[0].tolist()] for s, p in zip(active, proposals)]
        prefilling = self._prefilling if self.packs_prefill else None
        chunk: list[int] = []  # prompt tokens of the row being admitted (row n), carried by this forward
        if prefilling is not None:
            chunk = self._packed_chunk(prefilling, sum(map(len, row_tokens)), verifying - started)
        row_logits, hidden, verify_tokens = self._verify_forward(row_tokens, chunk)  # (1 + k_b, V) per row
        # A faulty row (-1 accepted) commits nothing and leaves after the step.
        verified = [
            self._try(sequence, self._verify_row, sequence, proposal, logits, default=(-1, []))
            for sequence, proposal, logits in zip(active, proposals, row_logits)
        ]
        accepted = [num_accepted for num_accepted, _ in verified]
        self.cache.rows(0, n).commit(torch.tensor(accepted) + 1)
        finished_at = time.perf_counter()
        forward_seconds = finished_at - verifying
        self._observe_forward(verify_tokens, forward_seconds, len(chunk))
        deepest = max((p.num_tokens for p in proposals if p.source == self.batched_source), default=0)
        done: list[tuple[Sequence, str]] = []
        for b, (sequence, proposal, (num_accepted, tokens)) in enumerate(zip(active, proposals, verified)):
            if sequence.fault is not None:
                continue
            sequence.stats.draft_seconds += verifying - started
            sequence.stats.verify_seconds += forward_seconds
            source = proposal.source or self.drafter
            spent = draft_seconds.get(source, 0.0)
            if source == self.batched_source and proposal.num_tokens:  # the batch drafted `deepest` positions
                spent *= proposal.num_tokens / deepest
            self._learn_from_row(sequence, proposal, num_accepted, spent, verify_tokens)
            if hidden is not None:  # the positions it committed: its pending token's and the accepted drafts'
                self.draft.observe(b, len(sequence.tokens) - 1, hidden[b][: num_accepted + 1])
            sequence.tokens.extend(tokens)
            finish_reason = self._try(sequence, self._commit_row, sequence, tokens, row_logits[b], finished_at)
            if finish_reason is not None:
                done.append((sequence, finish_reason))
        if not chunk:  # the streams' steady step, which a chunk may lengthen by its share (see _packed_chunk)
            self._observe_step(proposals, draft_seconds, forward_seconds, started, finished_at)
        record = StepRecord(
            tuple(RowStep((p.source or self.drafter) if p.num_tokens else None, p.num_tokens, a)
                  for p, a in zip(proposals, accepted)),
            draft_seconds, verify_tokens, len(chunk), forward_seconds, time.perf_counter() - started,
        )
        if self.metrics is not None:
            self.metrics.step(record)
        for observe in self.step_observers:
            observe(record)
        if chunk:
            self._carried(prefilling, chunk, None if hidden is None else hidden[n])
        for sequence, reason in done:
            self._retire([sequence], reason, emitted=True)
        self._retire([sequence for sequence in active if sequence.fault is not None], "error")
        return record

    def _verify_forward(
        self, row_tokens: list[list[int]], chunk: list[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, int]:
        """The target's forward over every row's [pending, drafts...] (and a prompt's chunk after them): each row's
        scores (1 + k_b, V), its hidden states (1 + k_b, C) where a draft head reads them (the chunk's too, last),
        and the tokens the forward took."""
        n = len(row_tokens)
        hidden: list[torch.Tensor] | None = [] if self.feeds_head else None
        if self.target.model.batch_invariant:
            # One packed forward over every row's [pending, drafts...] and the chunk: each row as wide as it is.
            row_logits = self.target.model.forward_packed(
                row_tokens + ([chunk] if chunk else []), self.cache.rows(0, n + bool(chunk)),
                [True] * n + [False] * bool(chunk), hidden_out=hidden,
            )
            return row_logits, hidden, sum(map(len, row_tokens))
        # One target forward over every row's [pending, drafts...], right-padded to the longest.
        width = max(map(len, row_tokens))
        inputs = torch.full((n, width), PAD_TOKEN, dtype=torch.long)  # (n, 1 + k)
        for b, tokens in enumerate(row_tokens):
            inputs[b, : len(tokens)] = torch.tensor(tokens)
        padded_hidden = [] if hidden is not None else None
        logits = self.target.model.forward(inputs, self.cache.rows(0, n), hidden_out=padded_hidden)  # (n, 1 + k, V)
        row_logits = [logits[b, : len(tokens)] for b, tokens in enumerate(row_tokens)]
        if hidden is not None:
            hidden = [padded_hidden[0][b, : len(tokens)] for b, tokens in enumerate(row_tokens)]
        return row_logits, hidden, n * width

    def _observe_forward(self, verify_tokens: int, seconds: float, chunk_tokens: int) -> None:
        """What the forward cost, for the controller's choices (a plain one) or the next chunk's size (one that
        carried a chunk says nothing of what verifying costs); a plain one-token forward for the target's format
        check."""
        if chunk_tokens:
            total = verify_tokens + chunk_tokens
            smoothing = self.controller.settings.smoothing
            self._packed_seconds[total] = moving_average(self._packed_seconds.get(total), seconds, smoothing)
            return
        self.controller.observe_forward(verify_tokens, seconds, rows=len(self.active))
        if self.controller.stale_seed is not None and self._remembered_costs is not None:
            forget_choice(self._remembered_costs)  # timed in a loaded moment: the next start times them again
            self._remembered_costs = None
        if verify_tokens == 1:
            self._check_target_format(seconds)

    def _learn_from_row(
        self, sequence: Sequence, proposal: Proposal, num_accepted: int, draft_seconds: float, verify_tokens: int
    ) -> None:
        """A verified row's drafts into its statistics, its own acceptance by position (k_per_sequence) and the
        controller's acceptance and drafting costs."""
        drafted = proposal.num_tokens
        source = proposal.source or self.drafter
        sequence.stats.record_step(drafted, num_accepted, source)
        sequence.stats.draft_forwards += proposal.forwards
        if drafted and self.k_per_sequence:
            hits, reached = sequence.position_hits.setdefault(source, ([0] * self.k_max, [0] * self.k_max))
            for position in range(min(drafted, num_accepted + 1, self.k_max)):
                reached[position] += 1
                hits[position] += position < num_accepted
        self.controller.observe(source, drafted, num_accepted, draft_seconds, verify_tokens, None,
                                batch_size=len(self.active))

    def _observe_step(
        self, proposals: list[Proposal], draft_seconds: dict[str, float], forward_seconds: float, started: float,
        finished_at: float,
    ) -> None:
        """A step without a prompt's chunk: the streams' steady step (prefill's share is sized by it) and, where one
        source or none drafted, the step's overhead beyond its drafting and forward (a draft model's catch-up is
        weighed apart)."""
        self._step_seconds = moving_average(self._step_seconds, finished_at - started, self.controller.settings.smoothing)
        drafters = {p.source or self.drafter for p in proposals if p.num_tokens}
        if len(drafters) <= 1:
            batched = self.draft is not None and self.batched_source in drafters
            catch_up = self.draft.catch_up_seconds if batched else 0.0
            self.controller.observe_step(
                next(iter(drafters), None), len(self.active), time.perf_counter() - started - catch_up,
                sum(draft_seconds.values()) + forward_seconds,
            )

    def _verify_row(
        self, sequence: Sequence, proposal: Proposal, logits: torch.Tensor
    ) -> tuple[int, list[int]]:
        """Accept/reject one row's drafts against its target scores (1 + k_b, V): (accepted drafts, new tokens)."""
        params = sequence.config.sampling
        if params.greedy and not params.transforms_scores and sequence.grammar is None and proposal.probs is None:
            return verify_greedy(proposal.token_ids[0], logits)  # the same tokens, without one-hot rows of V
        allowed = None  # (1, 1 + k_b, V) under a grammar: its mask at every verified position
        if sequence.grammar is not None:
            allowed = sequence.grammar.masks_along(proposal.token_ids[0].tolist())[None]
        history = None  # penalties: the tokens before each verified position
        if params.penalized:
            history = TokenHistory(sequence.tokens + proposal.token_ids[0].tolist(), len(sequence.prompt_ids))
        p = logits_to_probs(logits[None], params, allowed, history)  # (1, 1 + k_b, V)
        result = verify(proposal.token_ids, proposal.probs, p, sequence.generator)
        num_accepted = int(result.num_accepted[0])
        return num_accepted, result.token_ids[0, : num_accepted + 1].tolist()

    def _commit_row(self, sequence: Sequence, tokens: list[int], logits: torch.Tensor, now: float) -> str | None:
        """Advance a row's grammar over its new tokens and stream them; its finish reason when it is done."""
        if sequence.grammar is not None:
            sequence.grammar.advance(tokens)
        logprobs = None
        if sequence.config.logprobs is not None:  # the target's scores at each emitted token
            logprobs = token_logprobs(logits, tokens, sequence.config.logprobs)
        return self._emit(sequence, tokens, now, logprobs)
