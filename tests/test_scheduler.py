"""The continuous-batching scheduler: many sequences in one verify pass give each its single-request output."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from verispec.drafters import DraftModelDrafter
from verispec.drafters.base import LONG_TAIL
from verispec.engine import GenerationConfig, SpeculativeEngine
from verispec.models.loading import load_model
from verispec.sampling import SamplingParams
from verispec.drafters.batch_draft import BatchedDraftModel
from verispec.core import drafting as drafting_module
from verispec.core.requests import QueueFullError
from verispec.serving.scheduler import Scheduler, SchedulerLimits

PROMPTS = [
    "def add(a, b):\n",
    "class Point:\n    def __init__(self, x, y):\n",
    "def greet(name):\n    print(",
    "hello",
    "def add(a, b):\n    return a + b\n\ndef add(",
    "x",
]


@pytest.fixture(scope="module")
def draft(other_tiny_dir):
    return load_model(str(other_tiny_dir), "float32")


def plain_tokens(target, prompt: str, max_new_tokens: int) -> list[int]:
    return SpeculativeEngine(target, None).generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens)).token_ids


def run_all(scheduler: Scheduler, prompts: list[str], configs: list[GenerationConfig]):
    """Submit everything before the loop starts, so the sequences really share steps."""
    handles = [scheduler.submit(scheduler.target.encode(p), c) for p, c in zip(prompts, configs)]
    scheduler.start()
    try:
        return [list(h.iter_events()) for h in handles]
    finally:
        scheduler.stop()


@pytest.mark.parametrize("drafter", ["draft-model", "prompt-lookup", "suffix-index", "composite", "none"])
@pytest.mark.parametrize("k", ["auto", 3])
def test_batched_greedy_equals_single_requests(target, draft, drafter, k):
    lengths = [24, 7, 31, 16, 40, 1]  # sequences finish at different steps and leave the batch
    expected = [plain_tokens(target, p, n) for p, n in zip(PROMPTS, lengths)]
    scheduler = Scheduler(
        target, draft.model if drafter in ("draft-model", "composite") else None, drafter, k=k,
        limits=SchedulerLimits(max_batch_size=4, max_context=256),
    )
    events = run_all(scheduler, PROMPTS, [GenerationConfig(max_new_tokens=n) for n in lengths])
    for prompt_events, want in zip(events, expected):
        tokens = [t for e in prompt_events for t in e.token_ids]
        assert tokens == want
        final = prompt_events[-1]
        assert final.finish_reason in ("length", "stop")
        assert final.stats.completion_tokens == len(want)
        assert "".join(e.text for e in prompt_events) == target.decode(want)
        assert 0 <= final.stats.accepted_tokens <= final.stats.drafted_tokens
    assert scheduler.num_active == 0
    if drafter != "none" and k != "auto":  # auto drafts where the tiny models' measured steps say it pays: not always
        assert sum(e[-1].stats.drafted_tokens for e in events) > 0


def test_draft_model_rows_are_accepted_on_a_self_draft(target):
    """Drafting with the target itself accepts every draft: rows, rollback and moves stay in sync."""
    scheduler = Scheduler(target, target.model, "draft-model", k=3, limits=SchedulerLimits(max_batch_size=3, max_context=256))
    events = run_all(scheduler, PROMPTS, [GenerationConfig(max_new_tokens=n) for n in (20, 9, 33, 12, 5, 17)])
    for prompt_events in events:
        stats = prompt_events[-1].stats
        assert stats.drafted_tokens > 0
        assert stats.accepted_tokens == stats.drafted_tokens


def test_logprobs_of_accepted_drafts_and_sampled_tokens_are_the_targets(target):
    """Each emitted token's logprob is the target's log-softmax at its position, drafted or not; top-n sorted."""
    limits = SchedulerLimits(max_batch_size=2, max_context=256)
    scheduler = Scheduler(target, target.model, "draft-model", k=3, limits=limits)
    configs = [GenerationConfig(max_new_tokens=15, logprobs=4), GenerationConfig(max_new_tokens=15)]
    events = run_all(scheduler, PROMPTS[:2], configs)
    asked, not_asked = events
    assert all(e.logprobs is None for e in not_asked)
    tokens = [t for e in asked for t in e.token_ids]
    entries = [entry for e in asked for entry in (e.logprobs or [])]
    assert [e.token_id for e in entries] == tokens and asked[-1].stats.accepted_tokens > 0  # self-draft: accepted
    prompt = target.encode(PROMPTS[0])
    cache = target.model.new_cache(1, len(prompt) + len(tokens))
    logits = target.model.forward(torch.tensor([prompt + tokens[:-1]]), cache)[0]  # (P + T - 1, V)
    reference = torch.log_softmax(logits[len(prompt) - 1 :], -1)  # (T, V)
    for position, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(float(reference[position, entry.token_id]), abs=1e-4)
        assert [i for i, _ in entry.top] == reference[position].topk(4).indices.tolist()
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
    with pytest.raises(ValueError, match="logprobs"):
        GenerationConfig(logprobs=21)


def test_composite_rows_draft_from_their_lookup_where_the_context_recurs(target):
    """In one batch a row whose text recurs drafts from its suffix index, the others from the draft model."""
    scheduler = Scheduler(target, target.model, "composite", k=3, limits=SchedulerLimits(3, 8, 256))
    for prompt in (PROMPTS[4], PROMPTS[1], PROMPTS[2]):  # PROMPTS[4] ends in a context it had before
        scheduler.submit(target.encode(prompt), GenerationConfig(max_new_tokens=40))
    scheduler._admit()
    sources = scheduler._sources()
    assert sources == ["suffix-index", "draft-model", "draft-model"]
    proposals, seconds = scheduler._draft([3, 3, 2], sources, probing=False)
    assert [p.source for p in proposals] == sources
    assert [p.num_tokens for p in proposals] == [3, 3, 2]
    recurring = scheduler.active[0].tokens
    follows = next(recurring[i + 3 : i + 6] for i in range(len(recurring) - 3) if recurring[i : i + 3] == recurring[-3:])
    assert proposals[0].token_ids[0].tolist() == follows  # what followed the context before
    assert set(seconds) == {"suffix-index", "draft-model"}  # each source's drafting is timed apart


def test_a_row_far_behind_drafts_only_where_drafting_wins_its_catch_up_back(target):
    """A new row's first draft feeds its prompt to the draft model: worth it alone, not in a costly batch."""
    scheduler = Scheduler(target, target.model, "draft-model", k="auto", limits=SchedulerLimits(4, 8, 256))
    for prompt, max_new_tokens in zip(PROMPTS[:3] + PROMPTS[4:5], (40, 40, 40, 2)):
        scheduler.submit(target.encode(prompt) * 2, GenerationConfig(max_new_tokens=max_new_tokens))
    scheduler._admit()
    assert all(scheduler.draft.behind(row, s.tokens) > LONG_TAIL for row, s in enumerate(scheduler.active))
    controller = scheduler.controller
    assert controller.catch_up_per_token is not None  # timed before the first step (step_costs)
    controller.catch_up_per_token = None
    assert scheduler._worth_catching_up([True] * 4, [2] * 4) == [True, False, False, False]  # unmeasured: one row
    controller.observe_catch_up(1.0, 100)  # 10 ms a token
    averages = controller._source("draft-model")
    averages.draft_cost = {4: 0.002}
    averages.assume([0.9] * 8, 10)
    controller.verify_cost = {4: 0.1, 12: 0.6}  # verifying 3 tokens a row costs 6x one: drafting saves nothing
    assert scheduler._worth_catching_up([True] * 4, [2] * 4) == [False] * 4
    controller.verify_cost = {4: 0.1, 12: 0.11}  # about the same: drafting saves ~60% of every token
    # ... which wins a catch-up back over 40 tokens, not over the 2 the last row has left
    assert scheduler._worth_catching_up([True, False, True, True], [2, 2, 2, 1]) == [True, False, True, False]


