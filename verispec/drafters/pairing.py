"""Which drafter runs when a command is not told everything: a target without a draft, a draft of another tokenizer.

A catalog target comes with the catalog's draft model (DEFAULT_DRAFT: the same tokenizer, a third of the size), or
with its draft head where `make head` built one on this machine (`default_draft`: cheaper and accepted more often
behind the suffix index, in every committed run so far).
Any other target (a hub id, a directory, a GGUF file) has no draft model known to pair with it, so the best drafter
that needs none runs. A draft model whose tokenizer differs from the target's drafts through the cross-tokenizer
drafter. Nothing here prints: the notes are returned for the command line to show.
"""

from __future__ import annotations

from dataclasses import dataclass

from verispec.drafters import DEFAULT_DRAFTER, HEAD_DRAFT, CrossTokenizerDrafter, Drafter, drafter_for
from verispec.drafters.draft_head import head_path
from verispec.models.catalog import CATALOG, DEFAULT_DRAFT

# The drafters that need no draft model, best first: the suffix index beat prompt lookup in the committed
# benchmarks (benchmarks/results/zen5/TABLE.md, code-edit).
MODEL_FREE_DRAFTERS = ("suffix-index", "prompt-lookup")


@dataclass(frozen=True)
class Pairing:
    """The drafter a command runs and its draft model, and why, where it chose for the user."""

    drafter: str  # one of DRAFTERS
    draft: str | None  # the draft model; None: none
    note: str | None = None  # a line for the user where the command chose what they did not say; else None


def default_draft(target: str) -> str | None:
    """A catalog target's draft when none is named: its draft head where one is built here (`make head`) or shipped,
    else the catalog's draft model; any other target's: none."""
    if str(target) not in CATALOG:
        return None
    return HEAD_DRAFT if head_path(str(target)).is_file() else DEFAULT_DRAFT


def draft_or_default(target: str, draft: str | None) -> str:
    """The draft a command that always drafts with a model uses (bench, doctor): `draft` where named, else the
    target's default_draft, else the catalog's draft model (a target outside the catalog has none of its own)."""
    return draft or default_draft(target) or DEFAULT_DRAFT


def pair_drafter(target: str, draft: str | None, drafter: str | None) -> Pairing:
    """What runs with `target`, given `draft` (None: no --draft given) and `drafter` (None: none named).

    A catalog target's missing draft is the catalog's; any other target's is none, and with no drafter named
    either, the best model-free drafter runs, with a note. Otherwise as drafter_for: `--draft none` is plain
    decoding unless a model-free drafter is named.
    """
    note = None
    if draft is None and str(target) in CATALOG:
        draft = default_draft(target)
        if draft == HEAD_DRAFT:
            note = (f"drafting with the draft head for {target} ({head_path(str(target))}); "
                    f"--draft {DEFAULT_DRAFT} drafts with the draft model instead")
    if draft is None and drafter is None:
        best = MODEL_FREE_DRAFTERS[0]
        note = (
            f"no draft model is known to pair with {target}: drafting with {best} (drafters without a draft model: "
            f"{', '.join(MODEL_FREE_DRAFTERS)}); --draft MODEL drafts with a model, --draft none decodes plainly"
        )
        return Pairing(best, None, note)
    no_model = draft is None or draft.lower() == "none"
    return Pairing(drafter_for(drafter, draft), None if no_model else draft, note)


def drafts_across_tokenizers(drafter: Drafter | None) -> bool:
    """Whether `drafter` (or a part of a composite one) re-encodes a draft model's text in the target's tokens."""
    parts = getattr(drafter, "drafters", [drafter])
    return any(isinstance(part, CrossTokenizerDrafter) for part in parts)


def cross_tokenizer_note(draft: str, target: str, drafter: str = DEFAULT_DRAFTER) -> str:
    """The line that says a draft model of another tokenizer drafts through the cross-tokenizer drafter."""
    first = "the suffix index drafts first, then " if drafter == "composite" else ""
    return (
        f"draft {draft} has a tokenizer of its own, not target {target}'s: {first}it drafts through the "
        "cross-tokenizer drafter (its text re-encoded in the target's tokens)"
    )
