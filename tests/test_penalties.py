"""Penalties and logit_bias (verispec.sampling.transform_scores) keep speculation lossless.

The transforms are checked against independent references (Hugging Face's repetition-penalty processor,
OpenAI's frequency / presence formula written out). Then, for each transform, the exact law of a short
sampled completion is enumerated with plain forwards, one prefix at a time, and speculative runs must
follow it: the library engine with a draft model (its q penalized too) and with prompt lookup, and the
scheduler's batched draft. Negative control: a transform that ignores the drafts before a verified
position (every row scored as if only the committed tokens came before) must fail.
"""

from __future__ import annotations

import pytest
import torch

import verispec.sampling as sampling
from laws import frequency_mismatch
from verispec.drafters import DraftModelDrafter, PromptLookupDrafter
from verispec.engine import GenerationConfig, SpeculativeEngine
from verispec.models.loading import load_model
from verispec.sampling import SamplingParams, TokenHistory, logits_to_probs, transform_scores
from verispec.serving.scheduler import Scheduler, SchedulerLimits

PROMPT = "def add(a, b):\n    return a + b\n\ndef add("
LENGTH = 3  # new tokens per sampled completion
NUM_RUNS = 2000
BASE = dict(temperature=1.0, top_k=3)  # three tokens per position: 27 completions at most
TRANSFORMS = {
    "presence": dict(presence_penalty=-2.0),  # negative: repeats are encouraged, so the law moves a lot
    "frequency": dict(frequency_penalty=-1.5),
    "repetition": dict(repetition_penalty=0.25),
    "logit_bias": dict(logit_bias=((5, 4.0), (17, -100.0), (40, 3.0))),
}


@pytest.fixture(scope="module")
def draft(other_tiny_dir):
    return load_model(str(other_tiny_dir), "float32")


def test_repetition_penalty_matches_hugging_face():
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    scores = torch.randn(1, 50) * 3
    tokens = [3, 7, 7, 11, 40, 3, 9]
    params = SamplingParams(temperature=1.0, repetition_penalty=1.7)
    ours = transform_scores(scores, params, TokenHistory(tokens, prompt_length=4))
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([tokens]), scores.clone())
    assert torch.allclose(ours, theirs)


def test_frequency_and_presence_follow_openai_on_generated_tokens_only():
    torch.manual_seed(1)
    scores = torch.randn(50)
    prompt, generated = [1, 2, 2], [2, 5, 5, 5, 9]
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    ours = transform_scores(scores, params, TokenHistory(prompt + generated, len(prompt)))
    expected = scores.clone()
    for token in set(generated):
        expected[token] -= 0.25 * generated.count(token) + 0.5
    assert torch.allclose(ours, expected)
    assert ours[1] == scores[1]  # in the prompt only: OpenAI's penalties count generated tokens


def test_rows_along_drafts_equal_one_row_after_each_prefix():
    """Row t of a verify block scores what plain decoding would after the first t drafts."""
    torch.manual_seed(2)
    prompt, committed, drafts = [4, 4, 8], [8, 3], [3, 3, 8, 12]
    block = torch.randn(len(drafts) + 1, 60)
    for extra in TRANSFORMS.values():
        params = SamplingParams(**BASE, **{"presence_penalty": 0.3, **extra})
        rows = transform_scores(block, params, TokenHistory(prompt + committed + drafts, len(prompt)))
        for t in range(len(drafts) + 1):
            alone = transform_scores(block[t], params, TokenHistory(prompt + committed + drafts[:t], len(prompt)))
            assert torch.equal(rows[t], alone)


def test_logit_bias_adds_and_bans():
    scores = torch.zeros(10)
    probs = logits_to_probs(scores, SamplingParams(temperature=1.0, logit_bias=((2, -100.0), (3, 2.0))))
    assert probs[2] < 1e-40 and probs[3] > probs[4] * 7
    greedy = logits_to_probs(scores, SamplingParams(logit_bias=((7, 1.0),)))
    assert int(greedy.argmax()) == 7 and greedy.sum() == 1
    assert torch.equal(scores, torch.zeros(10))  # the caller's scores are not changed in place


def test_penalties_without_history_are_an_error_not_a_silent_skip():
    with pytest.raises(ValueError, match="TokenHistory"):
        logits_to_probs(torch.zeros(10), SamplingParams(frequency_penalty=1.0))


