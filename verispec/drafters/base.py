"""The drafter interface: propose up to k next tokens, each with the distribution it was drawn from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from verispec.sampling import SamplingParams

if TYPE_CHECKING:
    from verispec.grammar import Grammar


@dataclass
class Proposal:
    token_ids: torch.Tensor  # (1, k) proposed continuation, k may be smaller than asked (even 0)
    probs: torch.Tensor | None  # (1, k, V) q over the target's full vocabulary; None = point masses
    forwards: int = 0  # draft model forward passes spent on this proposal
    source: str = ""  # which drafter proposed it (a composite drafter picks one per step)
    catch_up_seconds: float = 0.0  # of its time, spent feeding a long backlog of committed tokens: not drafting

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[1]


class Drafter(Protocol):
    """Proposes only the draft, never the context, and keeps whatever state it needs in sync itself.

    `tokens` is the whole committed sequence (prompt and generated so far). Between calls the
    engine may have rejected any suffix of the previous proposal; the drafter detects that by
    comparing with what it saw last time, so no separate rollback call is needed.

    Optional, for a composite drafter's `--k auto`: a `source` name (the one its proposals carry) and
    `can_propose(tokens) -> bool` (whether propose would find anything: lookup drafters). Optional, for
    structured output: `drafts_under_grammar = True` and a fifth argument of propose, the request's
    `Grammar`, which masks q (its state must come back as it was); other drafters' drafts are cut where
    the grammar forbids them.
    """

    def begin(self, prompt_ids: list[int], max_length: int) -> None:
        """Start a new request of at most max_length tokens in all (prefill what the drafter caches)."""

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """Up to k tokens to follow `tokens`."""
        ...


# A drafter further behind the committed tokens than this (a lazily fed prompt, plain steps, accepted
# lookup drafts) reports feeding them as catching up, so the controller does not take it for drafting cost.
LONG_TAIL = 8


def cut_to_grammar(proposal: Proposal, grammar: "Grammar | None") -> Proposal:
    """The drafts the verify pass can use under a grammar: a point-mass proposal up to its first forbidden
    token, a sampled one through it (its rejection must draw from the residual; see verispec.grammar)."""
    if grammar is None or proposal.num_tokens == 0:
        return proposal
    valid = grammar.valid_prefix(proposal.token_ids[0].tolist())
    keep = valid if proposal.probs is None else min(valid + 1, proposal.num_tokens)
    if keep == proposal.num_tokens:
        return proposal
    probs = None if proposal.probs is None else proposal.probs[:, :keep]
    return dataclasses.replace(proposal, token_ids=proposal.token_ids[:, :keep], probs=probs)
