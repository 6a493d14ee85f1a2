"""The adaptive controller (verispec.policy, its cost model and acceptance estimate): pure arithmetic, each named rule
alone, then through the engine."""

from __future__ import annotations

import pytest

from verispec.acceptance import SourceAverages
from verispec.cost_model import estimated_forward_seconds, prompt_chunk
from verispec.drafters import DraftModelDrafter
from verispec.engine import GenerationConfig, SpeculativeEngine
from verispec.models.loading import load_model
from verispec.policy import AdaptiveController, ControllerSettings


def run_steps(controller, steps, accept_rate_of_k, draft_cost, verify_cost):
    """Simulate steps: the controller picks k, the 'world' answers with costs and acceptances."""
    chosen = []
    for _ in range(steps):
        k = controller.choose_k()
        chosen.append(k)
        accepted = min(k, int(round(accept_rate_of_k * k)))
        controller.observe("draft-model", k, accepted, draft_cost * k, k + 1, verify_cost(k + 1))
    return chosen


def test_expected_rate_matches_the_formula():
    controller = AdaptiveController(ControllerSettings(k_max=3, prior_acceptance=0.5))
    controller.verify_cost = {1: 0.1, 4: 0.13}
    averages = controller._source("x")
    averages.draft_cost = {1: 0.01}
    expected_tokens = 1 + 0.5 + 0.25 + 0.125
    assert controller.expected_rate(3, averages) == pytest.approx(expected_tokens / (3 * 0.01 + 0.13))
    assert controller._verify_seconds(2) == pytest.approx(0.11)  # interpolated
    assert controller._verify_seconds(7) == pytest.approx(0.16)  # extrapolated


def test_costs_beyond_the_measured_sizes_follow_the_widest_span():
    controller = AdaptiveController()
    controller.verify_cost = {1: 0.04, 15: 0.2, 16: 0.19}  # 15 and 16 differ by noise
    assert controller._verify_seconds(120) == pytest.approx(0.19 + (0.19 - 0.04) / 15 * 104)  # not ~0.19
    assert controller._verify_seconds(8) == pytest.approx(0.04 + (0.2 - 0.04) / 14 * 7)  # between: nearest
    controller.verify_cost = {4: 0.3, 16: 0.2}  # noise can make more tokens look cheaper: never extrapolated
    assert controller._verify_seconds(64) == pytest.approx(0.2)


def test_speculates_long_when_drafts_are_right_and_cheap():
    controller = AdaptiveController(ControllerSettings(k_max=8))
    chosen = run_steps(controller, 60, 1.0, 0.01, lambda n: 0.2 + 0.005 * n)
    assert sum(chosen[-20:]) / 20 >= 6


def test_positions_never_reached_borrow_the_acceptance_seen_before_them():
    """Drafts of 2 that always pass: deeper positions are judged by that, not by the prior."""
    controller = AdaptiveController(ControllerSettings(k_max=6, prior_acceptance=0.3))
    for _ in range(20):
        controller.observe("draft-model", 2, 2, 0.02, 3, 0.11)
    controller.observe("draft-model", 0, 0, 0.0, 1, 0.1)
    acceptance = controller._source("draft-model").acceptance()
    assert acceptance[2:] == [pytest.approx(acceptance[1], abs=0.1)] * 4  # near the last measured, far from 0.3
    assert controller.choose_k() == 6  # 1 + 6 tokens for 0.06 + ~0.15 s beats 3 for 0.13 s
    before = acceptance[2]
    for _ in range(20):  # once reached, a position's own record counts
        controller.observe("draft-model", 6, 2, 0.06, 7, 0.15)
    assert controller._source("draft-model").acceptance()[2] < before / 2
    assert controller.choose_k() == 2


def test_a_deep_position_measured_low_recovers_when_shorter_drafts_keep_passing():
    """A stretch the drafter guessed badly (chat: first drafts pass, second ones fail) leaves the deeper estimates
    low; when drafts of 1 then always pass (code), the deeper estimates follow, so k grows and measures them anew.
    (Before: k stayed 1 for good, since a draft of 1 never reaches position 2; a served warm-up on a chat request
    made a server draft k = 1 on code at 95% acceptance.)"""
    controller = AdaptiveController(ControllerSettings(k_max=6))
    verify = lambda n: 0.04 + 0.002 * n  # noqa: E731
    for _ in range(30):
        controller.observe("draft-model", 6, 1, 0.06, 7, verify(7))
    assert controller.choose_k() == 1
    chosen = []
    for _ in range(60):
        k = controller.choose_k()
        chosen.append(k)
        controller.observe("draft-model", k, k, 0.01 * k, k + 1, verify(k + 1))
    assert min(chosen[-10:]) >= 4


def test_vain_probes_come_ever_further_apart_and_a_draft_that_pays_resets_them():
    controller = AdaptiveController(ControllerSettings(k_max=4, probe_every=8))
    probes_at = []
    for step in range(600):
        k = controller.choose_k()
        if controller.probing:
            probes_at.append(step)
        controller.observe("draft-model", k, 0, 0.05 * k, k + 1, 0.2 + 0.005 * (k + 1))
    gaps = [later - earlier for earlier, later in zip(probes_at, probes_at[1:])]
    assert gaps[:4] == [16, 32, 64, 128] and controller.probe_backoff == 16  # probes 16, 32, ... steps apart
    run_steps(controller, 300, 1.0, 0.001, lambda n: 0.2)
    assert controller.probe_backoff == 1  # drafting paid again: probes at their first pace


