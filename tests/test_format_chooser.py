"""The format chooser on every machine kind's recorded costs, replayed on a clock that only counts: nothing is timed.

benchmarks/results/<kind>/format-costs*.json holds what the chooser reads on that kind (a screen linear's call, whole
forwards by width, per candidate) and what that kind's benchmarks showed fastest. Each test runs the chooser's real
loop (format_chooser.measure) over models whose forwards advance the clock by those costs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from verispec.models import format_chooser
from verispec.models.format_chooser import BUDGETS, Subject, measure, pick, predicted_seconds, screen_survivors
from verispec.models.target_format import PROBE_ROWS

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
# "zen4", "xeon/format-costs-6-207" (a second CPU model of a kind) -> its file
KINDS = {path.parent.name + path.stem.removeprefix("format-costs").replace("-", "/", 1): path
         for path in sorted(RESULTS.glob("*/format-costs*.json"))}
ROWS = {"target": PROBE_ROWS, "draft": (1,)}


class Clock:
    """Seconds that pass only when a replayed call says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ReplayedCache:
    def commit(self, count: int) -> None:
        pass


class Replayed:
    """A model whose forward of n new tokens advances the clock by its recorded cost at width n (a prefill of the
    chooser's short prompt: twice the widest recorded forward, as a 32-token pass costs on these CPUs)."""

    vocab_size = 100

    def __init__(self, clock: Clock, by_width: dict[int, float]) -> None:
        self.clock, self.by_width = clock, by_width

    def new_cache(self, batch_size: int, capacity: int) -> ReplayedCache:
        return ReplayedCache()

    def forward(self, input_ids: torch.Tensor, cache, last_only: bool = False) -> None:
        n = input_ids.shape[1]
        widest = max(self.by_width)
        self.clock.now += self.by_width[n] if n in self.by_width else 2 * self.by_width[widest]


def replayed(clock: Clock, costs: dict, rows: tuple[int, ...]) -> Subject:
    """The chooser's subject for one model's recorded costs: screens and forwards that cost what they cost there."""

    def screen(candidate: str):
        if candidate not in costs["screen"]:
            return None
        return lambda: setattr(clock, "now", clock.now + costs["screen"][candidate])

    def build(candidate: str):
        return {"whole": Replayed(clock, {int(n): s for n, s in costs["whole"][candidate].items()})}

    return Subject(screen, build, rows=rows, context=32, rounds=5, warmup=1)


def test_every_machine_kind_the_project_met_has_recorded_costs():
    assert {"xeon", "zen1", "zen2", "zen3", "zen4", "zen5"} <= {path.parent.name for path in KINDS.values()}
    for path in KINDS.values():
        recorded = json.loads(path.read_text())
        for role in ("target", "draft"):
            costs = recorded["models"][role]
            assert costs["fastest"] in costs["candidates"] and set(costs["whole"]) <= set(costs["candidates"])
            assert all(set(map(int, by_width)) >= set(ROWS[role]) for by_width in costs["whole"].values())


