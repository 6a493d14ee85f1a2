"""Each sequence's own drafter (a lookup, the cross-tokenizer drafter, a library user's drafter) as a batched proposer.

Row b's drafter belongs to the sequence in row b of the target's cache and moves with it, as a draft model's cache
row does; a proposal asks each drafting row's drafter alone, for that row's own k. The scheduler so drafts through
one protocol (`BatchedProposer`) whoever drafts for a row.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch

from verispec.drafters.base import BatchedProposer, Drafter, Proposal, as_drafter, cut_to_grammar
from verispec.sampling import SamplingParams

if TYPE_CHECKING:
    from verispec.grammar import Grammar


class SequenceDrafters(BatchedProposer):
    """The rows' own drafters, each made by `new_drafter` when its sequence starts decoding."""

    def __init__(self, new_drafter: Callable[[], object]) -> None:
        super().__init__()
        self.new_drafter = new_drafter
        self.rows: dict[int, Drafter] = {}  # row -> its sequence's drafter
        self._prompts: dict[int, tuple[list[int], int]] = {}  # row -> (prompt, max_length) it began with
        # Of the last propose(): seconds spent drafting by the proposals' source ("": the drafter names none),
        # catch-up excluded.
        self.seconds: dict[str, float] = {}

    @property
    def source(self) -> str:  # type: ignore[override] - the rows' drafters name it ("" before any row, or unnamed)
        return next((drafter.source for drafter in self.rows.values()), "")

    @property
    def tells_if_it_proposes(self) -> bool:  # type: ignore[override]
        return bool(self.rows) and all(drafter.tells_if_it_proposes for drafter in self.rows.values())

    def add(self, row: int, prompt_ids: list[int], max_length: int) -> None:
        drafter = as_drafter(self.new_drafter())
        drafter.begin(prompt_ids, max_length)
        self.rows[row] = drafter
        self._prompts[row] = (prompt_ids, max_length)

    def share_prompt(self, source: int, destination: int, prompt_length: int) -> None:
        """A drafter of its own for `destination`, begun on the prompt row `source` began with (a lookup learns from
        its own sequence's text only)."""
        prompt, max_length = self._prompts[source]
        self.add(destination, prompt[:prompt_length], max_length)

    def restart_window(self, row: int, tokens: list[int], window: int) -> None:
        """Nothing to do: a drafter of one sequence reads its committed tokens itself at every proposal."""

    def behind(self, row: int, tokens: list[int]) -> int:
        return 0  # as restart_window: it keeps itself in sync

    def move(self, source: int, destination: int) -> None:
        self.rows[destination] = self.rows.pop(source)
        self._prompts[destination] = self._prompts.pop(source)

    def can_propose(self, row: int, tokens: list[int]) -> bool:
        return self.rows[row].can_propose(tokens)

    def next_source(self, row: int, tokens: list[int]) -> str | None:
        return self.rows[row].next_source(tokens)

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
        """Each row's own drafter's proposal of up to ks[b] tokens, cut where the row's grammar forbids a draft; a
        row whose drafter raises proposes nothing and is named in faults. A drafter's catch-up (a backlog fed)
        is its own business: no limit applies."""
        grammars = grammars if grammars is not None else [None] * len(tokens)
        self.catch_up_tokens, self.catch_up_seconds = 0, 0.0
        self.faults, self.seconds = {}, {}
        proposals = []
        for row, (committed, k) in enumerate(zip(tokens, ks)):
            proposal = Proposal(torch.empty(1, 0, dtype=torch.long), None)
            if k > 0:
                started = time.perf_counter()
                try:
                    proposal = self._propose_one(self.rows[row], committed, k, params[row], generators[row],
                                                 grammars[row])
                except Exception as error:  # noqa: BLE001 - one row's failure is its own (see faults)
                    self.faults[row] = error
                spent = time.perf_counter() - started - proposal.catch_up_seconds
                self.catch_up_seconds += proposal.catch_up_seconds
                self.seconds[proposal.source] = self.seconds.get(proposal.source, 0.0) + spent
            proposals.append(proposal)
        return proposals

    @staticmethod
    def _propose_one(
        drafter: Drafter, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
        grammar: Grammar | None,
    ) -> Proposal:
        """One drafter's proposal, cut where the grammar forbids a draft; a drafter that drafts under a grammar
        (drafts_under_grammar) is handed it."""
        if grammar is not None and drafter.drafts_under_grammar:
            return cut_to_grammar(drafter.propose(tokens, k, params, generator, grammar), grammar)
        return cut_to_grammar(drafter.propose(tokens, k, params, generator), grammar)
