"""The draft's `auto` format: whole one-row forwards timed, remembered, and checked at load and while drafting."""

from __future__ import annotations

import json
import time

import pytest

from verispec import GenerationConfig, SpeculativeEngine
from verispec.drafters import DraftModelDrafter, quantize_draft
from verispec.drafters import draft_format
from verispec.models import format_chooser
from verispec.models.loading import load_model
from verispec.models.machine import FORMAT_CHOICES_FILE, cache_root, remembered_choices
from verispec.models.transformer import Transformer
from verispec.serving.scheduler import Scheduler, SchedulerLimits

SLOW = 0.03  # seconds a "slow" format's forward sleeps on top of its real cost


@pytest.fixture
def slow_dense(monkeypatch):
    """Dense drafts' forwards (not the target's) become SLOW seconds slower: a format that a remembered choice may
    name wrongly."""
    forward = Transformer.forward

    def slowed(self, *args, **kwargs):
        if self.weight_format == "none" and not self.invariant_attention:  # a draft: see quantize_draft
            time.sleep(SLOW)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", slowed)


def draft_choices() -> dict[str, dict]:
    return {kind: choice for kind, choice in remembered_choices().items() if kind.startswith("draft auto")}


def plant(best: str, seconds: dict[str, float] | None = None) -> None:
    """Rewrite the one remembered draft choice: `best` (and its seconds, where given)."""
    path = cache_root() / FORMAT_CHOICES_FILE
    table = json.loads(path.read_text())
    (key,) = [key for key in table if key.startswith("draft auto")]
    table[key]["format"] = best
    if seconds is not None:
        table[key]["seconds"] = seconds
    path.write_text(json.dumps(table))


def test_auto_times_whole_forwards_of_every_format_and_remembers_the_fastest(own_cache, tiny_dir, monkeypatch):
    draft = load_model(tiny_dir, "auto")
    choice = quantize_draft(draft, "auto", dtype_asked=False)
    (kind, kept), = draft_choices().items()
    assert "| weights " in kind and "| kernels " in kind  # keyed by the weights and the kernel build too
    assert "none" in kept["screen"] and len(kept["screen"]) >= 2  # dense against at least one quantized format
    assert set(kept["seconds"]) | set(kept["too_slow"]) == set(kept["screen"]) and kept["seconds"]
    assert kept["format"] == min(kept["seconds"], key=kept["seconds"].get)
    assert choice.label.startswith(kept["format"].partition("-")[0]) and choice.seconds == kept["one_row"]
    assert draft.model.weight_format == choice.weight_format and not draft.model.invariant_attention
    # The check at load finds the choice as fast as remembered (measured, a tiny model's forwards on a busy CI
    # machine once came out MARGIN slower, and it was rightly timed again: the next test covers that case).
    remembered_cost = kept["one_row"][kept["format"]]
    as_remembered = lambda models, **_: {name: {1: remembered_cost} for name in models}  # noqa: E731
    monkeypatch.setattr(draft_format, "forward_costs", as_remembered)
    again = load_model(tiny_dir, "auto")
    assert quantize_draft(again, "auto", dtype_asked=False) == choice  # remembered, not timed again
    assert draft_choices() == {kind: kept}


def test_a_wrong_remembered_format_is_timed_again_at_load(own_cache, tiny_dir, slow_dense):
    quantize_draft(load_model(tiny_dir, "auto"), "auto", dtype_asked=False)
    [measured] = draft_choices().values()
    assert measured["format"] != "none"  # dense is SLOW seconds slower than everything here
    plant("none")  # a wrong choice, its seconds (dense's slow cost among them) still true
    draft = load_model(tiny_dir, "auto")
    choice = quantize_draft(draft, "auto", dtype_asked=False)
    assert choice.weight_format != "none" and draft.model.weight_format == choice.weight_format
    [corrected] = draft_choices().values()
    assert corrected["format"] != "none" and corrected["screen"] != measured["screen"]  # timed again


def test_a_remembered_choice_that_still_holds_is_kept(own_cache, tiny_dir, slow_dense):
    quantize_draft(load_model(tiny_dir, "auto"), "auto", dtype_asked=False)
    [measured] = draft_choices().values()
    quantize_draft(load_model(tiny_dir, "auto"), "auto", dtype_asked=False)
    assert draft_choices() == {next(iter(draft_choices())): measured}  # the check at load found nothing faster