def test_rows_caught_up_in_one_step_each_cover_the_catch_ups_so_far(target):
    """Each row's catch-up stalls the whole batch, and a row's saving is its share of the batch's: rows that would
    each win their catch-up back alone catch up in one step only where each one's share covers the catch-ups so far,
    nearest first (16 chat rows caught up at once cost 1.3 s, ten plain steps, on an Intel Xeon)."""
    scheduler = Scheduler(target, target.model, "draft-model", k="auto", limits=SchedulerLimits(3, 8, 256))
    for _ in range(3):
        scheduler.submit(target.encode(PROMPTS[1]) * 2, GenerationConfig(max_new_tokens=40))
    scheduler._admit()
    assert len(scheduler.active) == 3
    behind = [scheduler.draft.behind(row, s.tokens) for row, s in enumerate(scheduler.active)]
    assert min(behind) > LONG_TAIL
    controller = scheduler.controller
    averages = controller._source("draft-model")
    averages.draft_cost = {3: 0.002}
    averages.assume([0.9] * 8, 10)
    controller.verify_cost = {3: 0.1, 9: 0.11}
    saving = 40 * (1 / controller.expected_rate(0, averages, 3) - 1 / controller.expected_rate(2, averages, 3)) / 3
    controller.catch_up_per_token = 0.6 * saving / behind[0]  # one row's catch-up: 60% of the saving
    assert scheduler._worth_catching_up([True] * 3, [2] * 3) == [True, False, False]
    controller.catch_up_per_token = 0.3 * saving / behind[0]  # three: 90%
    assert scheduler._worth_catching_up([True] * 3, [2] * 3) == [True] * 3


def test_the_catch_up_limit_is_shared_by_the_rows_behind(target, draft):
    """Rows far behind share one catch-up budget a step, the row nearest to caught up first."""
    batched = BatchedDraftModel(draft.model, target.model.vocab_size, max_batch_size=2, capacity=512)
    nearer, further = target.encode(PROMPTS[1]) * 4, target.encode(PROMPTS[1]) * 8
    batched.add(0, further, 512)
    batched.add(1, nearer, 512)
    greedy = [SamplingParams(), SamplingParams()]
    batched.propose([further, nearer], [2, 2], greedy, [None, None], catch_up_limit=20)
    assert batched.catch_up_tokens == 20
    assert batched.behind(1, nearer) == len(nearer) - 20 and batched.behind(0, further) == len(further)


def test_a_probe_catches_its_row_up_even_where_estimates_say_it_cannot_pay(target, monkeypatch):
    """Estimates that refuse every catch-up would keep a row (and every later one) from drafting, so acceptance
    would never be measured again; a probe's row catches up regardless."""
    scheduler = Scheduler(target, target.model, "draft-model", k="auto", limits=SchedulerLimits(2, 8, 256))
    scheduler.submit(target.encode(PROMPTS[1]) * 2, GenerationConfig(max_new_tokens=40))
    scheduler._admit()
    sequence = scheduler.active[0]
    assert scheduler.draft.behind(0, sequence.tokens) > LONG_TAIL
    monkeypatch.setattr(scheduler.controller, "catch_up_pays", lambda *args: False)
    proposals, _ = scheduler._draft([3], ["draft-model"], probing=False)
    assert proposals[0].num_tokens == 0 and scheduler.draft.behind(0, sequence.tokens) > LONG_TAIL
    proposals, _ = scheduler._draft([1], ["draft-model"], probing=True)
    assert proposals[0].num_tokens == 1 and scheduler.draft.behind(0, sequence.tokens) <= LONG_TAIL