def test_stops_speculating_when_drafts_never_pass_but_keeps_probing():
    controller = AdaptiveController(ControllerSettings(k_max=8, probe_every=8))
    chosen = run_steps(controller, 80, 0.0, 0.05, lambda n: 0.2 + 0.005 * n)
    tail = chosen[-40:]
    assert tail.count(0) >= 30  # mostly plain decoding
    assert 1 in tail  # but it still probes
    assert max(tail) <= 1


def probes(batch_size: int, verify_cost: dict[int, float], draft_cost: dict[int, float]) -> int:
    """k = 1 probes in 256 steps with drafts that never pass (so plain decoding is the choice)."""
    controller = AdaptiveController(ControllerSettings(k_max=4, probe_every=8))
    controller.verify_cost = dict(verify_cost)
    controller.plain_batches.add(batch_size)
    averages = controller._source("draft-model")
    averages.assume([0.0] * 4, 10)
    averages.draft_cost = dict(draft_cost)
    controller.recent_sources["draft-model"] = 1
    return sum(controller.choose_k(batch_size) == 1 for _ in range(256))


def test_a_large_batch_probes_less_often():
    cheap_verify = {1: 0.2, 16: 0.4, 32: 0.5, 48: 0.6, 64: 0.7, 80: 0.8}
    # after 8 plain steps, then 16, 32, 64, 128: each vain probe doubles the wait
    assert probes(1, cheap_verify, {1: 0.02, 16: 0.05}) == 5
    assert probes(16, cheap_verify, {1: 0.02, 16: 0.05}) == 1  # after 128 steps, then 256


def test_no_probes_when_cost_alone_rules_drafting_out():
    """At batch 16 verifying 2 tokens per sequence costs 2.5x one: even perfect drafts cannot pay."""
    costly_verify = {1: 0.2, 16: 0.4, 32: 1.0, 48: 1.6, 64: 2.2, 80: 2.8}
    assert probes(16, costly_verify, {1: 0.02, 16: 0.2}) == 0
    assert probes(1, costly_verify, {1: 0.02, 16: 0.2}) == 5  # a single sequence still probes


@pytest.mark.parametrize("stalled", ["drafting", "after the forward"])
def test_one_slow_first_drafting_step_does_not_end_probing(stalled):
    """A first drafting step stalled 5 ms (a busy machine; a plain step takes 0.6 ms) is measured once, in a draft
    position's cost or in the step's overhead, and no drafting step measures it again: the costs alone must not rule
    drafting out on it, else no probe ever comes (a drafter that never agreed, on the tiny model in a full suite on a
    Zen 4: {3: 1, 0: 199}, no probe in 199 plain steps)."""
    controller = AdaptiveController(ControllerSettings(k_max=8, probe_every=8))
    controller.seed({1: 0.4e-3, 2: 0.43e-3, 4: 0.45e-3, 8: 0.5e-3})  # the tiny model's forwards, flat
    chosen = []
    for step in range(200):
        k = controller.choose_k(source="never-agrees")
        chosen.append(k)
        stall = 5e-3 if step == 0 else 0.0
        draft = 4e-6 * k + (stall if stalled == "drafting" else 0.0) if k else 0.0
        verify = 0.4e-3 + 1e-5 * k
        controller.observe_forward(k + 1, verify)
        controller.observe("never-agrees", k, 0, draft, k + 1, None)
        overhead = 0.2e-3 + (stall if stalled == "after the forward" else 0.0)
        controller.observe_step("never-agrees" if k else None, 1, draft + verify + overhead, draft + verify)
    assert chosen[0] > 0 and chosen[1:].count(0) >= 180  # drafted first, then plain
    assert chosen[1:].count(1) >= 3  # and probed: after 8 plain steps, 16, 32 ...


def test_recovers_when_the_drafter_starts_to_agree_again():
    controller = AdaptiveController(ControllerSettings(k_max=8, probe_every=4))
    run_steps(controller, 40, 0.0, 0.02, lambda n: 0.2)
    chosen = run_steps(controller, 60, 1.0, 0.02, lambda n: 0.2)
    assert sum(chosen[-10:]) / 10 >= 4


def test_k_follows_the_source_that_will_draft():
    """A composite's free lookup drafts deep while its costly draft model drafts short, step by step."""
    controller = AdaptiveController(ControllerSettings(k_max=8))
    verify = lambda n: 0.04 + 0.002 * n  # noqa: E731 - a CPU verify pass: a few tokens cost about one
    for _ in range(30):
        controller.observe("suffix-index", 6, 6, 0.0001, 7, verify(7))
        controller.observe("draft-model", 2, 1, 2 * 0.02, 3, verify(3))
    for _ in range(30):  # the draft model is the most recent source by far
        controller.observe("draft-model", 2, 1, 2 * 0.02, 3, verify(3))
    assert controller.choose_k(source="suffix-index") >= 6
    assert 1 <= controller.choose_k(source="draft-model") <= 3
    assert controller.choose_k() == controller.choose_k(source="draft-model")  # None: the most recent source
    # never drafted: tried, as if its drafts were free, at the k the measured forwards suggest
    assert controller.choose_k(source="never-seen") >= controller.choose_k(source="draft-model")


