"""Ways of proposing draft tokens. Each file is one proposer; `make_drafter` builds any of them."""

from __future__ import annotations

from pathlib import Path

import torch

from verispec.drafters.base import Drafter, Proposal
from verispec.drafters.composite import CompositeDrafter
from verispec.drafters.cross_tokenizer import CrossTokenizerDrafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.drafters.draft_format import QUANTIZATIONS, draft_candidates, quantize_draft
from verispec.drafters.draft_head import HEAD_DRAFT, is_head_spec, load_head
from verispec.drafters.draft_vocab import trim_head
from verispec.drafters.suffix_index import SuffixIndexDrafter
from verispec.models.loading import LoadedModel, load_model

COMPOSITE_MIN_MATCH = 3  # a shorter recurring context is weak evidence: let the draft model guess instead
DRAFTERS = ("draft-model", "prompt-lookup", "suffix-index", "cross-tokenizer", "composite", "none")
DEFAULT_DRAFTER = "composite"  # the fastest in the committed benchmarks at one client (benchmarks/results/*/TABLE.md)


def drafter_for(drafter: str | None, draft: str | None) -> str:
    """The drafter a command runs: the one named, else DEFAULT_DRAFTER; and plain decoding ("none") where no draft
    model is given (`--draft none`) and the drafter was not named, or named draft-model."""
    no_model = draft is None or draft.lower() == "none"
    if drafter is None:
        return "none" if no_model else DEFAULT_DRAFTER
    return "none" if drafter == "draft-model" and no_model else drafter


def same_vocabulary(target: LoadedModel, draft: LoadedModel) -> bool:
    """Whether the draft's token ids mean the same text as the target's (else: the cross-tokenizer drafter)."""
    return draft.tokenizer.get_vocab() == target.tokenizer.get_vocab()


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft model's token ids must mean the same text as the target's."""
    if not same_vocabulary(target, draft):
        raise ValueError(
            f"draft model {draft.name!r} has a different tokenizer from target {target.name!r}; "
            "use the cross-tokenizer drafter (--drafter cross-tokenizer) for a draft model with its own vocabulary"
        )


def load_draft_model(
    spec: str,
    target: LoadedModel,
    dtype: str | torch.dtype = "auto",
    quantize: str = "auto",
    progress: bool = False,
    vocab: str | int = "full",
) -> DraftModelDrafter:
    """Load a same-tokenizer draft model, made cheaper by quantization and, where asked, a smaller head.

    quantize: "auto" = int4, w4a8, w8a8 or dense, whichever one-row forward of the whole draft measures
    fastest on this CPU (the draft's cost, not its accuracy, decides the speedup on CPUs; see draft_format);
    or one of FORMATS. vocab: "full", N (a head over the N most frequent tokens) or "auto" (see draft_vocab).
    The output is the target's either way.
    """
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"draft quantization {quantize!r} is not one of {', '.join(QUANTIZATIONS)}")
    return draft_model_drafter(load_model(spec, dtype, progress), target, dtype, quantize, progress, vocab)


def draft_model_drafter(
    draft: LoadedModel,
    target: LoadedModel,
    dtype: str | torch.dtype = "auto",
    quantize: str = "auto",
    progress: bool = False,
    vocab: str | int = "full",
) -> DraftModelDrafter:
    """load_draft_model's drafter from a draft model loaded already (its tokenizer checked, then made cheaper)."""
    check_same_vocabulary(target, draft)
    quantize_draft(draft, quantize, progress, dtype_asked=dtype != "auto")
    trim_head(draft, target, vocab)
    return DraftModelDrafter(draft.model, target.model.vocab_size)


def make_drafter(
    kind: str,
    target: LoadedModel,
    draft: str | None = None,
    dtype: str | torch.dtype = "auto",
    quantize: str = "auto",
    corpus: list[Path] | None = None,
    progress: bool = False,
    vocab: str | int = "full",
) -> Drafter | None:
    """Build a drafter by name (see DRAFTERS); "none" means plain decoding.

    draft-model: a same-tokenizer model (`draft`), or a draft head over the target's hidden states (`draft`
    "head": the target's, built by `make head`; or a head file: see draft_head). prompt-lookup / suffix-index: no model
    (suffix-index also indexes `corpus` files or directories). cross-tokenizer: a model with its own
    tokenizer (`draft`). composite: the suffix index first (it beat prompt lookup on code-edit, see
    benchmarks/results/zen5/code-edit), then the draft model (same tokenizer) or the cross-tokenizer model
    when `draft`'s tokenizer differs. vocab: a same-tokenizer draft model's head (see load_draft_model).
    """
    if kind not in DRAFTERS:
        raise ValueError(f"drafter {kind!r} is not one of {', '.join(DRAFTERS)}")
    if kind == "none":
        return None
    if kind == "prompt-lookup":
        return PromptLookupDrafter()
    if kind == "suffix-index":
        if corpus:
            return SuffixIndexDrafter.with_corpus(corpus, target.encode)
        return SuffixIndexDrafter()
    if draft is None or draft.lower() == "none":
        raise ValueError(f"drafter {kind!r} needs a draft model: pass --draft NAME_OR_PATH")
    if is_head_spec(draft) and kind in ("draft-model", "composite"):
        head = DraftModelDrafter(load_head(draft, target), target.model.vocab_size)
        return head if kind == "draft-model" else CompositeDrafter([composite_lookup(), head])
    if is_head_spec(draft):
        raise ValueError(
            f"drafter {kind!r} drafts with a model of its own; a draft head runs as draft-model or composite"
        )
    if kind == "draft-model":
        return load_draft_model(draft, target, dtype, quantize, progress, vocab)
    model = load_model(draft, dtype, progress)
    if kind == "cross-tokenizer":
        quantize_draft(model, quantize, progress, dtype_asked=dtype != "auto")
        return CrossTokenizerDrafter(model, target)
    quantize_draft(model, quantize, progress, dtype_asked=dtype != "auto")
    if same_vocabulary(target, model):
        trim_head(model, target, vocab)
        fallback = DraftModelDrafter(model.model, target.model.vocab_size, lazy_prefill=True)
    else:
        fallback = CrossTokenizerDrafter(model, target)
    return CompositeDrafter([composite_lookup(), fallback])


def composite_lookup() -> SuffixIndexDrafter:
    """The lookup half of a composite drafter (the server gives each request its own, beside its batched model)."""
    return SuffixIndexDrafter(min_match=COMPOSITE_MIN_MATCH)


__all__ = [
    "CompositeDrafter", "CrossTokenizerDrafter", "DRAFTERS", "HEAD_DRAFT", "is_head_spec", "load_head",
    "Drafter", "DraftModelDrafter", "PromptLookupDrafter",
    "DEFAULT_DRAFTER", "Proposal", "SuffixIndexDrafter", "check_same_vocabulary", "composite_lookup", "drafter_for",
    "draft_candidates", "draft_model_drafter", "load_draft_model", "make_drafter", "quantize_draft", "same_vocabulary",
]