def test_a_probe_far_behind_feeds_only_a_window_and_drafting_on_from_it_stays_exact(target):
    """A probe's row far behind restarts its draft cache from the latest PROBE_WINDOW tokens (its cost bounded
    however long the text); drafting on from that window keeps the output plain decoding's, and the row's draft
    cache follows the committed tokens past the part it skipped."""
    from verispec.core.drafting import PROBE_WINDOW

    prompt = target.encode(PROMPTS[1]) * 6
    assert len(prompt) > 3 * PROBE_WINDOW
    scheduler = Scheduler(target, target.model, "draft-model", k="auto", limits=SchedulerLimits(2, 8, 256))
    handle = scheduler.submit(prompt, GenerationConfig(max_new_tokens=30))
    scheduler._admit()
    sequence = scheduler.active[0]
    proposals, _ = scheduler._draft([1], ["draft-model"], probing=True)
    assert proposals[0].num_tokens == 1
    assert scheduler.draft.catch_up_tokens < PROBE_WINDOW  # not the prompt's hundreds
    assert scheduler.draft.skipped[0] == len(sequence.tokens) - PROBE_WINDOW
    scheduler.k = 3  # draft on from the window
    skipped = scheduler.draft.skipped[0]
    while scheduler.run_once():
        if scheduler.active:  # the row's draft cache agrees with the committed tokens after the skipped ones but
            # the newest few (the next proposal's sync rolls back rejected drafts; it is what this call does)
            tail = scheduler.draft._sync(0, sequence.tokens)
            assert 1 <= len(tail) <= 4 and scheduler.draft.cached_tokens[0] == sequence.tokens[skipped : -len(tail)]
    events = list(handle.iter_events())
    assert [t for e in events for t in e.token_ids] == plain_tokens(target, prompt, 30)
    assert events[-1].stats.drafted_tokens > 30  # it drafted on (k = 3 a step)


def test_build_scheduler_loads_the_composite_drafters_model(tiny_dir, other_tiny_dir):
    from verispec.serving.scheduler import build_scheduler

    limits = SchedulerLimits(2, 4, 128)
    scheduler = build_scheduler(str(tiny_dir), str(other_tiny_dir), "composite", "float32", "none", limits=limits)
    assert scheduler.draft is not None and scheduler.drafter == "composite"
    assert build_scheduler(str(tiny_dir), None, "suffix-index", "float32", limits=limits).draft is None
    with pytest.raises(ValueError, match="'composite' needs a draft model: pass --draft"):
        build_scheduler(str(tiny_dir), "none", "composite", "float32", limits=limits)


def test_sampled_rows_use_their_own_settings(target, draft):
    """A greedy row batched with sampled rows still gets its plain output; sampled rows stop at their lengths."""
    configs = [
        GenerationConfig(max_new_tokens=20, sampling=SamplingParams(temperature=1.0), seed=s) for s in range(3)
    ] + [GenerationConfig(max_new_tokens=25)]
    scheduler = Scheduler(target, draft.model, "draft-model", k=2, limits=SchedulerLimits(max_batch_size=4, max_context=256))
    events = run_all(scheduler, PROMPTS[:4], configs)
    assert [t for e in events[3] for t in e.token_ids] == plain_tokens(target, PROMPTS[3], 25)
    for prompt_events in events[:3]:
        assert prompt_events[-1].finish_reason in ("length", "stop")
        assert prompt_events[-1].stats.completion_tokens <= 20


def test_stop_strings_and_cancel(target):
    full = target.decode(plain_tokens(target, PROMPTS[0], 30))
    stop = full[5:8]
    scheduler = Scheduler(target, None, "prompt-lookup", limits=SchedulerLimits(max_batch_size=2, max_context=256))
    handles = [
        scheduler.submit(target.encode(PROMPTS[0]), GenerationConfig(max_new_tokens=30, stop_strings=(stop,))),
        scheduler.submit(target.encode(PROMPTS[1]), GenerationConfig(max_new_tokens=200)),
    ]
    handles[1].cancel()
    scheduler.start()
    try:
        stopped = list(handles[0].iter_events())
        cancelled = list(handles[1].iter_events())
    finally:
        scheduler.stop()
    assert "".join(e.text for e in stopped) == full[: full.index(stop)]
    assert stopped[-1].finish_reason == "stop"
    assert cancelled[-1].finish_reason == "cancelled"
    assert scheduler.num_active == 0