def test_a_source_drafting_for_few_rows_of_a_batch_pays_for_the_whole_width():
    """Every row of the verify pass is padded to the longest draft, but only drafting rows gain tokens."""
    controller = AdaptiveController(ControllerSettings(k_max=4))
    controller.verify_cost = {16: 0.2, 32: 0.3, 48: 0.4, 64: 0.5, 80: 0.6}
    controller.plain_batches.add(16)
    averages = controller._source("suffix-index")
    averages.draft_cost = {16: 0.0001}
    averages.assume([0.9] * 4, 10)
    assert controller.choose_k(16, "suffix-index") >= 2  # all 16 rows draft: 1 + ~3 tokens each for 3x the cost
    assert controller.choose_k(16, "suffix-index", drafting_rows=16) == controller.choose_k(16, "suffix-index")
    assert controller.choose_k(16, "suffix-index", drafting_rows=2) == 0  # 2 rows gain, 16 pay
    rate = controller.expected_rate(2, averages, 16, drafting_rows=4)
    a = averages.acceptance()
    assert rate == pytest.approx((1 + 0.25 * (a[0] + a[0] * a[1])) / (2 * 0.0001 + 0.4))


def test_plain_cost_is_unknown_until_measured():
    controller = AdaptiveController()
    assert controller.plain_seconds_per_token() is None
    controller.observe("x", 5, 5, 0.1, 6, 0.3)
    assert controller.plain_seconds_per_token() is None  # one size only: no honest extrapolation
    controller.observe("x", 0, 0, 0.0, 1, 0.2)
    assert controller.plain_seconds_per_token() == pytest.approx(0.2)


def test_auto_is_lossless_and_reports_its_choices(tiny_dir, other_tiny_dir):
    target = load_model(tiny_dir, "float32")
    other = load_model(other_tiny_dir, "float32")
    plain = SpeculativeEngine(target).generate("def add(a, b):", GenerationConfig(max_new_tokens=60, k=0, eos_token_ids=()))
    for drafter_model in (target, other):
        engine = SpeculativeEngine(target, DraftModelDrafter(drafter_model.model, target.model.vocab_size))
        result = engine.generate("def add(a, b):", GenerationConfig(max_new_tokens=60, k="auto", eos_token_ids=()))
        assert result.token_ids == plain.token_ids
        histogram = result.stats.k_histogram
        assert sum(histogram.values()) == result.stats.target_forwards
        data = result.stats.to_dict()
        assert "counterfactual_speedup" in data and "k_histogram" in data
    assert max(k for k in histogram if histogram[k]) >= 1  # it tried the unrelated drafter
    assert histogram.get(0, 0) > 0  # and then gave up on it for plain steps


def test_bad_k_is_rejected():
    with pytest.raises(ValueError, match="auto"):
        GenerationConfig(k="sometimes")
    with pytest.raises(ValueError, match="k_max"):
        GenerationConfig(k_max=0)


def carried(costs, base, share, draft, token_seconds, most, steps=8):
    """The chunks prompt_chunk carries over `steps` steps, its credit handed on."""
    chunks, credit = [], 0.0
    for _ in range(steps):
        size, credit = prompt_chunk(costs, base, share, draft, token_seconds, most, credit, 8)
        chunks.append(size)
    return chunks


def test_a_packed_chunk_keeps_the_prompts_share_on_average_and_pays_a_kernels_jump_with_a_large_chunk():
    # Cost growing by the same 4 ms a token: share of each step, each step (a 71 ms step, 0.75: 53 ms, 13 tokens; the
    # smallest chunk within 15% of that rate: 12).
    line = {4: 0.066, 8: 0.082, 16: 0.114, 64: 0.306}
    assert carried(line, 4, 0.75, 0.005, 0.004, 300) == [12] * 8
    # A forward of 8 tokens costs 64 ms, of 9: 95 ms (a kernel for up to 8 rows, then another), then 4 ms a token.
    jump = {4: 0.050, 8: 0.064, 9: 0.095, 12: 0.108, 32: 0.170}
    chunks = carried(jump, 4, 0.75, 0.005, 0.004, 100)
    # Small chunks would stay below the jump at 4 tokens a step; the prompt waits for a chunk that pays the jump.
    assert chunks[0] == 0 and min(c for c in chunks if c) > 4 + 8
    step = 0.005 + 0.050
    spent = sum(estimated_forward_seconds(jump, 4 + c, 0.004) - 0.050 for c in chunks if c)
    assert spent <= 0.75 * step * len(chunks) + 1e-9  # the share, on average
    assert sum(chunks) / len(chunks) > 4  # more of the prompt a step than chunks below the jump
    # No chunk holds the streams up by more than 8 steps, however much is saved; at most what is left.
    assert all(estimated_forward_seconds(jump, 4 + c, 0.004) <= 9 * step for c in carried(jump, 4, 100.0, 0.005, 0.004, 500))
    assert carried(jump, 4, 100.0, 0.005, 0.004, 30, steps=1) == [30]
    assert carried(jump, 4, 0.0, 0.005, 0.004, 30, steps=3) == [1, 1, 1]  # no share: still some progress
    # Nothing measured: token_seconds a token (a burst's first step: 15 x 4 ms of share, 28 tokens within 15%).
    assert carried({}, 4, 15.0, 0.0, 0.004, 100, steps=1) == [28]


