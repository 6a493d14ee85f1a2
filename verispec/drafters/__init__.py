"""Ways of proposing draft tokens. Each file is one proposer; `load_draft_model` builds the default."""

from __future__ import annotations

import torch

from verispec.drafters.base import Drafter, Proposal
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.models.loading import LoadedModel, load_model

QUANTIZATIONS = ("auto", "none", "int8", "int4")


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft model's token ids must mean the same text as the target's."""
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(
            f"draft model {draft.name!r} has a different tokenizer from target {target.name!r}; "
            "a draft model must share the target's vocabulary"
        )


def load_draft_model(
    spec: str,
    target: LoadedModel,
    dtype: str | torch.dtype = "auto",
    quantize: str = "auto",
    progress: bool = False,
) -> DraftModelDrafter:
    """Load a same-tokenizer draft model, made cheaper by weight-only quantization.

    quantize: "auto" = int4 when running in bfloat16 (the draft's cost, not its accuracy, decides
    the speedup on CPUs), else none; or "none", "int8", "int4". The output is the target's either way.
    """
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"draft quantization {quantize!r} is not one of {', '.join(QUANTIZATIONS)}")
    draft = load_model(spec, dtype, progress)
    check_same_vocabulary(target, draft)
    if quantize == "auto":
        quantize = "int4" if draft.model.dtype == torch.bfloat16 else "none"
    if quantize != "none":
        draft.model.quantize(4 if quantize == "int4" else 8)
    return DraftModelDrafter(draft.model, target.model.vocab_size)


__all__ = ["Drafter", "Proposal", "DraftModelDrafter", "load_draft_model", "check_same_vocabulary"]
