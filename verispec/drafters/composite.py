"""Composite: ask cheap lookup drafters first, fall back to a draft model when they have nothing.

Lookup-style drafters cost microseconds and are often right on input-grounded text (edits, RAG,
summaries), where a draft model spends k forwards to guess the same tokens. When lookup finds no
match, the draft model still gives good guesses on novel text. The draft model keeps its own cache
in sync with the committed tokens, so it catches up in one forward after lookup steps.

The two kinds differ in what a draft costs and how often it is accepted, so the controller chooses k
for the drafter that will propose: `next_source` says which, before anything is drafted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from verispec.drafters.base import Drafter, Proposal, as_drafter
from verispec.sampling import SamplingParams

if TYPE_CHECKING:
    from verispec.grammar import Grammar


class CompositeDrafter(Drafter):
    def __init__(self, drafters: list[Drafter]) -> None:
        if not drafters:
            raise ValueError("a composite drafter needs at least one drafter")
        self.drafters = [as_drafter(drafter) for drafter in drafters]

    def begin(self, prompt_ids: list[int], max_length: int) -> None:
        for drafter in self.drafters:
            drafter.begin(prompt_ids, max_length)

    def next_source(self, tokens: list[int]) -> str | None:
        """Which drafter propose(tokens, ...) will use: the first lookup with a match, else the last drafter.

        None when a drafter cannot tell (one that does not tell whether it proposes, or has no `source`, as a user's
        own may be).
        """
        for drafter in self.drafters[:-1]:
            if not drafter.tells_if_it_proposes:
                return None
            if drafter.can_propose(tokens):
                return drafter.source or None
        return self.drafters[-1].source or None

    drafts_under_grammar = True  # handed on to the drafters that take one

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
        grammar: "Grammar | None" = None,
    ) -> Proposal:
        """The first drafter's proposal that is not empty (the last drafter's otherwise)."""
        for drafter in self.drafters:
            constrained = grammar is not None and drafter.drafts_under_grammar
            proposal = drafter.propose(tokens, k, params, generator, grammar) if constrained else drafter.propose(
                tokens, k, params, generator
            )
            if proposal.num_tokens > 0:
                return proposal
        return proposal
