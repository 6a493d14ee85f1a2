"""The target's `auto` format: whole forwards estimated from a probe of the model, remembered, and checked at load."""

from __future__ import annotations

import json
import time

import pytest
import torch

from conftest import build_tiny_model
from verispec import GenerationConfig, SpeculativeEngine
from verispec.models import format_chooser, target_format
from verispec.models.config import ModelConfig
from verispec.models.linear import auto_candidates
from verispec.models.loading import load_model, resolve_target_format
from verispec.models.machine import FORMAT_CHOICES_FILE, cache_root, remembered_choices
from verispec.models.transformer import Transformer
from verispec.serving.scheduler import Scheduler, SchedulerLimits

SLOW = 0.03  # seconds a dense target forward sleeps on top of its real cost
PROMPT = "def add(a, b):"


@pytest.fixture
def slow_dense(monkeypatch):
    """Dense targets' forwards (the probe's among them) become SLOW seconds slower: a format that a remembered
    choice may name wrongly."""
    forward = Transformer.forward

    def slowed(self, *args, **kwargs):
        if self.weight_format == "none":
            time.sleep(SLOW)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", slowed)


def target_choices() -> dict[str, dict]:
    return {kind: choice for kind, choice in remembered_choices().items() if kind.startswith("target auto")}


def plant(fmt: str) -> None:
    """Rewrite the one remembered target choice to name `fmt` (its estimates stay as measured)."""
    path = cache_root() / FORMAT_CHOICES_FILE
    table = json.loads(path.read_text())
    (key,) = [key for key in table if key.startswith("target auto")]
    table[key]["format"] = fmt
    path.write_text(json.dumps(table))


def test_auto_times_whole_forwards_of_every_format_and_remembers_the_fastest(own_cache, tiny_dir, monkeypatch):
    target = load_model(tiny_dir, "bfloat16", quantize="auto")
    (kind, kept), = target_choices().items()
    assert "| weights " in kind and "| kernels " in kind and "whole forwards" in kind
    assert set(kept["screen"]) == set(auto_candidates())  # every candidate that runs here is screened ...
    assert set(kept["seconds"]) == set(kept["one_row"]) and kept["seconds"]  # ... and the rest timed whole
    assert set(kept["seconds"]) | set(kept["too_slow"]) == set(auto_candidates())
    assert kept["format"] == min(kept["seconds"], key=kept["seconds"].get) and kept["calibration"] > 0
    assert target.model.weight_format == kept["format"].partition("-")[0]
    assert {c: target.format.choice.seconds[c] for c in kept["seconds"]} == kept["seconds"]
    monkeypatch.setattr(format_chooser, "measure", lambda *a, **k: pytest.fail("timed again"))
    again = load_model(tiny_dir, "bfloat16", quantize="auto")  # remembered (and its check at load holds)
    assert again.format.choice == target.format.choice and target_choices() == {kind: kept}
    assert resolve_target_format(tiny_dir, "bfloat16") == target.format.choice  # what doctor reports


def test_a_wrong_remembered_target_format_is_timed_again_at_load(own_cache, tiny_dir, slow_dense):
    load_model(tiny_dir, "bfloat16", quantize="auto")
    [measured] = target_choices().values()
    assert measured["format"] != "none"  # dense is SLOW seconds slower than every other format here
    plant("none")  # a wrong choice; its estimates (dense's slow cost among them) still true
    target = load_model(tiny_dir, "bfloat16", quantize="auto")
    assert target.model.weight_format != "none" and target.format.choice.weight_format != "none"
    [corrected] = target_choices().values()
    assert corrected["format"] != "none" and corrected["seconds"] != measured["seconds"]  # timed again


def test_a_remembered_target_choice_that_still_holds_is_kept(own_cache, tiny_dir, slow_dense):
    load_model(tiny_dir, "bfloat16", quantize="auto")
    [measured] = target_choices().values()
    load_model(tiny_dir, "bfloat16", quantize="auto")
    assert list(target_choices().values()) == [measured]  # the check at load found nothing faster


def test_exact_arithmetic_keeps_dense_and_times_nothing(own_cache, tiny_dir):
    assert load_model(tiny_dir, "float32", quantize="auto").model.weight_format == "none"  # float32 asked: exact
    assert target_choices() == {}