def expected_batch_rate(ks, acceptance, draft_per_position, verify_cost, batch_size):
    """Tokens per second of one step under the controller's model, written out: each row's 1 + A_1 + ... + A_k."""
    tokens = batch_size
    for k, rates in zip(ks, acceptance):
        reach = 1.0
        for i in range(k):
            reach *= rates[i]
            tokens += reach
    return tokens / (draft_per_position * max(ks, default=0) + verify_cost(batch_size + sum(ks)))


def test_rows_that_agree_more_draft_longer_and_never_worse_than_one_k_for_all():
    controller = AdaptiveController(ControllerSettings(k_max=6))
    verify = lambda tokens: 0.030 + 0.002 * max(tokens - 8, 0)  # flat to 8 tokens, then 2 ms a token
    controller.verify_cost = {n: verify(n) for n in (4, 8, 16, 32)}
    source = controller._source("draft-model")
    source.draft_cost[4] = 0.003
    acceptance = [[0.95] * 6, [0.9] * 6, [0.3] * 6, [0.05] * 6]
    ks = controller.choose_row_ks(4, "draft-model", acceptance, 0, [6] * 4)
    assert ks[0] >= ks[1] >= ks[2] >= ks[3] and ks[0] > ks[3], ks
    assert ks[3] == 1  # a row that hardly ever agrees drafts one token only, which keeps measuring it
    best = expected_batch_rate(ks, acceptance, 0.003, verify, 4)
    for k in range(1, 7):
        assert best >= expected_batch_rate([k] * 4, acceptance, 0.003, verify, 4)
    assert controller.choose_row_ks(4, "draft-model", acceptance, 0, [6, 0, 2, 6])[1:3] in ([0, 1], [0, 2])
    assert all(k <= cap for k, cap in zip(controller.choose_row_ks(4, "draft-model", acceptance, 0, [1, 0, 2, 6]), [1, 0, 2, 6]))
    # Rows that look alike get k alike; nothing measured yet for the source: no refinement.
    alike = controller.choose_row_ks(4, "draft-model", [[0.8] * 6] * 4, 0, [6] * 4)
    assert max(alike) - min(alike) <= 1
    assert controller.choose_row_ks(4, "lookup", acceptance, 0, [6] * 4) is None


def test_a_rows_acceptance_starts_at_its_sources_and_moves_to_its_own():
    controller = AdaptiveController(ControllerSettings(k_max=2, prior_acceptance=0.5))
    assert controller.row_acceptance("s", [0, 0], [0, 0]) == [0.5, 0.5]
    steps = controller.settings.row_prior_steps
    rates = controller.row_acceptance("s", [steps, 0], [steps, steps])
    assert rates == [0.75, 0.25]


class NeverAgrees:
    """A drafter whose drafts are always rejected (a token greedy decoding never picks here): free to ask."""

    source = "never-agrees"

    def __init__(self, token: int) -> None:
        self.token = token

    def begin(self, prompt_ids, max_length):
        pass

    def propose(self, tokens, k, params, generator):
        import torch

        from verispec.drafters.base import Proposal

        return Proposal(torch.full((1, k), self.token, dtype=torch.long), None, source=self.source)


@pytest.mark.parametrize("path", ["library", "server"])
def test_a_drafter_that_never_agrees_costs_what_plain_decoding_does(tiny_dir, path):
    """Step for step, plain: every target forward yields one token, and drafts are only the probes that notice a
    change (the first steps, then one token after probe_every steps, 2x, 4x ... as many), in the library and the
    server alike."""
    from verispec.serving.scheduler import Scheduler, SchedulerLimits

    target = load_model(str(tiny_dir), "float32")
    prompt = target.encode("def add(a, b):\n")
    new_tokens = 200
    config = GenerationConfig(max_new_tokens=new_tokens, k="auto", eos_token_ids=())  # the whole length
    plain = SpeculativeEngine(target).generate(prompt, config).token_ids
    never = next(token for token in range(target.model.vocab_size) if token not in plain)
    if path == "library":
        result = SpeculativeEngine(target, NeverAgrees(never)).generate(prompt, config)
        tokens, stats = result.token_ids, result.stats
    else:
        scheduler = Scheduler(
            target, None, "never-agrees", k="auto", limits=SchedulerLimits(max_batch_size=2, max_context=256),
            sequence_drafter=lambda: NeverAgrees(never), synchronous=True,
        )
        handle = scheduler.submit(prompt, config)
        while scheduler.run_once():
            pass
        events = list(handle.iter_events())
        tokens, stats = [t for e in events for t in e.token_ids], events[-1].stats
    assert tokens == plain
    assert stats.accepted_tokens == 0 and stats.target_forwards == new_tokens  # one token a forward, as plain
    # Learning that the drafts fail (on this tiny model a verify pass costs about what a plain one does, so drafting
    # pays until acceptance is near min_gain: ~20-25 steps, more where timing noise prices the verify pass low), then
    # k = 1 probes after probe_every plain steps, then twice as many, and so on (vain probes back off:
    # 8 + 16 + 32 + 64 < 180; the backoff is tested alone in test_vain_probes_come_ever_further_apart...). The steps
    # depend on measured costs, so the bound is what a busy machine cannot break: a quarter of the steps at most.
    probes = 4
    drafting_steps = new_tokens - stats.k_histogram.get(0, 0)
    assert 0 < drafting_steps <= new_tokens // 4, stats.k_histogram
    assert stats.k_histogram.get(1, 0) >= probes // 2, stats.k_histogram


