"""A draft model's weight format: chosen within a budget from whole timed forwards, and checked against what
drafting costs.

On a CPU the draft's cost per forward, not its accuracy, decides what speculation gains (any draft
distribution is verified exactly), and one linear timed alone misjudges a whole forward: it misses the
attention, the norms, the output head and the rest of the forward's memory traffic, and can rank two formats
the wrong way round. So `auto` screens every candidate with a linear (dropping the hopeless, such as a reference path),
quantizes copies of the loaded draft into the survivors' formats and times one-row forwards of them side by side
within the draft's budget (format_chooser), once per machine, torch version, kernel build and weights
(remembered_choice). A remembered choice is checked against forwards timed later, at load and while drafting
(FormatCheck): when the format in force costs MARGIN times another candidate's remembered cost, the choice is
measured again and the draft is replaced.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.models import format_chooser, w4a8
from verispec.models.forward_cost import forward_costs
from verispec.models.linear import FORMATS, FormatChoice, candidate_choice, w8a8_available
from verispec.models.loading import LoadedModel, build_kernel, load_model
from verispec.models.machine import forget_choice, remembered_choice, weights_identity
from verispec.models.transformer import Transformer

QUANTIZATIONS = ("auto", *FORMATS)
DRAFT_W8A8_UNAVAILABLE = (
    "--draft-quantize w8a8: oneDNN's int8 kernels do not run here, or their sums are not exact (no VNNI or AMX); "
    "use int4, w4a8 or none"
)
CHECK_ROUNDS = 5  # one-row forwards timed at load to check a remembered choice (after 2 warm-up ones)


def draft_candidates(quantize: str, dtype: torch.dtype, dtype_asked: bool = True) -> tuple[str, ...]:
    """The quantized formats `quantize` times for a draft in `dtype` (auto times dense beside them); empty where
    nothing is timed.

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


@dataclass
class FormatCheck(format_chooser.CostCheck):
    """The remembered draft format in force (a CostCheck over its one-row forwards) and what replacing it takes;
    quantize_draft sets one on the draft's Transformer as `format_check`, and the scheduler feeds it the one-row
    draft forwards it times (a True from observe: `replace_format`)."""

    kind: str = ""  # the remembered choice's kind
    directory: Path | None = None  # the draft's weights, to load it dense again
    quantize: str = "auto"
    candidates: tuple[str, ...] = ()
    replaced_by: Transformer | None = None  # the draft in the format timed again (replace_format)


def quantize_draft(
    draft: LoadedModel, quantize: str = "auto", progress: bool = False, dtype_asked: bool = True
) -> FormatChoice:
    """Put a dense draft in the format `quantize` resolves to and return that choice.

    auto: the fastest of draft_candidates and dense by whole one-row forwards (remembered per machine and
    weights; a remembered choice that a check at load finds MARGIN slower than another candidate is timed
    again); "w8a8" times its two activation kinds; any other format is taken as asked. `draft.model` may be
    replaced (by the timed copy in the chosen format).
    """
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"draft quantization {quantize!r} is not one of {', '.join(QUANTIZATIONS)}")
    build_kernel(quantize, progress)  # w4a8 is a candidate for drafts: its quality costs nothing
    draft.model.invariant_attention = False  # a draft needs speed, not batch invariance (and is timed so)
    dtype = draft.model.dtype
    candidates = draft_candidates(quantize, dtype, dtype_asked)
    if quantize == "w8a8" and not candidates:
        raise ValueError(DRAFT_W8A8_UNAVAILABLE)
    if candidates:
        choice = _timed_choice(draft, quantize, candidates, check=True, progress=progress)
    else:
        choice = candidate_choice("none" if quantize == "auto" else quantize, dtype)
        if choice.weight_format != "none":
            draft.model.quantize(choice.weight_format, choice.activations)
    draft.model.invariant_attention = False  # (a timed copy may have replaced the model)
    return choice


def replace_format(model: Transformer) -> Transformer:
    """The draft of `model` (whose format_check found a faster candidate) in a format timed again now: the
    remembered choice is forgotten, the dense weights loaded again and every candidate timed. Holders of
    `model` find the new one with current_draft."""
    check: FormatCheck = model.format_check
    forget_choice(check.kind)
    dense = load_model(check.directory, model.dtype)
    if model.output_token_ids is not None:  # a head over fewer tokens (draft_vocab) stays so
        dense.model.restrict_output_vocab(model.output_token_ids)
    dense.model.invariant_attention = False
    _timed_choice(dense, check.quantize, check.candidates, check=False)
    check.replaced_by = dense.model
    return dense.model