def test_limits_are_enforced(target):
    scheduler = Scheduler(target, None, "none", limits=SchedulerLimits(max_batch_size=1, max_waiting=2, max_context=64))
    with pytest.raises(ValueError, match="exceeds the server's context of 64"):
        scheduler.submit(list(range(60)), GenerationConfig(max_new_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        scheduler.submit([], GenerationConfig(max_new_tokens=10))
    for _ in range(3):  # one for the free row, two waiting
        scheduler.submit([1, 2], GenerationConfig(max_new_tokens=4))
    with pytest.raises(QueueFullError):
        scheduler.submit([1, 2], GenerationConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="max_context"):
        Scheduler(target, None, "none", limits=SchedulerLimits(max_context=100_000))
    with pytest.raises(ValueError, match="needs a draft model"):
        Scheduler(target, None, "draft-model")
    with pytest.raises(ValueError, match="needs a draft model"):
        Scheduler(target, None, "composite")
    with pytest.raises(ValueError, match="uses no draft model"):
        Scheduler(target, target.model, "suffix-index")
    for bad, match in (({"k": -1}, "k \\(draft tokens per step\\)"), ({"k_max": 0}, "k_max"),
                       ({"draft_p_min": -0.1}, "draft_p_min is a probability")):
        with pytest.raises(ValueError, match=match):  # the scheduler's own settings, as a request's are checked
            Scheduler(target, None, "suffix-index", **bad)


def test_controller_speculates_less_when_verification_gets_expensive():
    """With verify cost growing with tokens in the pass, the same acceptance buys a smaller k at batch 16."""
    from verispec.policy import AdaptiveController, ControllerSettings

    controller = AdaptiveController(ControllerSettings(k_max=8))
    for tokens in (1, 2, 4, 8, 16, 32, 64, 128, 144):
        controller.verify_cost[tokens] = 0.2 if tokens <= 8 else 0.2 + 0.012 * (tokens - 8)
    controller.plain_batches.add(16)
    averages = controller._source("draft-model")
    averages.assume([0.8] * 8, 10)
    averages.draft_cost = {1: 0.02, 16: 0.06}
    controller.recent_sources["draft-model"] = 1
    k_single, k_batch = controller.choose_k(1), controller.choose_k(16)
    assert k_single >= 4
    assert k_batch < k_single


def test_batched_draft_rows_match_the_single_request_drafter(target, draft):
    """Same proposals as DraftModelDrafter per row, across rejections (rollback), rows sitting steps out
    (lazy catch-up, long tails) and row moves."""
    prompts = [target.encode(p) for p in PROMPTS[:3]]
    batched = BatchedDraftModel(draft.model, target.model.vocab_size, max_batch_size=3, capacity=128)
    singles = [DraftModelDrafter(draft.model, target.model.vocab_size) for _ in prompts]
    sequences = [list(p) for p in prompts]
    for row, (prompt, single) in enumerate(zip(prompts, singles)):
        batched.add(row, prompt, 128)
        single.begin(prompt, 128)
    greedy = SamplingParams()
    plain_steps = target.encode("def greet(name):\n    print('hello ' + name)\n")  # longer than LONG_TAIL
    for step in range(6):
        drafting = [not (step == 1 and b == 0) for b in range(len(sequences))]  # row 0 sits step 1 out
        proposals = batched.propose(sequences, [3 if d else 0 for d in drafting], [greedy] * len(sequences), [None] * len(sequences))
        for b, (sequence, single) in enumerate(zip(sequences, singles)):
            if not drafting[b]:
                assert proposals[b].num_tokens == 0
                sequence.extend(plain_steps[:3])  # plain steps meanwhile
                continue
            want = single.propose(sequence, 3, greedy, None).token_ids
            assert torch.equal(proposals[b].token_ids, want)
            # Keep a different number of drafts per row, then a token the draft did not propose.
            keep = (step + b) % 4
            sequence.extend(want[0, :keep].tolist() + [(int(want[0, min(keep, 2)]) + 1) % target.model.vocab_size])
            if step == 1 and b == 1:
                sequence.extend(plain_steps)
        if step == 3:  # the first sequence leaves: the others move down a row, as in the scheduler
            batched.move(1, 0)
            batched.move(2, 1)
            sequences, singles = sequences[1:], singles[1:]


def test_a_row_stops_drafting_where_its_draft_is_unsure(target, draft):
    """With min_confidence (draft p-min), each row's chain ends before the first position whose draft top probability
    is below it: the rest of its whole-k chain, unchanged before that; a row unsure at once proposes nothing, and the
    batch stops drafting once every row has stopped."""
    prompts = [target.encode(p) for p in PROMPTS[:3]]
    k = 5

    def chains(min_confidence: float):
        batched = BatchedDraftModel(draft.model, target.model.vocab_size, max_batch_size=3, capacity=128)
        batched.min_confidence = min_confidence
        for row, prompt in enumerate(prompts):
            batched.add(row, prompt, 128)
        proposals = batched.propose([list(p) for p in prompts], [k] * 3, [SamplingParams()] * 3, [None] * 3)
        return [p.token_ids[0].tolist() for p in proposals], max(p.forwards for p in proposals)

    whole, forwards = chains(0.0)
    assert [len(chain) for chain in whole] == [k] * 3 and forwards == k
    tops = []  # the draft's top probability before each drafted token, by row
    for prompt, chain in zip(prompts, whole):
        logits = draft.model.forward(torch.tensor([prompt + chain]), draft.model.new_cache(1, len(prompt) + k + 1))
        tops.append(torch.softmax(logits[0, len(prompt) - 1 : -1].float(), -1).max(-1).values.tolist())
    threshold = sorted(p for row in tops for p in row)[len(tops) * k // 2]  # half the positions fall below it
    wanted = [next((i for i, p in enumerate(row) if p < threshold), k) for row in tops]
    assert len(set(wanted)) > 1  # rows stop at different positions
    stopped, forwards = chains(threshold)
    assert stopped == [chain[:n] for chain, n in zip(whole, wanted)]
    assert forwards == max(wanted) + (max(wanted) < k)  # the position found unsure was drafted, then no more
    nothing, forwards = chains(1.01)
    assert nothing == [[]] * 3 and forwards == 1  # the first position was drafted, and found unsure everywhere


def test_a_probe_in_a_big_batch_does_not_fill_stale_draft_caches(target, draft, monkeypatch):
    """After plain steps, a k = 1 probe asks only rows whose draft cache is current."""
    scheduler = Scheduler(target, draft.model, "draft-model", k="auto", limits=SchedulerLimits(4, 8, 256))
    for prompt in PROMPTS[:4]:
        scheduler.submit(target.encode(prompt), GenerationConfig(max_new_tokens=40))
    scheduler._admit()
    for sequence in scheduler.active:  # as if 20 plain steps had passed: nobody's draft cache is current
        sequence.tokens.extend([5] * 20)
    proposals, _ = scheduler._draft([1, 1, 1, 1], ["draft-model"] * 4, probing=True)
    assert [p.num_tokens for p in proposals] == [1, 0, 0, 0]  # one row catches up and probes, not all
    assert scheduler.draft.behind(0, scheduler.active[0].tokens) == 0
    assert scheduler.draft.behind(1, scheduler.active[1].tokens) > 8


def test_stop_ends_every_request_and_refuses_new_ones(target):
    scheduler = Scheduler(target, None, "none", limits=SchedulerLimits(max_batch_size=1, max_context=400))
    handles = [scheduler.submit([1, 2, 3], GenerationConfig(max_new_tokens=300)) for _ in range(3)]
    scheduler.start()
    first = handles[0].iter_events()
    next(first)  # the first request is decoding, the others wait
    scheduler.stop()
    assert list(first)[-1].finish_reason == "error"
    for handle in handles[1:]:
        assert list(handle.iter_events())[-1].finish_reason == "error"
    with pytest.raises(RuntimeError, match="not running"):
        scheduler.submit([1, 2], GenerationConfig(max_new_tokens=4))


def test_a_step_that_ends_every_row_leaves_no_idle_turn_while_prompts_wait(target):
    """Rows that all finish in one step, with prompts still queued: the model thread's turn says there is
    more to do, so it admits them at once instead of sleeping until a new request wakes it (it slept 0.5 s
    a batch, and a burst of equal-length requests ran at a fraction of its speed)."""
    scheduler = Scheduler(target, None, "none", limits=SchedulerLimits(max_batch_size=2, max_waiting=8, max_context=64))
    handles = [scheduler.submit([1, 2, 3 + i], GenerationConfig(max_new_tokens=1)) for i in range(5)]
    turns = []
    while not turns or turns[-1]:
        turns.append(scheduler.run_once())
        assert len(turns) < 10
    assert turns == [True, True, False]  # 2 rows, 2 rows, then the last row: each ends in its first step
    for handle in handles:  # every request got its one token and its finish reason
        events = list(handle.iter_events())
        assert sum(len(e.token_ids) for e in events) == 1 and events[-1].finish_reason == "length"


def test_cancelled_waiting_requests_free_their_queue_slots(target):
    scheduler = Scheduler(target, None, "none", limits=SchedulerLimits(max_batch_size=1, max_waiting=1, max_context=400))
    busy = scheduler.submit([1, 2, 3], GenerationConfig(max_new_tokens=300))
    waiting = scheduler.submit([1, 2, 3], GenerationConfig(max_new_tokens=4))  # a free row is counted as room
    with pytest.raises(QueueFullError):
        scheduler.submit([1, 2], GenerationConfig(max_new_tokens=4))
    waiting.cancel()
    scheduler.submit([1, 2], GenerationConfig(max_new_tokens=4))
    busy.cancel()
    scheduler.start()
    try:
        assert list(waiting.iter_events())[-1].finish_reason == "cancelled"
        assert list(busy.iter_events())[-1].finish_reason == "cancelled"
    finally:
        scheduler.stop()


def batched_two_token_counts(target, draft, prompt_ids, sampling, runs: int, k) -> Counter:
    """First two sampled tokens of `runs` requests decoded 16 at a time by the scheduler."""
    scheduler = Scheduler(target, draft.model, "draft-model", k=k, limits=SchedulerLimits(16, runs, 256))
    handles = [
        scheduler.submit(prompt_ids, GenerationConfig(max_new_tokens=2, sampling=sampling, seed=seed, eos_token_ids=()))
        for seed in range(runs)
    ]
    scheduler.start()
    try:
        return Counter(tuple(t for e in h.iter_events() for t in e.token_ids) for h in handles)
    finally:
        scheduler.stop()


@pytest.mark.parametrize("k", [3, "auto"])
def test_batched_sampling_follows_the_target_distribution(target, draft, repeating_prompt, k):
    """Rows verified together, each with its own q and generator, still emit plain decoding's exact law."""
    from laws import exact_two_token_law, law_matches

    sampling = SamplingParams(temperature=1.0, top_k=20)
    prompt_ids = target.encode(repeating_prompt)
    law = exact_two_token_law(target, prompt_ids, sampling)
    runs = 1500
    assert law_matches(batched_two_token_counts(target, draft, prompt_ids, sampling, runs, k), law, runs)


def test_negative_control_accept_all_in_the_batch_fails(target, draft, repeating_prompt, monkeypatch):
    from laws import accept_all, exact_two_token_law, law_matches

    import verispec.core.step as step_module

    monkeypatch.setattr(step_module, "verify", accept_all)
    sampling = SamplingParams(temperature=1.0, top_k=20)
    prompt_ids = target.encode(repeating_prompt)
    law = exact_two_token_law(target, prompt_ids, sampling)
    runs = 1500
    assert not law_matches(batched_two_token_counts(target, draft, prompt_ids, sampling, runs, 3), law, runs)


def test_the_model_thread_loads_the_models_and_runs_every_step(target):
    """start_in_model_thread: build() and every decoding step in one thread, not the caller's."""
    import threading

    from verispec.serving.scheduler import start_in_model_thread

    seen: dict[str, set[int]] = {"build": set(), "step": set()}

    def build() -> Scheduler:
        seen["build"].add(threading.get_ident())
        scheduler = Scheduler(target, limits=SchedulerLimits(max_batch_size=2, max_context=128))
        scheduler.step_observers.append(lambda record: seen["step"].add(threading.get_ident()))
        return scheduler

    scheduler = start_in_model_thread(build)
    try:
        assert scheduler.healthy
        events = list(scheduler.submit(target.encode("def add("), GenerationConfig(max_new_tokens=5)).iter_events())
    finally:
        scheduler.stop()
    assert sum(len(e.token_ids) for e in events) == 5
    assert len(seen["build"]) == 1 and seen["step"] == seen["build"]
    assert threading.get_ident() not in seen["step"]
    assert not scheduler.healthy  # stopped: the model thread has ended


def test_a_failed_load_in_the_model_thread_is_raised_to_the_caller():
    from verispec.serving.scheduler import start_in_model_thread

    def build() -> Scheduler:
        raise FileNotFoundError("model 'nope' is neither a catalog name nor an existing file or directory")

    with pytest.raises(FileNotFoundError, match="nope"):
        start_in_model_thread(build)


def test_a_row_far_behind_catches_up_in_pieces_while_the_others_draft(target, draft):
    """With a catch-up limit, a new prompt goes into the draft cache over several steps (no stall for the others)."""
    batched = BatchedDraftModel(draft.model, target.model.vocab_size, max_batch_size=2, capacity=512)
    short, long = target.encode(PROMPTS[3]), target.encode(PROMPTS[1]) * 8  # LONG_TAIL < len(long)
    assert len(short) <= LONG_TAIL < len(long) - 40
    batched.add(0, short, 512)
    batched.add(1, long, 512)
    greedy = [SamplingParams(), SamplingParams()]
    steps = 0
    while True:
        proposals = batched.propose([short, long], [2, 2], greedy, [None, None], catch_up_limit=20)
        assert proposals[0].num_tokens == 2  # the current row drafts every step
        if proposals[1].num_tokens:
            break
        assert batched.catch_up_tokens == 20 and batched.behind(1, long) > LONG_TAIL
        steps += 1
    assert steps == math.ceil((len(long) - LONG_TAIL) / 20) - 1 and steps >= 2  # 20 a step until LONG_TAIL are left
    assert proposals[1].num_tokens == 2 and batched.behind(1, long) == 0
    alone = BatchedDraftModel(draft.model, target.model.vocab_size, max_batch_size=1, capacity=512)
    alone.add(0, long, 512)
    assert alone.propose([long], [2], greedy[:1], [None])[0].num_tokens == 2  # no limit: at once
    assert alone.catch_up_tokens == len(long) - 1


@pytest.mark.parametrize("drafter", ["draft-model", "composite"])
def test_choices_of_one_request_share_its_prefill_and_each_equals_a_single_request(target, draft, drafter):
    """n choices: the prompt goes in once (no prefix cache here: the others copy its rows, target and draft);
    greedy choices equal plain decoding; sampled choices (seeds 7, 8, 9) differ and repeat run to run.
    (Alone, a sampled choice may differ: a batch of another size rounds its scores differently.)"""
    prompt = PROMPTS[1]
    limits = SchedulerLimits(max_batch_size=4, max_context=256, prefix_cache_bytes=0)
    sampled = SamplingParams(temperature=1.0)

    def choices(configs: list[GenerationConfig]) -> list[list]:
        scheduler = Scheduler(target, draft.model, drafter, k=3, limits=limits)
        handles = scheduler.submit_choices(target.encode(prompt), configs)
        scheduler.start()
        try:
            return [list(handle.iter_events()) for handle in handles]
        finally:
            scheduler.stop()

    greedy = choices([GenerationConfig(max_new_tokens=30)] * 3)
    want = plain_tokens(target, prompt, 30)
    for events in greedy:
        assert [t for e in events for t in e.token_ids] == want
    prompt_length = len(target.encode(prompt))
    assert [events[-1].stats.cached_prompt_tokens for events in greedy] == [0, prompt_length - 1, prompt_length - 1]
    assert all(events[-1].stats.drafted_tokens > 0 for events in greedy)

    configs = [GenerationConfig(max_new_tokens=20, sampling=sampled, seed=7 + i) for i in range(3)]
    outputs, again = ([[t for e in events for t in e.token_ids] for events in choices(configs)] for _ in range(2))
    assert outputs == again
    assert len({tuple(o) for o in outputs}) > 1  # different seeds, different samples


def test_too_many_choices_for_the_batch_or_queue_are_refused_whole(target):
    scheduler = Scheduler(target, limits=SchedulerLimits(max_batch_size=2, max_waiting=1, max_context=64))
    with pytest.raises(ValueError, match="exceed the batch"):
        scheduler.submit_choices(target.encode("x"), [GenerationConfig(max_new_tokens=4)] * 3)
    scheduler.submit_choices(target.encode("x"), [GenerationConfig(max_new_tokens=4)] * 2)
    with pytest.raises(QueueFullError):
        scheduler.submit_choices(target.encode("x"), [GenerationConfig(max_new_tokens=4)] * 2)
    assert scheduler.num_waiting == 2  # the refused request queued none of its choices


@pytest.mark.parametrize("quantize", ["none", "w4a8"])  # padded verify rows (float32), packed rows (batch-invariant)
@pytest.mark.parametrize("drafter", ["draft-model", "composite"])
def test_k_per_sequence_keeps_batched_greedy_equal_to_single_requests(tiny_dir, draft, drafter, quantize, monkeypatch):
    loaded = target_in(tiny_dir, quantize)
    lengths = [24, 7, 31, 16, 40, 1]
    expected = [plain_tokens(loaded, p, n) for p, n in zip(PROMPTS, lengths)]
    draft_model = loaded.model if drafter == "draft-model" else draft.model  # a self-draft agrees: rows draft long
    scheduler = Scheduler(loaded, draft_model, drafter, k="auto", limits=SchedulerLimits(4, 8, 256), k_per_sequence=True)
    # A drafter as costly as the target never pays here, so the source's k is forced; the rows' own k then differ
    # (what choose_row_ks gives is tested in test_policy), and the verify pass has rows of every width.
    monkeypatch.setattr(scheduler.controller, "choose_k", lambda *args: 3)
    monkeypatch.setattr(scheduler.controller, "still_pays", lambda *args: True)
    given = []

    def choose_row_ks(batch_size, source, acceptance, others, caps):
        given.append([min(cap, (3, 1, 0, 2)[r % 4]) for r, cap in enumerate(caps)])
        return given[-1]

    monkeypatch.setattr(scheduler.controller, "choose_row_ks", choose_row_ks)
    widths = []
    verify = scheduler.target.model.forward_packed if quantize == "w4a8" else None
    if verify is not None:
        monkeypatch.setattr(
            scheduler.target.model, "forward_packed",
            lambda rows, *a, **kw: widths.append([len(r) for r in rows]) or verify(rows, *a, **kw),
        )
    events = run_all(scheduler, PROMPTS, [GenerationConfig(max_new_tokens=n) for n in lengths])
    assert [[t for e in evs for t in e.token_ids] for evs in events] == expected
    assert any(len(set(ks)) > 2 for ks in given)
    assert verify is None or any(len(set(w)) > 2 for w in widths)  # packed rows of their own widths
    assert sum(e[-1].stats.drafted_tokens for e in events) > 0


def target_in(tiny_dir, quantize: str):
    return load_model(str(tiny_dir), "float32" if quantize == "none" else "bfloat16", quantize=quantize)


def test_k_per_sequence_sampling_follows_the_target_distribution(target, draft, repeating_prompt):
    from laws import exact_two_token_law, law_matches

    sampling = SamplingParams(temperature=1.0, top_k=20)
    prompt_ids = target.encode(repeating_prompt)
    law = exact_two_token_law(target, prompt_ids, sampling)
    runs = 1500
    scheduler = Scheduler(target, draft.model, "draft-model", k="auto", limits=SchedulerLimits(16, runs, 256),
                          k_per_sequence=True)
    handles = [
        scheduler.submit(prompt_ids, GenerationConfig(max_new_tokens=2, sampling=sampling, seed=seed, eos_token_ids=()))
        for seed in range(runs)
    ]
    scheduler.start()
    try:
        counts = Counter(tuple(t for e in h.iter_events() for t in e.token_ids) for h in handles)
    finally:
        scheduler.stop()
    assert law_matches(counts, law, runs)


def test_cross_tokenizer_sequences_draft_with_their_own_drafter_and_equal_single_requests(tiny_dir, tiny_llama_dir):
    """The server's cross-tokenizer drafter: one shared draft model, each sequence its own re-encoding drafter."""
    from verispec.serving.scheduler import build_scheduler

    scheduler = build_scheduler(
        str(tiny_dir), str(tiny_llama_dir), "cross-tokenizer", "float32", draft_quantize="none", k=3,
        limits=SchedulerLimits(max_batch_size=3, max_context=256),
    )
    lengths = [20, 12, 25, 9]
    events = run_all(scheduler, PROMPTS[:4], [GenerationConfig(max_new_tokens=n) for n in lengths])
    for prompt, n, prompt_events in zip(PROMPTS, lengths, events):
        assert [t for e in prompt_events for t in e.token_ids] == plain_tokens(scheduler.target, prompt, n)
        assert prompt_events[-1].finish_reason == "length"
    assert sum(e[-1].stats.drafted_tokens for e in events) > 0
    assert {source for e in events for source in e[-1].stats.steps_by_drafter} == {"cross-tokenizer"}


def test_a_batched_step_is_one_forward_observation(target, monkeypatch):
    """The rows of a step share one forward: it is one observation of what a forward over that many tokens costs
    (observed once per row, the newest forward of 16 rows weighed 93% and one slow forward set the price)."""
    scheduler = Scheduler(target, target.model, "draft-model", k=0, limits=SchedulerLimits(4, 8, 256))
    for prompt in PROMPTS[:4]:
        scheduler.submit(target.encode(prompt), GenerationConfig(max_new_tokens=8))
    forwards = []
    observe_forward = scheduler.controller.observe_forward

    def recorded(tokens: int, seconds: float, rows: int = 1) -> None:
        forwards.append((tokens, rows))
        observe_forward(tokens, seconds, rows)

    monkeypatch.setattr(scheduler.controller, "observe_forward", recorded)
    scheduler._admit()
    assert len(scheduler.active) == 4
    scheduler._step()
    assert forwards == [(4, 4)]
    assert 4 in scheduler.controller.plain_batches


def composite_with_counted_lookups(target, monkeypatch) -> tuple[Scheduler, list[int]]:
    """A composite auto-k scheduler with three rows admitted, and a list that grows by one each time a row's lookup
    is asked whether it can propose."""
    from verispec.drafters.suffix_index import SuffixIndexDrafter

    scheduler = Scheduler(target, target.model, "composite", k="auto", limits=SchedulerLimits(3, 8, 256))
    for prompt in (PROMPTS[4], PROMPTS[1], PROMPTS[2]):  # PROMPTS[4] ends in a context it had before
        scheduler.submit(target.encode(prompt), GenerationConfig(max_new_tokens=40))
    scheduler._admit()
    asked: list[int] = []
    can_propose = SuffixIndexDrafter.can_propose

    def counted(self, tokens: list[int]) -> bool:
        asked.append(1)
        return can_propose(self, tokens)

    monkeypatch.setattr(SuffixIndexDrafter, "can_propose", counted)
    return scheduler, asked


def test_lookups_are_not_asked_where_the_controller_plans_no_lookup_draft(target, monkeypatch):
    """A composite's rows go to its batched drafter without asking their lookups where the controller would not have
    the lookups draft even for every row (indexing each row's text for nothing cost 1.2% of a 16-client chat server's
    steps); where it would, each row's lookup is asked as before."""
    scheduler, asked = composite_with_counted_lookups(target, monkeypatch)
    controller = scheduler.controller
    lookup = controller._source("suffix-index")
    lookup.draft_cost = {3: 1e-5}
    controller.verify_cost = {3: 0.1, 6: 0.6, 9: 1.2, 27: 6.0}  # a token more a row costs 6x: no draft can pay
    assert controller.planned_k(3, "suffix-index") == 0
    scheduler._step()
    assert asked == []
    assert all(not s.stats.drafted_tokens for s in scheduler.active)
    controller.verify_cost = {3: 0.1, 6: 0.101, 9: 0.102, 27: 0.11}  # about free: the lookup's 70% pays
    lookup.assume([0.9] * 8, 10)
    assert controller.planned_k(3, "suffix-index") > 0
    scheduler._step()
    assert len(asked) == 3


def test_lookups_are_planned_for_as_many_rows_as_last_found_a_recurring_context(target, monkeypatch):
    """Planned as if every row drafted by lookup, a 15-row chat step asked each row's lookup and indexed its backlog
    (42 ms on average on a Xeon) where about one row in ten found a recurring context. The plan takes the share of
    rows that found one when the lookups were last asked; LOOKUP_SHARE_STEPS steps later, every row again."""
    scheduler, asked = composite_with_counted_lookups(target, monkeypatch)
    controller = scheduler.controller
    lookup = controller._source("suffix-index")

    def step(verify_cost: dict[int, float]) -> int:
        """One step under these costs (the step's own timings replace them after it); the lookups asked."""
        asked.clear()
        lookup.draft_cost = {3: 1e-5}
        lookup.assume([0.9] * 8, 10)
        controller.verify_cost = dict(verify_cost)
        scheduler._step()
        return len(asked)

    assert step({3: 0.1, 6: 0.6, 9: 1.2, 27: 6.0}) == 0  # no draft can pay: a plain step at 3 rows, measured
    pays_for_all_rows = {3: 0.1, 6: 0.15, 9: 0.2, 27: 0.5}  # every row drafting pays; one of three does not
    controller.verify_cost = pays_for_all_rows
    assert controller.planned_k(3, "suffix-index") > 0 and controller.planned_k(3, "suffix-index", 1) == 0
    assert step(pays_for_all_rows) == 3  # never asked before: planned for every row
    assert scheduler._lookup_share <= 1 / 3  # no row, or PROMPTS[4]'s, found a recurring context
    assert step(pays_for_all_rows) == 0  # so the plan is for one row, which does not pay
    scheduler._steps_since_lookups = drafting_module.LOOKUP_SHARE_STEPS
    assert step(pays_for_all_rows) == 3


def test_step_costs_remembered_from_a_loaded_moment_are_forgotten_and_do_not_stop_drafting(target, monkeypatch):
    """Remembered step costs timed while the machine was busy (every forward 20x its cost, the draft 50x) had a server
    never draft. The first step finds the seeds stale: the controller drops the draft's seed and the record is
    forgotten, so the next start times them again."""
    import verispec.core.scheduler as scheduler_module
    import verispec.core.step as step_module

    def loaded_moment(target, draft=None):
        return {"verify": {1: 1.1, 2: 1.1, 4: 1.5, 8: 1.5}, "draft": 0.95, "catch_up_per_token": 0.07,
                "remembered": "step costs | a loaded moment"}

    forgotten = []
    monkeypatch.setattr(scheduler_module, "step_costs", loaded_moment)
    monkeypatch.setattr(step_module, "forget_choice", forgotten.append)
    scheduler = Scheduler(target, target.model, "draft-model", k="auto", limits=SchedulerLimits(1, 8, 256))
    assert scheduler.controller.planned_k(1, "draft-model") == 0  # as seeded, a draft could never pay
    events = run_all(scheduler, PROMPTS[:1], [GenerationConfig(max_new_tokens=24)])
    assert forgotten == ["step costs | a loaded moment"]
    assert scheduler.controller.stale_seed is not None and scheduler.controller.stale_seed < 0.5
    assert events[0][-1].stats.drafted_tokens > 0  # a self-draft agrees: once its seed is gone it is tried