def test_a_drafting_step_overhead_the_model_does_not_price_makes_it_plain():
    """The cost model says k > 0 pays (cheap drafts, all accepted); whole drafting steps that take more than their
    drafting and forward (a catch-up, sampling, Python) add that overhead to the cost: past the gain, plain wins,
    until plain steps measure an overhead as large (then both pay it and drafting pays again)."""
    controller = AdaptiveController(ControllerSettings(k_max=4))
    run_steps(controller, 20, 1.0, 0.001, lambda n: 0.05 + 0.001 * n)
    assert controller.choose_k() > 0  # no whole step measured: the model decides
    for _ in range(30):  # 0.24 s beyond the ~0.06 s priced, every drafting step
        controller.observe_step("draft-model", 1, 0.30, 0.06)
    assert controller.choose_k(source="draft-model") == 0
    for _ in range(30):
        controller.observe_step(None, 1, 0.25, 0.05)
    assert controller.choose_k(source="draft-model") > 0
    assert controller.choose_k(batch_size=1, source="other") > 0  # another source's steps were not measured


def test_an_unlucky_first_draft_does_not_keep_a_source_from_drafting():
    """A first step of k = 4 whose drafts all failed took long for one token; its cost is what a 5-token forward
    costs, not a verdict on the source, so once its drafts pass again (probes) it drafts: a whole step is judged
    by its overhead, not its seconds per token (which kept prompt lookup from drafting on an AVX2 Zen 1)."""
    controller = AdaptiveController(ControllerSettings(k_max=4))
    controller.seed({1: 0.074, 2: 0.117, 4: 0.2, 8: 0.36}, {"prompt-lookup": 0.0})
    controller.observe("prompt-lookup", 4, 0, 0.0, 5, 0.24)
    controller.observe_step("prompt-lookup", 1, 0.241, 0.24)  # 241 ms for one token
    controller.observe_step(None, 1, 0.075, 0.074)
    for _ in range(6):  # probes that pass
        controller.observe("prompt-lookup", 1, 1, 0.0, 2, 0.117)
        controller.observe_step("prompt-lookup", 1, 0.118, 0.117)
    assert controller.choose_k(source="prompt-lookup") > 0


def test_seeded_costs_decide_the_first_step():
    """With the forwards' costs measured before any step (AVX2 Zen 1: a 2-token pass costs 1.57x one, a draft-model
    forward 0.42x), a draft model is not tried at all, not even as a probe: perfect drafts would only tie plain."""
    controller = AdaptiveController(ControllerSettings(k_max=8))
    controller.seed({1: 0.074, 2: 0.117, 4: 0.2, 8: 0.36}, {"draft-model": 0.031}, catch_up_per_token=0.012)
    assert [controller.choose_k(source="draft-model") for _ in range(300)] == [0] * 300
    cheap = AdaptiveController(ControllerSettings(k_max=8))  # the same pass on a target whose verify is flat
    cheap.seed({1: 0.03, 2: 0.031, 4: 0.033, 8: 0.04}, {"draft-model": 0.004}, catch_up_per_token=0.001)
    assert cheap.choose_k(source="draft-model") >= 2


def test_a_draft_measured_cheaper_than_its_seed_is_probed_again():
    """The verdict that ends probing prices a draft position at the least it was timed or measured: the draft model
    timed too dear to pay before any step (as above), then measured at an eighth of that while its drafts failed,
    is probed, and so would be noticed when it agrees again."""
    controller = AdaptiveController(ControllerSettings(k_max=8, probe_every=8))
    controller.seed({1: 0.074, 2: 0.117, 4: 0.2, 8: 0.36}, {"draft-model": 0.031}, catch_up_per_token=0.012)
    for _ in range(10):
        controller.observe("draft-model", 2, 0, 2 * 0.004, 3, None)
    assert 0 < [controller.choose_k(source="draft-model") for _ in range(300)].count(1) < 10


