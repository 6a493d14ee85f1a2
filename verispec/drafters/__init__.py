"""Ways of proposing draft tokens. Each file is one proposer; `make_drafter` builds any of them."""

from __future__ import annotations

from pathlib import Path

import torch

from verispec.drafters.base import Drafter, Proposal
from verispec.drafters.composite import CompositeDrafter
from verispec.drafters.cross_tokenizer import CrossTokenizerDrafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.drafters.suffix_index import SuffixIndexDrafter
from verispec.models import w4a8
from verispec.models.config import ModelConfig
from verispec.models.linear import FORMATS, FormatChoice, measure_formats, w4a8_choice, w8a8_available
from verispec.models.loading import LoadedModel, build_kernel, load_model
from verispec.models.machine import remembered_choice

COMPOSITE_MIN_MATCH = 3  # a shorter recurring context is weak evidence: let the draft model guess instead
DRAFTERS = ("draft-model", "prompt-lookup", "suffix-index", "cross-tokenizer", "composite", "none")

QUANTIZATIONS = ("auto", *FORMATS)
DRAFT_W8A8_UNAVAILABLE = (
    "--draft-quantize w8a8: oneDNN's int8 kernels do not run here, or their sums are not exact (no VNNI or AMX); "
    "use int4, w4a8 or none"
)


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft model's token ids must mean the same text as the target's."""
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
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
) -> DraftModelDrafter:
    """Load a same-tokenizer draft model, made cheaper by quantization.

    quantize: "auto" = in bfloat16, int4, w4a8 or w8a8, whichever measures faster for one row on this CPU
    (the draft's cost, not its accuracy, decides the speedup on CPUs), else none; or one of FORMATS.
    The output is the target's either way.
    """
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"draft quantization {quantize!r} is not one of {', '.join(QUANTIZATIONS)}")
    draft = load_model(spec, dtype, progress)
    check_same_vocabulary(target, draft)
    quantize_draft(draft, quantize, progress, dtype_asked=dtype != "auto")
    return DraftModelDrafter(draft.model, target.model.vocab_size)


def make_drafter(
    kind: str,
    target: LoadedModel,
    draft: str | None = None,
    dtype: str | torch.dtype = "auto",
    quantize: str = "auto",
    corpus: list[Path] | None = None,
    progress: bool = False,
) -> Drafter | None:
    """Build a drafter by name (see DRAFTERS); "none" means plain decoding.

    draft-model: a same-tokenizer model (`draft`). prompt-lookup / suffix-index: no model
    (suffix-index also indexes `corpus` files or directories). cross-tokenizer: a model with its own
    tokenizer (`draft`). composite: the suffix index first (it beat prompt lookup on code-edit, see
    benchmarks/results/zen5/code-edit), then the draft model (same tokenizer) or the cross-tokenizer model
    when `draft`'s tokenizer differs.
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
    if kind == "draft-model":
        return load_draft_model(draft, target, dtype, quantize, progress)
    model = load_model(draft, dtype, progress)
    same_vocabulary = model.tokenizer.get_vocab() == target.tokenizer.get_vocab()
    if kind == "cross-tokenizer":
        quantize_draft(model, quantize, progress, dtype_asked=dtype != "auto")
        return CrossTokenizerDrafter(model, target)
    quantize_draft(model, quantize, progress, dtype_asked=dtype != "auto")
    if same_vocabulary:
        fallback = DraftModelDrafter(model.model, target.model.vocab_size, lazy_prefill=True)
    else:
        fallback = CrossTokenizerDrafter(model, target)
    return CompositeDrafter([composite_lookup(), fallback])


def composite_lookup() -> SuffixIndexDrafter:
    """The lookup half of a composite drafter (the server gives each request its own, beside its batched model)."""
    return SuffixIndexDrafter(min_match=COMPOSITE_MIN_MATCH)


def draft_candidates(quantize: str, dtype: torch.dtype, dtype_asked: bool = True) -> tuple[str, ...]:
    """The formats `quantize` times for a draft in `dtype`; empty where nothing is timed.

    "auto" times int4, w8a8 (both activation kinds, where oneDNN's sums are exact) and w4a8 (where its kernel
    runs) in bfloat16, or in a float32 that `--dtype auto` chose (a CPU without bfloat16 dot products: int4,
    which needs bfloat16, then fails to run and drops out); "w8a8" times its two activation kinds.
    """
    if quantize == "w8a8" or (quantize == "auto" and (dtype == torch.bfloat16 or not dtype_asked)):
        candidates = ("w8a8-s8", "w8a8-u8") if w8a8_available() else ()
        if quantize == "auto":
            candidates = ("int4",) + candidates + (("w4a8",) if w4a8.unavailable_reason() is None else ())
        return candidates
    return ()


def choose_draft_format(
    quantize: str, config: ModelConfig, dtype: torch.dtype, dtype_asked: bool = True
) -> FormatChoice:
    """Resolve `--draft-quantize` for a draft of this shape: "auto" picks the fastest of draft_candidates for
    one row (drafting), timed on the draft's own MLP shape once per machine (remembered_choice), else dense."""
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"draft quantization {quantize!r} is not one of {', '.join(QUANTIZATIONS)}")
    candidates = draft_candidates(quantize, dtype, dtype_asked)
    if quantize == "w8a8" and not candidates:
        raise ValueError(DRAFT_W8A8_UNAVAILABLE)
    activations, seconds = "s8", None
    if candidates:

        def measure() -> dict:
            timed = measure_formats(  # four copies: from memory, as the draft's whole forward reads them
                candidates, dtype, config.hidden_size, 2 * config.intermediate_size, rows=(1,), copies=4
            )
            return {"best": min(timed, key=timed.get) if timed else None, "seconds": timed}

        shape = f"4x{config.hidden_size}x{2 * config.intermediate_size}"
        dtype_name = str(dtype).removeprefix("torch.")
        shape += "" if dtype_name == "bfloat16" else f" {dtype_name}"
        kind = f"draft {quantize} {shape} among {','.join(candidates)}"
        kept = remembered_choice(kind, measure)
        if kept["best"] is None:
            raise ValueError(DRAFT_W8A8_UNAVAILABLE)
        quantize, _, activations = kept["best"].partition("-")
        seconds = kept["seconds"]
    elif quantize == "auto":
        quantize = "none"
    if quantize == "w4a8":  # the activation kind of its prefill passes (oneDNN), as for a target
        activations = w4a8_choice(dtype).activations
    return FormatChoice(quantize, activations or "s8", seconds)


def quantize_draft(
    draft: LoadedModel, quantize: str, progress: bool = False, dtype_asked: bool = True
) -> FormatChoice:
    """Put a dense draft in the format `quantize` resolves to (choose_draft_format) and return that choice."""
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"draft quantization {quantize!r} is not one of {', '.join(QUANTIZATIONS)}")
    build_kernel(quantize, progress)  # w4a8 is a candidate for drafts: its quality costs nothing
    choice = choose_draft_format(quantize, draft.model.config, draft.model.dtype, dtype_asked)
    if choice.weight_format != "none":
        draft.model.quantize(choice.weight_format, choice.activations)
    draft.model.invariant_attention = False  # a draft needs speed, not batch invariance
    return choice


__all__ = [
    "CompositeDrafter", "CrossTokenizerDrafter", "DRAFTERS", "Drafter", "DraftModelDrafter", "PromptLookupDrafter",
    "Proposal", "SuffixIndexDrafter", "check_same_vocabulary", "choose_draft_format", "composite_lookup",
    "draft_candidates", "load_draft_model", "make_drafter", "quantize_draft",
]