@pytest.mark.parametrize("role", ["target", "draft"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_chooses_its_fastest_within_the_budget(kind, role):
    costs = json.loads(KINDS[kind].read_text())["models"][role]
    clock = Clock()
    record = measure(replayed(clock, costs, ROWS[role]), costs["candidates"], BUDGETS[role], clock=clock)
    assert record["format"] == costs["fastest"], record
    assert clock.now <= BUDGETS[role] and record["choosing_seconds"] == pytest.approx(clock.now, abs=1e-3)
    assert set(record["seconds"]) | set(record["too_slow"]) == set(costs["screen"])  # each timed or said too slow


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_reference_path_is_screened_out_untimed(kind):
    """A candidate whose one-row forward costs minutes (a reference path: its screen is slow too) is dropped at the
    screen: no forward of it runs."""
    costs = json.loads(KINDS[kind].read_text())["models"]["target"]
    slow = max(costs["candidates"], key=lambda c: c != costs["fastest"])  # any candidate but the fastest
    fastest_screen = costs["screen"][costs["fastest"]]
    costs = costs | {"screen": costs["screen"] | {slow: 200 * fastest_screen},
                     "whole": costs["whole"] | {slow: {str(n): 120.0 for n in PROBE_ROWS}}}
    clock = Clock()
    record = measure(replayed(clock, costs, PROBE_ROWS), costs["candidates"], BUDGETS["target"], clock=clock)
    assert slow in record["too_slow"] and "screen" in record["too_slow"][slow] and slow not in record["seconds"]
    assert clock.now <= BUDGETS["target"] and record["format"] == costs["fastest"]


def test_a_candidate_the_screen_misjudged_is_stopped_after_its_first_forward():
    """The screen says a candidate is the cheapest; its whole forwards cost 2 s (50x the others'): it is timed once,
    found too slow and not waited for again."""
    clock = Clock()
    costs = {"screen": {"fast": 0.002, "misjudged": 0.001},
             "whole": {"fast": {str(n): 0.04 for n in PROBE_ROWS}, "misjudged": {str(n): 2.0 for n in PROBE_ROWS}}}
    record = measure(replayed(clock, costs, PROBE_ROWS), ["fast", "misjudged"], BUDGETS["target"], clock=clock)
    assert record["format"] == "fast" and "misjudged" in record["too_slow"] and "misjudged" not in record["seconds"]
    assert clock.now < 2 * 2.0 + 2.0 + 1.5  # its prefill and one forward, then the fast one's rounds


def test_when_the_budget_runs_out_the_choice_is_made_from_what_was_timed():
    """Three close candidates whose forwards take 1 s each cannot all be timed in 20 s: the chooser stops within
    the budget, and picks among the candidates timed at every width."""
    clock = Clock()
    candidates = ["a", "b", "c"]
    costs = {"screen": {c: 0.001 for c in candidates},
             "whole": {c: {"1": 1.0 + 0.1 * i} for i, c in enumerate(candidates)}}
    record = measure(replayed(clock, costs, (1,)), candidates, 20.0, clock=clock)
    assert clock.now <= 20.0 and record["format"] == "a"
    assert set(record["seconds"]) | set(record["too_slow"]) == set(candidates)


def test_a_slow_format_forced_by_the_environment_is_dropped_at_its_screen(monkeypatch):
    """$VERISPEC_SLOW_FORMAT makes a real candidate's calls take seconds (here two linears of a tiny model's shape):
    the chooser drops it at the screen without building it; past HOPELESS_SCREEN its warm-up call stands for its
    screen and it is not called again. (What is asserted is what ran, not how long it took.)"""
    timed, calls = [], []

    def build(candidate: str):
        timed.append(candidate)
        return None  # nothing to time whole: the screen decides

    def screen(candidate: str):
        call = format_chooser.linear_screen(candidate, torch.bfloat16, 64, 128)
        return lambda: (calls.append(candidate), call())

    monkeypatch.setenv(format_chooser.SLOW_FORMAT_ENV, "w4a8=0.3")
    record = measure(Subject(screen, build), ["none", "w4a8"], BUDGETS["draft"])
    assert "w4a8" in record["too_slow"] and record["screen"]["w4a8"] >= 0.3 and timed == ["none"]
    # A warm-up call and one timed call (it is long: not repeated); on a loaded machine the warm-up alone may pass
    # HOPELESS_SCREEN and stand for the screen.
    assert 1 <= calls.count("w4a8") <= 2
    monkeypatch.setenv(format_chooser.SLOW_FORMAT_ENV, f"w4a8={format_chooser.HOPELESS_SCREEN + 0.1}")
    calls.clear()
    record = measure(Subject(screen, build), ["w4a8"], BUDGETS["draft"])
    assert calls == ["w4a8"] and record["screen"]["w4a8"] > format_chooser.HOPELESS_SCREEN


def test_the_slow_format_hook_says_what_it_wants():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(format_chooser.SLOW_FORMAT_ENV, "w8a8-u8")
        with pytest.raises(ValueError, match="candidate=seconds"):
            format_chooser._slow_format_hook()


def test_the_pick_is_the_least_whole_forward_else_the_least_screen():
    assert pick({"w4a8": 0.2, "none": 0.7}, {"w4a8": 1.0, "none": 0.1}) == "w4a8"  # whole forwards judge
    assert pick({}, {"w4a8": 0.003, "w8a8-s8": 0.3}) == "w4a8"  # nothing timed whole: the screen
    assert pick({}, {}) is None


def test_screen_survivors_are_within_the_drop_cheapest_first():
    screen = {"w4a8": 0.001, "w8a8-u8": 0.0005, "w8a8-s8": 0.3, "none": 0.0039}
    assert screen_survivors(screen) == ["w8a8-u8", "w4a8", "none"]
    assert screen_survivors({}) == []


def test_a_first_forward_is_predicted_from_another_candidates_by_their_screens():
    timed = {"w4a8": {1: [0.03, 0.03]}}
    screen = {"w4a8": 0.001, "w8a8-s8": 0.1}
    assert predicted_seconds("w8a8-s8", 1, timed, screen) == pytest.approx(3.0)
    assert predicted_seconds("w4a8", 1, timed, screen) == 0.03
    assert predicted_seconds("w4a8", 8, timed, screen) == 0.03  # its narrower width, before it ran at 8
    assert predicted_seconds("w8a8-s8", 1, {}, screen) is None