def test_a_draft_forward_over_more_rows_than_measured_costs_as_the_targets_grows():
    """A draft model timed at one row is priced at 15 rows as the target's forward grows from 1 to 15 rows, not flat
    (Intel Xeon: target 38 ms at 1 row, 130 ms at 15; draft 15 ms at 1, 80 ms at 15 measured). Flat, a 15-client
    server drafted k = 1 at 70% acceptance and ran slower than plain."""
    controller = AdaptiveController(ControllerSettings(k_max=8))
    controller.seed({1: 0.038, 15: 0.130, 30: 0.175}, {"draft-model": 0.015})
    controller.plain_batches.add(15)
    averages = controller._source("draft-model")
    assert controller._draft_seconds(averages, 15) == pytest.approx(0.015 * 0.130 / 0.038)
    assert controller._draft_seconds(averages, 1) == 0.015
    assert controller.choose_k(15, "draft-model") == 0  # 15 + 10.5 tokens in 226 ms against 15 in 130 ms
    averages.draft_cost[15] = 0.004  # measured at 15 rows: that is what counts there
    assert controller._draft_seconds(averages, 15) == 0.004
    assert controller.choose_k(15, "draft-model") > 0


def test_one_slow_forward_does_not_price_plain_steps_out():
    """A one-off slow forward (a neighbour on the machine) moves the plain cost by a clipped share only, so drafting
    that does not pay stays off: chat at 16 clients on an Intel Xeon, where one 200 ms forward among 119 ms ones made
    the server draft at k = 2, 17% slower than plain, and never measure a plain step at 16 rows again."""
    controller = AdaptiveController()
    for tokens, seconds in {16: 0.119, 32: 0.165, 48: 0.212}.items():
        for _ in range(5):
            controller.observe_forward(tokens, seconds)
    averages = controller._source("draft-head")
    averages.draft_cost = {16: 0.018}
    averages.assume([0.45] * 8, 10)
    assert controller.choose_k(16, "draft-head") == 0
    controller.observe_forward(16, 0.200)
    assert controller.verify_cost[16] <= 0.119 * (1 + controller.settings.smoothing * 0.25) + 1e-9
    assert controller.choose_k(16, "draft-head") == 0
    for _ in range(30):  # a forward that really got slower is followed, if step by step
        controller.observe_forward(16, 0.200)
    assert controller.verify_cost[16] == pytest.approx(0.200, rel=0.01)


def test_seeded_costs_do_not_stand_for_a_plain_step_of_many_rows():
    """One row's forwards timed before any step price drafting at one row, but a batch size drafts only after its own
    plain step was measured: a one-row 4-token forward is not a 4-row one, and priced as one it had a 16-client
    server draft while its first wave went in."""
    controller = AdaptiveController(ControllerSettings(k_max=4))
    controller.seed({1: 0.04, 2: 0.041, 4: 0.043, 8: 0.05}, {"draft-head": 0.001})
    averages = controller._source("draft-head")
    averages.assume([0.9] * 4, 10)
    assert controller.choose_k(1, "draft-head") > 0
    assert controller.choose_k(4, "draft-head") == 0  # seeded: 4 tokens cost 43 ms, but not as 4 rows
    controller.observe_forward(4, 0.043, rows=1)  # one row's 4-token verify pass: still not a plain step of 4 rows
    assert controller.choose_k(4, "draft-head") == 0
    controller.observe_forward(4, 0.06, rows=4)  # a plain step of 4 rows
    assert controller.choose_k(4, "draft-head") > 0


def test_seeds_timed_in_a_loaded_moment_are_scaled_to_what_the_first_step_measures():
    """Step costs are timed once and remembered; timed while the machine was busy (forwards 20x their real cost, the
    draft position with them) they ruled drafting out, and with no draft ever measured again a server never drafted.
    The first one-row forward checks the seeds: off by more than seed_tolerance, the forwards are scaled to it and
    the draft's seeds dropped, to be measured by drafting."""
    loaded = {1: 1.12, 2: 1.12, 4: 1.56, 8: 1.55}
    controller = AdaptiveController(ControllerSettings(k_max=4))
    controller.seed(loaded, {"draft-model": 0.95}, 0.07)
    controller._source("draft-model").assume([0.9] * 4, 10)
    controller.recent_sources["draft-model"] = 1
    assert controller.planned_k(1, "draft-model") == 0  # 0.95 s a draft against 1.12 s a forward: never pays
    controller.observe_forward(1, 0.056)  # what a plain one-row step really takes
    assert controller.stale_seed == pytest.approx(0.05)
    assert controller.verify_cost[8] == pytest.approx(1.55 * 0.05)
    assert controller._source("draft-model").draft_cost == {} and controller.catch_up_per_token is None
    assert controller.planned_k(1, "draft-model") > 0  # tried, so measured


def test_seeds_the_first_step_confirms_are_kept():
    controller = AdaptiveController(ControllerSettings(k_max=4))
    controller.seed({1: 0.05, 2: 0.052, 4: 0.06}, {"draft-model": 0.02}, 0.004)
    controller.observe_forward(1, 0.08)  # 1.6x: noise, not a stale record
    assert controller.stale_seed is None
    assert controller.verify_cost[4] == 0.06 and controller._source("draft-model").draft_cost[1] == 0.02
    controller.observe_forward(1, 0.5)  # checked once: later forwards are averaged as usual
    assert controller.stale_seed is None and controller.verify_cost[2] == 0.052