def test_a_slow_format_found_while_drafting_is_replaced_and_output_stays_plain(own_cache, tiny_dir, target, slow_dense):
    """A dense draft whose check holds remembered costs that make dense look fastest (as a choice made under
    other conditions would): only the forwards timed while drafting show it is not."""
    draft = load_model(tiny_dir, "auto")
    quantize_draft(draft, "auto", dtype_asked=False)
    dense = load_model(tiny_dir, "auto")
    check = draft.model.format_check
    dense.model.invariant_attention = False
    dense.model.format_check = draft_format.FormatCheck(
        "none", {**check.one_row, "none": 1e-6}, kind=check.kind, directory=check.directory, quantize=check.quantize,
        candidates=check.candidates)
    drafter = DraftModelDrafter(dense.model, target.model.vocab_size)
    engine = SpeculativeEngine(target, drafter)
    config = GenerationConfig(max_new_tokens=48, k=2)
    prompts = ["def add(a, b):", "for i in range(10):", "class Point:", "The quick brown"]
    plain = [SpeculativeEngine(target).generate(p, GenerationConfig(max_new_tokens=48, k=0)).token_ids for p in prompts]
    assert [engine.generate(p, config).token_ids for p in prompts] == plain  # lossless through the swap
    assert drafter.model is not dense.model and drafter.model.weight_format != "none"  # replaced ...
    # ... (a busy machine may find the new format slow in turn: replace_format chains, current_draft follows, and
    # the engine hands its drafter a replacement made during the last request at the next one)
    assert dense.model.format_check.replaced_by is not None
    assert draft_format.current_draft(drafter.model) is draft_format.current_draft(dense.model)
    [kept] = draft_choices().values()
    assert kept["format"] != "none" and kept["seconds"].get("none", 1.0) > 1e-3  # ... after timing them again


def test_the_server_replaces_a_slow_draft_format_between_steps(own_cache, tiny_dir, target, slow_dense):
    draft = load_model(tiny_dir, "auto")
    quantize_draft(draft, "auto", dtype_asked=False)
    dense = load_model(tiny_dir, "auto")
    check = draft.model.format_check
    dense.model.invariant_attention = False
    dense.model.format_check = draft_format.FormatCheck(
        "none", {**check.one_row, "none": 1e-6}, kind=check.kind, directory=check.directory, quantize=check.quantize,
        candidates=check.candidates)
    scheduler = Scheduler(target, dense.model, "draft-model", k=2, limits=SchedulerLimits(4, 8, 256))
    prompt = "def add(a, b):"
    handle = scheduler.submit(target.encode(prompt), GenerationConfig(max_new_tokens=96))
    scheduler.start()
    try:
        tokens = [t for event in handle.iter_events() for t in event.token_ids]
    finally:
        scheduler.stop()
    assert scheduler.draft_format_replacements == 1 and scheduler.draft.model.weight_format != "none"
    assert tokens == SpeculativeEngine(target).generate(prompt, GenerationConfig(max_new_tokens=96, k=0)).token_ids


def test_explicit_formats_are_taken_as_asked(own_cache, tiny_dir):
    draft = load_model(tiny_dir, "float32")
    assert quantize_draft(draft, "none").weight_format == "none"
    assert draft_choices() == {} and not hasattr(draft.model, "format_check")
    with pytest.raises(ValueError, match="draft quantization 'int3'"):
        quantize_draft(load_model(tiny_dir, "float32"), "int3")


def test_the_check_compares_with_the_best_other_format_by_the_margin():
    check = draft_format.FormatCheck("w4a8", {"w4a8": 0.02, "none": 0.1, "int4": 0.05}, kind="k")
    assert check.faster_candidate(0.05 * format_chooser.MARGIN * 0.99) is None
    assert check.faster_candidate(0.05 * format_chooser.MARGIN * 1.01) == "int4"
    for _ in range(format_chooser.WINDOW - 1):
        assert not check.observe(1.0)  # not before a whole window
    assert check.observe(1.0)
    alone = draft_format.FormatCheck("w4a8", {"w4a8": 0.02}, kind="k")
    assert alone.faster_candidate(10.0) is None  # nothing to compare with