@pytest.mark.parametrize("bad, message", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(logit_bias=((-1, 1.0),)), "token ids"),
    (dict(logit_bias=((3, 101.0),)), r"\[-100, 100\]"),
])
def test_bad_penalty_settings_are_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def exact_law(target, prompt_ids: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Probability of every completion (LENGTH tokens, or fewer ending in eos) under plain decoding."""
    model = target.model
    law: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], mass: float) -> None:
        ids = prompt_ids + prefix
        logits = model.forward(torch.tensor([ids]), model.new_cache(1, len(ids) + 1))[0, -1]  # (V,)
        p = logits_to_probs(logits, params, history=TokenHistory(ids, len(prompt_ids)))  # (V,)
        for token in p.nonzero().flatten().tolist():
            completion = prefix + [token]
            if token in target.eos_token_ids or len(completion) == LENGTH:
                law[tuple(completion)] = mass * float(p[token])
            else:
                walk(completion, mass * float(p[token]))

    walk([], 1.0)
    return law


def mismatch(law: dict[tuple[int, ...], float], outputs: list[tuple[int, ...]]) -> str | None:
    completions = sorted(law)
    index = {c: i for i, c in enumerate(completions)}
    probs = torch.tensor([law[c] for c in completions] + [0.0], dtype=torch.float64)  # last: outside the law
    return frequency_mismatch(torch.tensor([index.get(o, len(completions)) for o in outputs]), probs / probs.sum())


def engine_outputs(target, drafter, params: SamplingParams, k: int = 2) -> list[tuple[int, ...]]:
    engine = SpeculativeEngine(target, drafter)
    return [
        tuple(engine.generate(PROMPT, GenerationConfig(max_new_tokens=LENGTH, sampling=params, seed=seed, k=k)).token_ids)
        for seed in range(NUM_RUNS)
    ]


def scheduler_outputs(target, draft, params: SamplingParams, k: int = 2) -> list[tuple[int, ...]]:
    limits = SchedulerLimits(max_batch_size=16, max_waiting=NUM_RUNS, max_context=128)
    scheduler = Scheduler(target, draft.model, "draft-model", k=k, limits=limits)
    handles = [scheduler.submit(target.encode(PROMPT), GenerationConfig(max_new_tokens=LENGTH, sampling=params,
                                                                          seed=seed)) for seed in range(NUM_RUNS)]
    scheduler.start()
    try:
        return [tuple(t for event in handle.iter_events() for t in event.token_ids) for handle in handles]
    finally:
        scheduler.stop()


@pytest.fixture(scope="module")
def laws(target):
    prompt_ids = target.encode(PROMPT)
    laws = {name: exact_law(target, prompt_ids, SamplingParams(**BASE, **extra)) for name, extra in TRANSFORMS.items()}
    plain = exact_law(target, prompt_ids, SamplingParams(**BASE))
    for name, law in laws.items():
        assert abs(sum(law.values()) - 1) < 1e-6
        assert law != plain, f"{name} must change the law, or the test proves nothing"
    return laws


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("drafter", ["draft-model", "self-draft", "prompt-lookup", "scheduler"])
def test_speculative_sampling_follows_the_transformed_law(target, draft, laws, transform, drafter):
    """self-draft: the target drafts for itself, so drafts are accepted and rows past the first decide."""
    params = SamplingParams(**BASE, **TRANSFORMS[transform])
    if drafter == "scheduler":
        outputs = scheduler_outputs(target, draft, params)
    elif drafter in ("draft-model", "self-draft"):
        model = draft.model if drafter == "draft-model" else target.model
        outputs = engine_outputs(target, DraftModelDrafter(model, target.model.vocab_size), params)
    else:
        outputs = engine_outputs(target, PromptLookupDrafter(), params)
    assert len(set(outputs)) > 5
    failure = mismatch(laws[transform], outputs)
    assert failure is None, failure


def test_negative_control_penalties_that_ignore_the_drafts_fail(target, laws, monkeypatch):
    """Every verified row scored with only the committed tokens before it: the law must break."""
    honest = sampling.transform_scores

    def stale(logits, params, history):
        if history is None or logits.reshape(-1, logits.shape[-1]).shape[0] == 1:
            return honest(logits, params, history)
        rows = logits.reshape(-1, logits.shape[-1])
        committed = list(history.tokens[: len(history.tokens) - rows.shape[0] + 1])
        return torch.stack([honest(row, params, TokenHistory(committed, history.prompt_length)) for row in rows]
                           ).reshape(logits.shape)

    monkeypatch.setattr(sampling, "transform_scores", stale)
    params = SamplingParams(**BASE, **TRANSFORMS["presence"])
    self_draft = DraftModelDrafter(target.model, target.model.vocab_size)  # accepted often: rows past 0 count
    outputs = engine_outputs(target, self_draft, params, k=3)
    assert mismatch(laws["presence"], outputs) is not None


@pytest.mark.parametrize("drafter", ["draft-model", "prompt-lookup"])
def test_greedy_speculative_equals_plain_under_penalties(target, draft, drafter):
    params = SamplingParams(frequency_penalty=0.8, presence_penalty=0.4, repetition_penalty=1.3,
                            logit_bias=((9, 2.0),))
    config = GenerationConfig(max_new_tokens=40, sampling=params, k=3)
    plain = SpeculativeEngine(target).generate(PROMPT, config).token_ids
    made = DraftModelDrafter(draft.model, target.model.vocab_size) if drafter == "draft-model" else PromptLookupDrafter()
    assert SpeculativeEngine(target, made).generate(PROMPT, config).token_ids == plain
    unpenalized = SpeculativeEngine(target).generate(PROMPT, GenerationConfig(max_new_tokens=40, k=0)).token_ids
    assert unpenalized != plain  # the penalties changed the output, so the equality above means something
