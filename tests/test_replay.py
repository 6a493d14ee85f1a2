"""verispec.replay: the controller replayed over recorded costs and acceptance, timing nothing. Here on made-up
costs whose answers are known; tests/test_replay_kinds.py runs it on every recorded machine kind."""

from __future__ import annotations

import pytest

from verispec.replay import K_MAX, Costs, Trace, _line, replay, runs_from_steps, speedup

MODEL = ("draft-model",)


def costs(forward_per_row_token: float = 0.0, draft: float = 0.002, overhead: float = 0.001) -> Costs:
    """A target forward of 30 ms plus forward_per_row_token per token past each row's first (0: memory-bound,
    width is free); a draft position `draft` per row."""
    forward = {rows: {width: 0.030 * (1 + 0.1 * (rows - 1)) + forward_per_row_token * rows * (width - 1)
                      for width in (1, 2, 4, 9)} for rows in (1, 4, 16)}
    return Costs("made-up", forward, {"draft-model": {1: draft, 16: 4 * draft}, "suffix-index": {1: 1e-5}},
                 overhead, 1e-4)


def traces(run, answer: int = 96, requests: int = 8, source: str = "draft-model") -> list[Trace]:
    """Requests whose drafts from each position pass `run(position)` deep (capped as a recorder caps them)."""
    return [Trace(40, {source: [min(run(p), K_MAX, answer - p - 1) for p in range(answer)]}) for _ in range(requests)]


def test_costs_interpolate_between_sizes_and_never_fall_beyond_them():
    points = {1: 1.0, 4: 2.0, 8: 4.0}
    assert _line(points, 2) == pytest.approx(1 + 1 / 3)
    assert _line(points, 16) == pytest.approx(8.0)  # the line through the last two
    assert _line({1: 1.0, 8: 0.5}, 16) == 0.5  # a falling line never goes below the largest size's value
    assert _line(points, 0) == pytest.approx(2 / 3) and _line({1: 1.0}, 5) == 1.0
    made = costs(forward_per_row_token=0.001)
    assert made.forward_seconds(1, 3) == pytest.approx((made.forward[1][2] + made.forward[1][4]) / 2)
    assert made.forward_seconds(2, 1) > made.forward_seconds(1, 1)


def test_a_drafter_that_always_agrees_pays_and_auto_keeps_the_best_fixed_ks_gain():
    agreeing = traces(lambda p: K_MAX)
    fixed = {k: speedup(costs(), agreeing, 1, MODEL, k) for k in (1, 2, 4, 8)}
    auto = speedup(costs(), agreeing, 1, MODEL, "auto")
    assert max(fixed.values()) > 3  # width is free here: 8 drafts of 2 ms each buy 9 tokens a 30 ms forward
    assert auto - 1 >= 0.95 * (max(fixed.values()) - 1), (auto, fixed)


@pytest.mark.parametrize("clients", [1, 4, 16])
def test_a_drafter_that_never_agrees_costs_auto_almost_nothing_and_a_fixed_k_a_lot(clients):
    never = traces(lambda p: 0, requests=2 * clients)
    dear = costs(forward_per_row_token=0.002, draft=0.006)
    assert speedup(dear, never, clients, MODEL, "auto") >= 0.98
    assert speedup(dear, never, clients, MODEL, 4) < 0.8  # the negative control: drafting blindly loses


def test_a_lookup_drafts_where_it_finds_a_match_and_the_model_elsewhere():
    """Composite order: the suffix index's runs where it proposes (every other stretch of 16 positions), else the
    model's; the replay counts both and stays plain decoding's tokens."""
    answer = 64
    runs = {"suffix-index": [K_MAX if (p // 16) % 2 else None for p in range(answer)],
            "draft-model": [1] * answer}
    trace = Trace(30, {s: [None if r is None else min(r, answer - p - 1) for p, r in enumerate(rs)]
                       for s, rs in runs.items()})
    plain = replay(costs(), [trace], 1, ("suffix-index", "draft-model"), 0)
    both = replay(costs(), [trace], 1, ("suffix-index", "draft-model"), "auto")
    model_only = replay(costs(), [trace], 1, MODEL, "auto")
    assert plain.tokens == both.tokens == model_only.tokens == answer
    assert plain.steps == answer and both.steps < model_only.steps < plain.steps
    assert both.tokens_per_second > model_only.tokens_per_second > plain.tokens_per_second


def test_runs_from_a_recorded_greedy_run_cover_every_position():
    """Steps (drafted, accepted) of a k = 8 run: 3 passed then a rejection (positions 0-3: runs 3, 2, 1, 0), a
    lookup's empty step (None), all 8 passing (8 .. 1 and a lower bound 0 at the bonus token), then the end."""
    steps = [(8, 3), (0, 0), (8, 8), (2, 1)]
    runs = runs_from_steps(steps, 16, lookup=True)
    assert runs == [3, 2, 1, 0, None, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 0]
    assert runs_from_steps(steps, 16, lookup=False)[4] == 0  # a model's step without drafts: no run, not "no proposal"
    assert runs_from_steps([(8, 8)], 4, lookup=False) == [8, 7, 6, 5]  # cut at the answer's end