def test_the_probe_holds_a_quarter_of_the_layers_and_the_estimate_scales_them(tmp_path):
    directory = build_tiny_model(tmp_path / "deep", seed=3, layers=8)
    config = ModelConfig.from_dir(directory)
    assert target_format.probe_layers(8) == 2 and target_format.probe_layers(2) == 2
    assert target_format.probe_layers(28) == 7 and target_format.probe_layers(1) == 1
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.1.mlp.up_proj.weight",
             "model.layers.2.mlp.up_proj.weight", "model.layers.10.mlp.up_proj.weight"]
    assert target_format.probe_tensor_names(names, config) == names[:4]
    from safetensors.torch import load_file

    dense = {name: tensor for name, tensor in load_file(directory / "model.safetensors").items()
             if name in target_format.probe_tensor_names(list(load_file(directory / "model.safetensors")), config)}
    subject = target_format.probe_subject(config, lambda: dense, torch.bfloat16)
    assert {name: len(model.layers) for name, model in subject.build("none").items()} == {"probe": 2, "head": 0}
    rows = target_format.PROBE_ROWS  # a probe of 2 layers: 10 + n ms, its head alone: 4 + n ms
    costs = {"probe": {n: (10 + n) / 1000 for n in rows}, "head": {n: (4 + n) / 1000 for n in rows}}
    # head + 8 / 2 * (probe - head) = (4 + n) + 4 * 6 ms
    assert subject.estimate(costs) == pytest.approx({n: (28 + n) / 1000 for n in rows})


def test_a_server_replaces_a_target_format_found_slow_while_serving_when_it_is_idle(own_cache, tiny_dir, slow_dense):
    """A dense target whose check holds estimates that made dense look fastest (as a choice made under other
    conditions would): only the plain forwards a server times show it is not. The request in flight finishes on
    the weights it started with; the target is loaded again, in the format timed anew, once no request is left."""
    dense = load_model(tiny_dir, "bfloat16")  # quantize="none": no check of its own
    others = {name: 1e-7 for name in auto_candidates() if name != "none"}
    kept = {"format": "none", "seconds": {"none": 1e-8, **others}, "one_row": {"none": 1e-8, **others}}
    dense.model.target_format_check = target_format.ServingCheck(kept, tiny_dir, torch.bfloat16)
    plain = SpeculativeEngine(dense).generate(PROMPT, GenerationConfig(max_new_tokens=40, k=0)).token_ids
    scheduler = Scheduler(dense, None, "none", k=0, limits=SchedulerLimits(2, 8, 256, 1 << 20))
    first = scheduler.submit(dense.encode(PROMPT), GenerationConfig(max_new_tokens=40))
    while scheduler.run_once():
        pass
    assert [t for event in first.iter_events() for t in event.token_ids] == plain  # on the weights it began with
    assert dense.model.weight_format == "none" and dense.model.target_format_check.stale
    assert target_choices() == {}  # the wrong choice is forgotten at once ...
    scheduler.run_once()  # ... and, idle, the target is loaded again in the format timed now
    assert scheduler.target_format_replacements == 1 and dense.model.weight_format != "none"
    [retimed] = target_choices().values()
    assert retimed["format"] != "none" and dense.format.choice.weight_format == dense.model.weight_format
    second = scheduler.submit(dense.encode(PROMPT), GenerationConfig(max_new_tokens=8))
    while scheduler.run_once():
        pass
    assert [e.finish_reason for e in second.iter_events()][-1] == "length"


def test_the_check_compares_with_the_best_other_estimate_by_the_margin_after_calibration():
    kept = {"format": "w4a8", "one_row": {"w4a8": 0.010, "w8a8-u8": 0.020, "none": 0.040}}
    assert not target_format.slower_than_another(kept, 0.029)  # 1.45x the best other's estimate
    assert target_format.slower_than_another(kept, 0.031)
    assert not target_format.slower_than_another(kept | {"calibration": 2.0}, 0.059)  # estimates ran 2x low here
    assert target_format.slower_than_another(kept | {"calibration": 2.0}, 0.061)
    assert not target_format.slower_than_another({"format": "none", "one_row": {"none": 0.01}}, 1.0)  # nothing else


def test_a_choice_made_on_screens_alone_calibrates_as_one(own_cache, tiny_dir):
    """Where the budget ended before any whole forward was timed, the pick has no estimate to calibrate against."""
    kept = {"format": "w4a8", "seconds": {}, "one_row": {}, "screen": {"w4a8": 1e-4, "none": 3e-4}}
    calibrated = target_format.calibrate(kept, 0.01, tiny_dir, torch.bfloat16)
    assert calibrated["calibration"] == 1.0 and not target_format.slower_than_another(calibrated, 1.0)
