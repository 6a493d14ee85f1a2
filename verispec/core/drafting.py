"""Drafting: which drafter proposes for each row, how many tokens, and their proposals.

Each step asks the controller for k by batch size and drafter; with k_per_sequence, each row's own acceptance
refines it. Two proposers of one protocol (`BatchedProposer`) draft: the batched draft (a draft model, or a draft
head over the target's hidden states) for its rows in one forward per position, and the sequences' own drafters
(`SequenceDrafters`: lookups, the cross-tokenizer drafter, a library user's drafter) each for its own row; a
composite asks the row's lookup first.
"""

from __future__ import annotations

import collections
import time

import torch

from verispec.core.admission import PREFILL_MIN_SHARE
from verispec.core.requests import Sequence
from verispec.drafters.base import LONG_TAIL, BatchedProposer, Proposal
from verispec.drafters.draft_format import replace_format
from verispec.models.transformer import PREFILL_CHUNK

# A share of rows with a recurring context is taken to hold this many steps; then the lookups are planned for every
# row again (and so asked, where that pays), so that text that starts to recur under a full batch is found.
LOOKUP_SHARE_STEPS = 256
PROBE_WINDOW = 24  # a probe's row far behind in the draft cache sees only its latest tokens (restart_window)


class Drafting:
    """The scheduler's room for drafting (a mixin of Scheduler: it reads the scheduler's controller, draft,
    active rows and settings)."""

    def _plan(self, batch_size: int) -> tuple[list[str | None], list[int], bool]:
        """Who drafts for each row this step, each row's k (its drafter's, capped by what the row can still use;
        with k_per_sequence, refined by the row's own acceptance), and whether the batched drafter probes."""
        active = self.active
        if self._lookups_may_draft(batch_size):
            sources = self._sources()
            self._lookup_share = sum(source not in (self.batched_source, None) for source in sources) / batch_size
            self._steps_since_lookups = 0
        else:
            sources = [self.batched_source] * batch_size
            self._steps_since_lookups += 1
        rows = collections.Counter(source for s, source in zip(active, sources) if s.draft_cap > 0)  # drafting rows
        choices = {source: self._choose_k(batch_size, source, rows[source]) for source in rows}  # -> (k, probe)
        k_per_row = [max(0, min(choices.get(source, (0, False))[0], s.draft_cap)) for s, source in zip(active, sources)]
        if self.k_per_sequence:
            k_per_row = self._k_per_sequence(k_per_row, sources, choices)
        return sources, k_per_row, choices.get(self.batched_source, (0, False))[1]

    def _sources(self) -> list[str | None]:
        """Which drafter proposes for each active row this step (composite: lookup where the context recurs; a
        library's own drafter: what it says it will use, None where it cannot tell)."""
        return [self._try(s, self._source_of, row, s, default=self.drafter) for row, s in enumerate(self.active)]

    def _lookups_may_draft(self, batch_size: int) -> bool:
        """Whether a composite's lookups could draft this step, by the controller's plan for them with as many rows
        as found a recurring context when they were last asked (every row before they were); else every row goes to
        the batched drafter and no lookup is asked. Asking costs each row an index update over its newest tokens:
        a busy server where nothing recurs would pay it every step for nothing, and one planned as if every row
        drafted would index every row's backlog to serve the few that do."""
        if self.k != "auto" or self.draft is None or self.own is None:
            return True
        lookup = self.own.source or None
        if lookup is None:
            return True
        stale = self._lookup_share is None or self._steps_since_lookups >= LOOKUP_SHARE_STEPS
        rows = None if stale else max(1, round(self._lookup_share * batch_size))
        return self.controller.planned_k(batch_size, lookup, rows) > 0

    def _source_of(self, row: int, sequence: Sequence) -> str | None:
        own = self.own
        if own is None:
            return self.batched_source if self.draft is not None else self.drafter
        if self.draft is not None:  # composite: the sequence's lookup where it finds something, else the draft model
            return own.rows[row].source if own.can_propose(row, sequence.tokens) else self.batched_source
        return own.next_source(row, sequence.tokens)

    def _choose_k(self, batch_size: int, source: str | None, rows: int) -> tuple[int, bool]:
        """k for the `rows` rows `source` drafts for, and whether it is a probe (k = 1 to re-measure acceptance)."""
        if self.drafter == "none":
            return 0, False
        if self.k != "auto":
            return int(self.k), False
        return self.controller.choose_k(batch_size, source, rows), self.controller.probing

    def _k_per_sequence(
        self, k_per_row: list[int], sources: list[str], choices: dict[str, tuple[int, bool]]
    ) -> list[int]:
        """Each source's k (chosen for all its rows, > 0 and not a probe) refined row by row by the rows' own acceptance."""
        k_per_row = list(k_per_row)
        for source, (k, probe) in choices.items():
            rows = [b for b, s in enumerate(sources) if s == source and k_per_row[b] > 0]
            if k == 0 or probe or not rows:
                continue
            acceptance = []
            for b in rows:
                hits, reached = self.active[b].position_hits.get(source, ([0] * self.k_max, [0] * self.k_max))
                acceptance.append(self.controller.row_acceptance(source, hits, reached))
            others = sum(1 + k for b, k in enumerate(k_per_row) if b not in rows)
            caps = [min(self.k_max, self.active[b].draft_cap) for b in rows]
            refined = self.controller.choose_row_ks(len(self.active), source, acceptance, others, caps)
            if refined is not None:
                for b, row_k in zip(rows, refined):
                    k_per_row[b] = row_k
        return k_per_row

    def _draft(
        self, k_per_row: list[int], sources: list[str], probing: bool
    ) -> tuple[list[Proposal], dict[str, float]]:
        """Each row's proposal (trimmed to its k), and the seconds each source spent drafting (catch-up excluded):
        the batched draft for the rows planned for it, each sequence's own drafter for the others."""
        active = self.active
        proposals = [Proposal(torch.empty(1, 0, dtype=torch.long), None) for _ in active]
        seconds: dict[str, float] = {}
        model = self.batched_source
        if self.draft is not None:
            drafting = self._batch_rows(k_per_row, sources, probing)
            if any(drafting):
                ks = [k if wants else 0 for k, wants in zip(k_per_row, drafting)]
                started = time.perf_counter()
                batched = self._propose(self.draft, ks)
                seconds[model] = time.perf_counter() - started - self.draft.catch_up_seconds
                if sum(drafting) == 1:
                    self._check_draft_format(seconds[model] / max(ks))
                self.controller.observe_catch_up(self.draft.catch_up_seconds, self.draft.catch_up_tokens)
                proposals = [p if wants else proposal for p, wants, proposal in zip(batched, drafting, proposals)]
        if self.own is not None:  # the rows the batched draft does not draft for (all, where there is none)
            ks = [
                k if (source != model or self.draft is None) and s.fault is None else 0
                for k, source, s in zip(k_per_row, sources, active)
            ]
            if any(ks):
                own = self._propose(self.own, ks)
                for name, spent in self.own.seconds.items():
                    seconds[name or self.drafter] = seconds.get(name or self.drafter, 0.0) + spent
                proposals = [p if k > 0 else proposal for p, k, proposal in zip(own, ks, proposals)]
        trimmed = []  # a row near its max_tokens keeps only drafts it can still use
        for proposal, k in zip(proposals, k_per_row):
            if proposal.num_tokens > k:
                probs = proposal.probs[:, :k] if proposal.probs is not None else None
                proposal = Proposal(proposal.token_ids[:, :k], probs, proposal.forwards, proposal.source)
            trimmed.append(proposal)
        return trimmed, seconds

    def _propose(self, proposer: BatchedProposer, ks: list[int]) -> list[Proposal]:
        """The proposer's proposals for every active row (ks[b] tokens at most, 0: none); a row whose own sampling,
        grammar or drafter failed is marked faulty (it ends alone after this step)."""
        active = self.active
        proposals = proposer.propose(
            [s.tokens for s in active], ks, [s.config.sampling for s in active], [s.generator for s in active],
            self._catch_up_limit(), [s.grammar for s in active], [len(s.prompt_ids) for s in active],
        )
        for row, error in proposer.faults.items():
            active[row].fault = error
        return proposals

    def _batch_rows(self, k_per_row: list[int], sources: list[str], probing: bool) -> list[bool]:
        """The rows the batched draft drafts for this step: those planned for it; a probe asks only those whose
        draft cache is current (else the first), and otherwise only rows whose catch-up drafting wins back."""
        active = self.active
        model = self.batched_source
        drafting = [k > 0 and source == model for k, source in zip(k_per_row, sources)]
        if not any(drafting):
            return drafting
        if probing:
            current = [
                wants and self.draft.behind(row, s.tokens) <= LONG_TAIL
                for row, (wants, s) in enumerate(zip(drafting, active))
            ]
            first = drafting.index(True)
            drafting = current if any(current) else [row == first for row in range(len(active))]
            if not any(current) and self.draft.behind(first, active[first].tokens) > PROBE_WINDOW:
                # A probe is there to measure acceptance, which the latest tokens show as well as all of them; a
                # whole catch-up would cost many plain steps on a slow CPU, and grows with the text.
                self.draft.restart_window(first, active[first].tokens, PROBE_WINDOW)
        elif self.k == "auto":
            # A probe catches its row up whatever the estimates say: it is how wrong estimates get corrected (else a
            # cold first measurement could keep a server from ever drafting again).
            kept = self._worth_catching_up(drafting, k_per_row)
            drafting = self.controller.rows_left_pay(model, drafting, kept, k_per_row)
        return drafting

    def _catch_up_limit(self) -> int | None:
        """Tokens the rows far behind in the draft cache may catch up by in all this step: with others decoding,
        what fits in PREFILL_MIN_SHARE of a step (as measured; one chunk until measured), so that feeding new
        prompts to the draft model slows the streams no more than their prefill does. Alone: everything."""
        if not self.chunked_prefill or len(self.active) < 2:
            return None
        per_token = self.controller.catch_up_per_token
        if per_token is None or self._step_seconds is None:
            return PREFILL_CHUNK
        return max(LONG_TAIL + 1, int(self._step_seconds * PREFILL_MIN_SHARE / per_token))

    def _worth_catching_up(self, drafting: list[bool], k_per_row: list[int]) -> list[bool]:
        """The drafting rows, less those far behind in the draft cache that drafting would not win their catch-up
        back for (AdaptiveController.catch_up_rows)."""
        behind = [self.draft.behind(row, sequence.tokens) for row, sequence in enumerate(self.active)]
        remaining = [sequence.remaining for sequence in self.active]
        return self.controller.catch_up_rows(self.batched_source, drafting, behind, remaining, k_per_row, LONG_TAIL)

    def _check_draft_format(self, forward_seconds: float) -> None:
        """Feed one one-row draft forward to the draft's format check; where another format is remembered as
        MARGIN faster, time the formats again and draft with the new choice (its rows' caches stay: any draft
        is verified exactly, so old keys from another format cost acceptance at most)."""
        check = getattr(self.draft.model, "format_check", None)
        if check is not None and check.observe(forward_seconds):
            self.draft.model = replace_format(self.draft.model)
            self.draft_format_replacements += 1