def test_acceptance_remembers_steps_whatever_the_batch():
    """32 steps of drafts that pass, then 8 that fail: four rows a step remember those 40 steps as one row does
    (the memory is in steps), so the estimate falls by as much either way; counted in rows, four rows forgot the
    good stretch four times faster and a short bad one ruled drafting out."""
    def after(batch_size: int) -> float:
        controller = AdaptiveController()
        for passed in [1] * 32 + [0] * 8:
            for _ in range(batch_size):
                controller.observe("draft-head", 1, passed, 0.001, 2 * batch_size, None, batch_size=batch_size)
        return controller._source("draft-head").acceptance()[0]

    assert after(4) == pytest.approx(after(1), abs=0.03)
    assert 0.5 < after(4) < 0.9  # it moved, and still remembers the good stretch


# Each named rule alone: a case where it decides, and where deciding without it would differ.


def test_before_anything_is_measured_the_first_step_drafts_first_k():
    controller = AdaptiveController(ControllerSettings(first_k=3))
    assert controller.choose_k() == 3  # no source seen yet
    assert controller.choose_k(source="draft-model") == 3  # a source, but no forward measured


def test_drafting_must_beat_plain_by_min_gain_to_start_and_by_half_of_it_to_go_on():
    controller = AdaptiveController(ControllerSettings(k_max=1, min_gain=0.05))
    assert not controller.beats_plain(1.04, 1.0)  # within noise: no start
    controller.drafted_last = True
    assert controller.beats_plain(1.04, 1.0) and not controller.beats_plain(1.02, 1.0)  # half the margin to go on
    # Wired into choose_k: one free draft that passes 90% of the time for a pass 1.84x as dear is 3% faster than plain.
    controller.verify_cost = {1: 0.1, 2: 0.184}
    averages = controller._source("draft-model")
    averages.draft_cost = {1: 0.0}
    averages.assume([0.9], 10)
    controller.drafted_last = False
    assert controller.choose_k(source="draft-model") == 0
    controller.drafted_last = True
    assert controller.choose_k(source="draft-model") == 1


def test_a_probe_that_passes_sets_the_first_position_back_to_its_prior():
    def first_after(probing: bool, accepted: int) -> float:
        controller = AdaptiveController(ControllerSettings(k_max=2, prior_acceptance=0.7))
        controller._source("draft-model").assume([0.05, 0.05], 30)
        controller.probing = probing
        controller.observe("draft-model", 1, accepted, 0.01, 2, None)
        return controller._source("draft-model").acceptance()[0]

    assert first_after(probing=True, accepted=1) == pytest.approx(0.7)  # the prior again: drafting is tried anew
    assert first_after(probing=False, accepted=1) < 0.1  # a pass that was not a probe is one step among 30
    assert first_after(probing=True, accepted=0) < 0.1  # a probe that failed changes nothing but its count


def test_the_recent_source_is_that_of_the_last_few_steps_not_of_the_whole_run():
    controller = AdaptiveController()
    for _ in range(40):
        controller.observe("draft-model", 1, 1, 0.01, 2, None)
    for _ in range(20):
        controller.observe("suffix-index", 1, 1, 0.0, 2, None)
    assert controller.recent_source() == "suffix-index"  # 40 steps against 20 over the run, but fewer of late


def test_a_drafting_steps_overhead_is_never_priced_below_a_plain_ones():
    controller = AdaptiveController(ControllerSettings(k_max=1))
    controller.observe_step(None, 1, 0.060, 0.050)  # plain steps: 10 ms beyond their forward
    controller.observe_step("suffix-index", 1, 0.052, 0.050)  # drafting steps: 2 ms, noise below plain's
    assert controller.overhead("suffix-index", 1) == pytest.approx(0.010)
    assert controller.overhead("never-measured", 1) == pytest.approx(0.010)
    # A free lookup that agrees 3% of the time, where two tokens cost what one does: no gain, so no drafting (priced
    # at its own 2 ms it would look 19% faster than plain).
    controller.verify_cost = {1: 0.05, 2: 0.05}
    averages = controller._source("suffix-index")
    averages.draft_cost = {1: 0.0}
    averages.assume([0.03], 10)
    assert controller.choose_k(source="suffix-index") == 0


def test_a_wider_forward_is_never_priced_below_a_plain_one_and_an_untimed_draft_is_free():
    controller = AdaptiveController(ControllerSettings(k_max=2))
    controller.verify_cost = {1: 0.1, 2: 0.08, 3: 0.12}  # a 2-token pass measured below a 1-token one: noise
    averages = controller._source("suffix-index")
    averages.draft_cost = {1: 0.001}
    assert controller.step_seconds(1, averages) == pytest.approx(0.1 + 0.001)
    assert controller.step_seconds(2, averages) == pytest.approx(0.12 + 0.002)
    assert controller.step_seconds(1, controller._source("never-timed")) == pytest.approx(0.1)