def current_draft(model: Transformer) -> Transformer:
    """`model`, or the draft that replace_format put in its place (and so on)."""
    while (check := getattr(model, "format_check", None)) is not None and check.replaced_by is not None:
        model = check.replaced_by
    return model


def _timed_choice(draft: LoadedModel, quantize: str, candidates: tuple[str, ...], check: bool,
                  progress: bool = False) -> FormatChoice:
    """The fastest candidate by whole one-row forwards within the draft's budget (format_chooser), remembered;
    `draft` is put in it."""
    everything = candidates + (("none",) if quantize == "auto" else ())
    dtype_name = str(draft.model.dtype).removeprefix("torch.")
    kind = (f"draft {quantize} {dtype_name} among {','.join(everything)} | weights {weights_identity(draft.directory)}"
            f" | kernels {w4a8.build_digest()} | screened, whole forwards within"
            f" {format_chooser.BUDGETS['draft']:.0f} s")
    built: dict[str, Transformer] = {}

    def measure() -> dict:
        on_progress, close = format_chooser.progress_line(progress, f"choosing {draft.name}'s format")
        try:
            return format_chooser.measure(_draft_subject(draft.model, built), everything,
                                          format_chooser.BUDGETS["draft"], on_progress=on_progress)
        finally:
            close()

    kept = remembered_choice(kind, measure)
    if kept["format"] is None:
        raise ValueError(DRAFT_W8A8_UNAVAILABLE)
    choice = candidate_choice(kept["format"], draft.model.dtype, kept["one_row"])
    timed_now = bool(built)
    if kept["format"] in built:
        draft.model = built[kept["format"]]
    elif choice.weight_format != "none":
        draft.model.quantize(choice.weight_format, choice.activations)
    built.clear()  # the other copies go
    draft.model.format_check = FormatCheck(kept["format"], kept["one_row"], kind=kind, directory=draft.directory,
                                           quantize=quantize, candidates=candidates)
    if check and not timed_now:  # remembered: does it still hold?
        seconds = forward_costs({"chosen": draft.model}, rows=(1,), rounds=CHECK_ROUNDS)["chosen"][1]
        if draft.model.format_check.faster_candidate(seconds) is not None:
            forget_choice(kind)
            draft.model = load_model(draft.directory, draft.model.dtype).model
            draft.model.invariant_attention = False
            return _timed_choice(draft, quantize, candidates, check=False, progress=progress)
    return choice


DRAFT_CONTEXT = 128  # tokens of prompt before the draft's timed forwards
DRAFT_ROUNDS = 7


def _draft_subject(dense: Transformer, built: dict[str, Transformer]) -> format_chooser.Subject:
    """What choosing a draft's format times: one-row forwards of the whole draft in each candidate format (a copy
    of the dense model quantized, kept in `built`; "none" is the dense model itself), screened by a linear of its
    MLP shape."""

    def build(candidate: str) -> dict[str, Transformer] | None:
        copies = _copies_in_formats(dense, (candidate,))
        built.update(copies)
        return {"draft": copies[candidate]} if candidate in copies else None

    def screen(candidate: str):
        return format_chooser.linear_screen(candidate, dense.dtype, dense.config.hidden_size,
                                            dense.config.intermediate_size)

    return format_chooser.Subject(screen, build, rows=(1,), context=DRAFT_CONTEXT, rounds=DRAFT_ROUNDS, warmup=2)


def _copies_in_formats(dense: Transformer, candidates: tuple[str, ...]) -> dict[str, Transformer]:
    """candidate -> the dense model (for "none") or a copy of it in that format; formats that cannot run here
    (int4 in float32, a kernel this CPU lacks) are left out."""
    models = {}
    for candidate in candidates:
        if candidate == "none":
            models[candidate] = dense
            continue
        choice = candidate_choice(candidate, dense.dtype)
        model = copy.deepcopy(dense)
        try:
            model.quantize(choice.weight_format, choice.activations)
            model.forward(torch.zeros(1, 1, dtype=torch.long), model.new_cache(1, 2))  # runs here?
        except (ValueError, RuntimeError, NotImplementedError):
            continue
        models[candidate] = model
    return models
