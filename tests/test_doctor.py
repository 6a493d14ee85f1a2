"""`verispec doctor`: whole-forward timing, the speedup model, the remembered choices, and the command itself."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from verispec.cli import main
from verispec.doctor import (
    PLAIN_IS_BETTER, diagnose, expected_speedup, remembered_on_this_machine, speculative_speedup,
    timing_warnings,
)
from verispec.models.forward_cost import forward_costs
from verispec.models.kv_cache import KVCache
from verispec.models.loading import load_model
from verispec.models.machine import FORMAT_CHOICES_FILE, cpu_model, remembered_choice


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and far faster than on two when another job shares the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


class RecordingModel:
    """Runs no model: logs (name, new tokens, committed tokens) per forward; its first two one-token forwards
    are slow, as warm-up forwards are."""

    vocab_size = 50

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        return KVCache(1, batch_size, 1, capacity, 2, torch.float32)

    def forward(self, input_ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        assert int(input_ids.max()) < self.vocab_size
        cache.plan_write(input_ids.shape[1])  # raises where the cache has no room for them
        self.log.append((self.name, input_ids.shape[1], int(cache.lengths[0])))
        if input_ids.shape[1] == 1 and self.log.count((self.name, 1, int(cache.lengths[0]))) <= 2:
            time.sleep(0.05)
        return torch.zeros(1, input_ids.shape[1], self.vocab_size)


def test_forward_costs_interleaves_models_and_row_counts_and_drops_warmup():
    log, rounds_seen = [], []
    models = {"a": RecordingModel("a", log), "b": RecordingModel("b", log)}
    costs = forward_costs(models, rows=(1, 4), context=5, rounds=1, warmup=2,
                          on_round=lambda done, total: rounds_seen.append((done, total)))
    assert log[:2] == [("a", 5, 0), ("b", 5, 0)]  # each prompt into its own cache
    one_round = [("a", 1, 5), ("b", 1, 5), ("a", 4, 5), ("b", 4, 5)]  # nothing committed after the prompt
    assert log[2:] == one_round * 3
    assert rounds_seen == [(1, 3), (2, 3), (3, 3)]
    assert set(costs) == {"a", "b"} and all(set(by_rows) == {1, 4} for by_rows in costs.values())
    assert costs["a"][1] < 0.05 and costs["b"][1] < 0.05  # the slow warm-up forwards are not in the median


def test_forward_costs_times_real_forwards(tiny_dir, other_tiny_dir):
    target, draft = load_model(tiny_dir, "float32"), load_model(other_tiny_dir, "float32")
    costs = forward_costs({"target": target, "draft": draft.model}, rows=(1, 4, 8), context=16, rounds=2)
    assert set(costs) == {"target", "draft"}
    assert all(set(by_rows) == {1, 4, 8} and min(by_rows.values()) > 0 for by_rows in costs.values())
    with pytest.raises(ValueError):
        forward_costs({"target": target}, rows=(), rounds=2)


TARGET = {1: 1.0, 2: 1.1, 4: 1.3, 8: 2.1}  # seconds of a target forward by new tokens


def test_speedup_model_on_hand_computed_costs():
    # alpha 0.9, k = 2: E = 1 + 0.9 + 0.81 = 2.71 tokens for a 3-row forward (1.2, between 1.1 and 1.3) + 2 drafts
    assert speculative_speedup(0.9, 2, TARGET, 0.2) == pytest.approx(2.71 * 1.0 / (1.2 + 0.4))
    expected = expected_speedup(TARGET, 0.2)
    by_alpha = {row["acceptance"]: row for row in expected["by_acceptance"]}
    # k = 1: 1.9 / 1.3 = 1.46; k = 2: 2.71 / 1.6 = 1.69; k = 3: 3.439 / 1.9 = 1.81; k = 4: 4.0951 / 2.3 = 1.78
    assert by_alpha[0.9]["best_k"] == 3 and by_alpha[0.9]["speedup"] == pytest.approx(3.439 / 1.9)
    # k = 1: 1.7 / 1.3 = 1.31; k = 2: 2.19 / 1.6 = 1.37; k = 3: 2.533 / 1.9 = 1.33
    assert by_alpha[0.7]["best_k"] == 2 and by_alpha[0.7]["speedup"] == pytest.approx(2.19 / 1.6)
    assert by_alpha[0.5]["best_k"] == 1 and by_alpha[0.5]["speedup"] == pytest.approx(1.5 / 1.3)
    assert expected["pays"] and expected["range"] == pytest.approx([1.5 / 1.3, 3.439 / 1.9])
    assert "expected to pay" in expected["verdict"]


def test_speculation_does_not_pay_with_a_draft_as_slow_as_the_target():
    flat = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
    expected = expected_speedup(flat, 1.0)
    best = {row["acceptance"]: row for row in expected["by_acceptance"]}[0.9]
    assert best["best_k"] == 1 and best["speedup"] == pytest.approx(1.9 / 2.0)  # 1.9 tokens for two forwards
    assert not expected["pays"] and PLAIN_IS_BETTER in expected["verdict"]
    # A draft at 0.45 of the target: 1.5 / 1.45 = 1.03 at acceptance 0.5 (below the margin), 1.17 at 0.7.
    mixed = expected_speedup(flat, 0.45)
    assert [row["pays"] for row in mixed["by_acceptance"]] == [False, True, True]
    assert "at least 0.7" in mixed["verdict"]


def test_timings_that_fall_with_more_tokens_are_flagged():
    quiet = {"target w4a8": {1: 0.05, 2: 0.06, 4: 0.1, 8: 0.18}, "draft none": {1: 0.15, 2: 0.15, 4: 0.14, 8: 0.16}}
    assert timing_warnings(quiet) == []  # 0.14 after 0.15: within noise
    disturbed = quiet | {"target none": {1: 0.69, 2: 2.26, 4: 1.28, 8: 1.24}}
    (warning,) = timing_warnings(disturbed)
    assert warning.startswith("target none: 4 tokens timed faster than 2 (1280.0 vs 2260.0 ms)")


def test_remembered_choices_of_this_machine_only(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    here = f" | {cpu_model()} | {os.cpu_count()} cores | torch {torch.__version__}"
    (tmp_path / FORMAT_CHOICES_FILE).write_text(json.dumps({
        "target auto bfloat16 among w4a8,none" + here: {"format": "w4a8", "activations": "kernel",
                                                       "seconds": {"w4a8": 0.008, "none": 0.06}},
        "draft auto 4x896x9728 among int4,w4a8" + here: {"best": "int4", "seconds": {"int4": 0.001}},
        "draft auto 4x896x9728 among int4,w4a8 | Other CPU (1/2) | 64 cores | torch 0.1": {"best": "w4a8"},
        "step costs | target t w4a8 | draft none" + here: {"verify": {"1": 0.04, "8": 0.06}, "draft": None},
    }))
    kept = {row["kind"]: row for row in remembered_on_this_machine()}
    assert set(kept) == {"target auto bfloat16 among w4a8,none", "draft auto 4x896x9728 among int4,w4a8",
                         "step costs | target t w4a8 | draft none"}
    steps = kept["step costs | target t w4a8 | draft none"]  # timings, not a choice among formats
    assert steps["choice"] == "timed, no choice" and steps["seconds"] == {"verify 1": 0.04, "verify 8": 0.06}
    assert kept["target auto bfloat16 among w4a8,none"]["choice"] == "w4a8-kernel"
    assert kept["draft auto 4x896x9728 among int4,w4a8"] == {
        "kind": "draft auto 4x896x9728 among int4,w4a8", "choice": "int4", "seconds": {"int4": 0.001},
        "in_force": False,  # nothing in this process loaded by it
    }
    remembered_choice("draft auto 4x896x9728 among int4,w4a8", lambda: pytest.fail("it was remembered"))
    assert {row["kind"]: row["in_force"] for row in remembered_on_this_machine()} == {
        "target auto bfloat16 among w4a8,none": False, "draft auto 4x896x9728 among int4,w4a8": True,
        "step costs | target t w4a8 | draft none": False,
    }


def test_diagnose_times_the_chosen_formats_and_reports_progress(tiny_dir, other_tiny_dir):
    steps = []
    report = diagnose(str(tiny_dir), str(other_tiny_dir), formats=["none"], rounds=1, context=8,
                      progress=lambda what, done, total: steps.append((what, done, total)))
    chosen = report["expectation"]
    assert set(report["costs"]["target"]) == {chosen["target_format"], "none"}
    assert set(report["costs"]["draft"]) == {chosen["draft_format"], "none"}
    assert steps[-1][1] == steps[-1][2]  # every counted step was done
    assert any(row["in_force"] for row in report["choices"]["remembered"])  # what auto loaded by
    assert any(what.startswith("loading") for what, _, _ in steps)
    with pytest.raises(ValueError, match="bogus"):
        diagnose(str(tiny_dir), str(other_tiny_dir), formats=["bogus"])


def test_doctor_command_json(capsys, tiny_dir, other_tiny_dir):
    assert main(["doctor", "--target", str(tiny_dir), "--draft", str(other_tiny_dir), "--json", "--rounds", "2",
                 "--context", "16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"machine", "formats", "choices", "costs", "expectation"}
    assert {"cpu", "cpu_family_model", "kind", "cores", "torch", "isa", "verispec_commit"} <= set(report["machine"])
    assert set(report["machine"]["isa"]) == {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx"}
    assert set(report["formats"]) == {"none", "w4a8", "w8a8", "int8", "int4"} and report["formats"]["none"]["runs"]
    expectation = report["expectation"]
    assert expectation["target_format"] in report["costs"]["target"]
    assert expectation["draft_format"] in report["costs"]["draft"]
    assert isinstance(report["costs"]["warnings"], list)
    for group in ("target", "draft", "target_beside_drafts"):
        for by_rows in report["costs"][group].values():
            assert set(by_rows) == {"1", "2", "4", "8"} and min(by_rows.values()) > 0
    assert [row["acceptance"] for row in expectation["by_acceptance"]] == [0.5, 0.7, 0.9]
    assert all(1 <= row["best_k"] <= 8 and row["speedup"] > 0 for row in expectation["by_acceptance"])
    assert expectation["same_vocabulary"] and expectation["verdict"]


def test_doctor_command_tables(capsys, tiny_dir, other_tiny_dir):
    assert main(["doctor", "--target", str(tiny_dir), "--draft", str(other_tiny_dir), "--rounds", "1",
                 "--context", "8"]) == 0
    out = capsys.readouterr().out
    for title in ("this machine", "weight formats", "what `auto` loads here", "whole-forward cost",
                  "expected speedup"):
        assert title in out
    assert "speculation is" in out


def test_doctor_command_names_a_missing_model(capsys, tmp_path):
    assert main(["doctor", "--target", str(tmp_path / "nowhere"), "--draft", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err