def test_where_every_draft_passed_the_position_beyond_is_credited_at_the_deepest_estimate():
    averages = SourceAverages.start(4, 0.7, 2.0)
    averages.assume([0.9, 0.2, 0.2, 0.2], 10)  # position 2 measured low once; drafts of 1 never reach it again
    keep = 1 - 1 / 32
    averages.record(1, 1, memory=32.0)
    assert averages.reached[1] == pytest.approx(10 * keep + 1)  # a step's worth at position 1's estimate, 0.9
    assert averages.hits[1] == pytest.approx(2 * keep + 0.9)
    assert averages.beyond_all_passed(1, 0) is None  # a draft failed: nothing beyond is credited
    assert averages.beyond_all_passed(4, 4) is None  # no position beyond the deepest


def lookup_batch(rows: int = 16) -> AdaptiveController:
    """A batch of `rows` whose plain step was measured and whose free lookup passes 90% of the time."""
    controller = AdaptiveController(ControllerSettings(k_max=4))
    controller.verify_cost = {16: 0.2, 32: 0.3, 48: 0.4, 64: 0.5, 80: 0.6}
    controller.plain_batches.add(rows)
    averages = controller._source("suffix-index")
    averages.draft_cost = {rows: 0.0001}
    averages.assume([0.9] * 4, 10)
    return controller


def test_drafting_still_pays_only_while_enough_rows_are_left_to_gain():
    controller = lookup_batch()
    assert controller.still_pays(2, "suffix-index", 16, 16)
    assert controller.still_pays(2, "suffix-index", 16, 15)
    assert not controller.still_pays(2, "suffix-index", 16, 2)  # 2 rows gain, the pass is as wide for 16
    assert not controller.still_pays(0, "suffix-index", 16, 16)


def test_rows_left_to_draft_are_kept_only_if_they_still_pay_counting_rows_other_sources_draft_for():
    controller = lookup_batch()
    wanted = [True] * 16
    assert controller.rows_left_pay("suffix-index", wanted, wanted, [2] * 16) == wanted
    assert controller.rows_left_pay("suffix-index", wanted, [True] * 2 + [False] * 14, [2] * 16) == [False] * 16
    # Two rows want this source and one is left, but 14 rows draft from another: 15 rows gain, so it still pays.
    wanted = [True, True] + [False] * 14
    kept = [True] + [False] * 15
    assert controller.rows_left_pay("suffix-index", wanted, kept, [2] * 16) == kept


def catching_up() -> AdaptiveController:
    """A batch of 4 where drafting 2 makes a row's token take 0.048 s of the batch's time instead of 0.1 s: 52 ms
    saved for each step's worth of tokens, of which each row's token holds a share of 13 ms."""
    controller = AdaptiveController(ControllerSettings(k_max=4))
    controller.verify_cost = {4: 0.1, 8: 0.11, 12: 0.12, 16: 0.13, 20: 0.14}
    controller.plain_batches.add(4)
    averages = controller._source("draft-model")
    averages.draft_cost = {4: 0.005}
    averages.assume([0.9] * 4, 10)
    return controller


def test_a_catch_up_pays_where_the_rows_share_of_the_saving_over_its_remaining_tokens_covers_it():
    controller = catching_up()
    assert controller.catch_up_pays(100, 100, 2, "draft-model", 4) is None  # no catch-up timed yet
    controller.catch_up_per_token = 0.0075  # 100 tokens behind: 0.75 s, against 1.3 s saved over 100 tokens
    assert controller.catch_up_pays(100, 100, 2, "draft-model", 4)
    assert not controller.catch_up_pays(100, 50, 2, "draft-model", 4)  # 0.65 s saved over 50
    assert not controller.catch_up_pays(100, 100, 2, "draft-model", 4, spent=0.75)  # the saving already spent


def test_a_catch_up_is_not_paid_for_with_the_whole_batchs_saving():
    """Each row of 4 catching up on its prompt would be weighed against the saving of all 4 rows' steps (5.2 s over
    100 tokens), and the batch would pay for its prompts four times over what drafting wins back."""
    controller = catching_up()
    controller.catch_up_per_token = 0.02  # 100 tokens behind: 2 s; the batch saves 5.2 s, this row's share 1.3 s
    assert not controller.catch_up_pays(100, 100, 2, "draft-model", 4)


def test_rows_catching_up_in_one_step_are_taken_nearest_first_while_their_shares_cover_them():
    controller = catching_up()
    behind, remaining, ks = [100, 120, 2, 300], [100] * 4, [2] * 4
    # Untimed: only the nearest row far behind catches up (and measures it); a row within the long tail just drafts.
    assert controller.catch_up_rows("draft-model", [True] * 4, behind, remaining, ks, 8) == [True, False, True, False]
    controller.catch_up_per_token = 0.0075
    assert controller.catch_up_pays(120, 100, 2, "draft-model", 4)  # alone, the second row would pay (0.9 s < 1.3 s)
    # Together with the first (0.75 s already spent), it does not.
    assert controller.catch_up_rows("draft-model", [True] * 4, behind, remaining, ks, 8) == [True, False, True, False]
    assert controller.catch_up_rows("draft-model", [False, True, True, True], behind, remaining, ks, 8) == [
        False, True, True, False]
