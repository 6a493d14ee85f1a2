"""The two drafting interfaces and what they declare: `Drafter` proposes for one request, `BatchedProposer` for
every row of a batch in one call (the scheduler drafts only through it: per-request drafters go behind
`sequence_drafters.SequenceDrafters`); each proposes up to k next tokens with the distribution each was drawn from."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

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


class Drafter(ABC):
    """Proposes only the draft, never the context, and keeps whatever state it needs in sync itself.

    `tokens` is the whole committed sequence (prompt and generated so far). Between calls the
    engine may have rejected any suffix of the previous proposal; the drafter detects that by
    comparing with what it saw last time, so no separate rollback call is needed.

    What a drafter can do beyond proposing is declared by the class attributes below, which the engine and the
    scheduler read instead of probing for methods. A user's drafter that does not subclass Drafter is read through
    `as_drafter`.
    """

    source: str = ""  # the name its proposals carry, which the controller keys costs by ("": none, the caller names it)
    # Structured output: propose takes the request's Grammar as a fifth argument and masks q by it (its state must
    # come back as it was). Other drafters' drafts are cut where the grammar forbids them.
    drafts_under_grammar: bool = False
    # can_propose answers, cheaply, whether propose would find anything (lookups): for a composite's `--k auto`.
    tells_if_it_proposes: bool = False

    @abstractmethod
    def begin(self, prompt_ids: list[int], max_length: int) -> None:
        """Start a new request of at most max_length tokens in all (prefill what the drafter caches)."""

    @abstractmethod
    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """Up to k tokens to follow `tokens`."""

    def can_propose(self, tokens: list[int]) -> bool:
        """Whether propose(tokens, ...) would find anything; only a drafter that tells_if_it_proposes knows."""
        raise NotImplementedError(f"{type(self).__name__} does not tell whether it proposes (tells_if_it_proposes)")

    def next_source(self, tokens: list[int]) -> str | None:
        """The source propose(tokens, ...) will draft with, before anything is drafted (None: it cannot tell)."""
        return self.source or None


class _UndeclaredDrafter(Drafter):
    """A drafter that does not subclass Drafter (begin and propose, and maybe `source`, `can_propose` and
    `drafts_under_grammar`, as drafters were written before Drafter declared them), read as one that declares them.
    The one place their optional members are looked up."""

    def __init__(self, drafter: object) -> None:
        self.drafter = drafter

    @property
    def source(self) -> str:
        return getattr(self.drafter, "source", "")

    @property
    def drafts_under_grammar(self) -> bool:
        return getattr(self.drafter, "drafts_under_grammar", False)

    @property
    def tells_if_it_proposes(self) -> bool:
        return hasattr(self.drafter, "can_propose")

    def begin(self, prompt_ids: list[int], max_length: int) -> None:
        self.drafter.begin(prompt_ids, max_length)

    def propose(self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                *grammar: "Grammar | None") -> Proposal:
        return self.drafter.propose(tokens, k, params, generator, *grammar)

    def can_propose(self, tokens: list[int]) -> bool:
        return self.drafter.can_propose(tokens)


def as_drafter(drafter: object) -> Drafter:
    """`drafter` itself where it subclasses Drafter; else a Drafter that reads its optional members."""
    return drafter if isinstance(drafter, Drafter) else _UndeclaredDrafter(drafter)


class BatchedProposer(ABC):
    """Proposes for the sequences in rows 0 .. n-1 of a batch in one call. Row b's state belongs to the sequence in
    row b of the target's cache and moves with it (the scheduler keeps active rows at 0 .. n-1); each row rolls
    itself back to what it shares with the committed tokens, so rejected drafts need no separate call.

    What it needs and can do beyond proposing from the committed tokens is declared: `needs_hidden_states` (the
    target's forwards hand it their last hidden states through `observe`, and it is timed by `timed_costs`, not as
    a model), `tells_if_it_proposes` (`can_propose` answers cheaply whether a row would find a draft). Every
    batched proposer drafts under each row's grammar, or cuts its drafts to it.
    """

    source: str = ""  # the name its proposals carry
    needs_hidden_states: bool = False
    tells_if_it_proposes: bool = False

    def __init__(self) -> None:
        self.catch_up_seconds = 0.0  # of the last propose(): feeding long tails, not drafting
        self.catch_up_tokens = 0  # tokens those long tails held
        self.faults: dict[int, Exception] = {}  # of the last propose(): rows whose own sampling or grammar failed

    @abstractmethod
    def add(self, row: int, prompt_ids: list[int], max_length: int) -> None:
        """Start a new sequence in `row`: its prompt, and at most max_length tokens in all (a proposer may take the
        prompt in lazily, with the row's first proposal)."""

    @abstractmethod
    def share_prompt(self, source: int, destination: int, prompt_length: int) -> None:
        """Start a new sequence in `destination` with what row `source` holds of the same prompt (n choices)."""

    @abstractmethod
    def restart_window(self, row: int, tokens: list[int], window: int) -> None:
        """Let the row see only about the last `window` of its committed `tokens` from its next proposal on."""

    @abstractmethod
    def behind(self, row: int, tokens: list[int]) -> int:
        """How many committed tokens the row has not taken in yet (about)."""

    @abstractmethod
    def move(self, source: int, destination: int) -> None:
        """The sequence in row `source` now lives in row `destination`."""

    @abstractmethod
    def propose(
        self,
        tokens: list[list[int]],
        ks: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        catch_up_limit: int | None = None,
        grammars: list["Grammar | None"] | None = None,
        prompt_lengths: list[int] | None = None,
    ) -> list[Proposal]:
        """Up to ks[b] draft tokens for each row b < n (tokens[b]: its committed tokens; ks[b] = 0: it proposes
        nothing). Sets catch_up_seconds, catch_up_tokens and faults for this call."""

    def can_propose(self, row: int, tokens: list[int]) -> bool:
        """Whether the row would find a draft after `tokens`; only a proposer that tells_if_it_proposes knows."""
        raise NotImplementedError(f"{type(self).__name__} does not tell whether it proposes (tells_if_it_proposes)")

    def next_source(self, row: int, tokens: list[int]) -> str | None:
        """The source the row's next proposal will carry (None: it cannot tell before drafting)."""
        return self.source or None

    def observe(self, row: int, position: int, features: torch.Tensor) -> None:
        """The target's hidden states (T, C), or (T, F C) of a fused head's layers (Transformer.feature_layers), of
        the row's positions position .. position + T - 1."""
        raise NotImplementedError(f"{type(self).__name__} does not read hidden states (needs_hidden_states)")

    def timed_costs(self) -> tuple[float, float]:
        """Seconds of one draft position for one row, and of a catch-up per position, timed now."""
        raise NotImplementedError(f"{type(self).__name__} is timed as a model (step_costs)")


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
