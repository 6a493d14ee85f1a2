"""Chain drafting with a small model of the target's family (same tokenizer), for one request.

Its model may be a draft head over the target's hidden states (draft_head.HeadLayer) instead: the engine
then drafts with it through the step, which hands the head those states (batch_head).

A batch of one of the batched draft model (`BatchedDraftModel`), the one draft-model implementation:
the engine and the server draft through the same code. The draft may be made cheaper than its
checkpoint (weight-only or w4a8 quantization, a restricted output vocabulary): the output stays the
target's, only acceptance changes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from verispec.drafters.base import Drafter, Proposal
from verispec.drafters.batch_draft import BatchedDraftModel
from verispec.models.transformer import Transformer
from verispec.sampling import SamplingParams

if TYPE_CHECKING:
    from verispec.drafters.draft_head import HeadLayer
    from verispec.grammar import Grammar


class DraftModelDrafter(Drafter):
    source = "draft-model"
    drafts_under_grammar = True  # propose takes a grammar (see Drafter)

    def __init__(self, model: "Transformer | HeadLayer", target_vocab_size: int, lazy_prefill: bool = False) -> None:
        self.model = model
        self.lazy_prefill = lazy_prefill  # prefill on first use: a fallback drafter may never be asked
        self.target_vocab_size = target_vocab_size  # q is reported over the target's vocabulary
        self.batch: BatchedDraftModel | None = None  # one row: this request's
        self.prompt_length = 0  # where generated tokens start (penalties count them)

    def begin(self, prompt_ids: list[int], max_length: int) -> None:
        if not isinstance(self.model, Transformer):
            raise TypeError("a draft head drafts from the target's hidden states: run it through SpeculativeEngine")
        self.batch = BatchedDraftModel(self.model, self.target_vocab_size, 1, max_length + 1)
        self.batch.add(0, prompt_ids, max_length)
        self.prompt_length = len(prompt_ids)
        if len(prompt_ids) > 1 and not self.lazy_prefill:
            self.batch.prefill(0, prompt_ids[:-1])

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
        grammar: "Grammar | None" = None,
    ) -> Proposal:
        """grammar (structured output): q is masked by it at every draft position, and drafting stops once the
        document is complete; its state walks the drafts and comes back."""
        if k == 0:
            return Proposal(torch.empty(1, 0, dtype=torch.long), None, 0, self.source)
        batch = self.batch
        [proposal] = batch.propose([tokens], [k], [params], [generator], None, [grammar], [self.prompt_length])
        if batch.faults:
            raise batch.faults[0]
        return dataclasses.replace(proposal, catch_up_seconds=batch.catch_up_seconds)
