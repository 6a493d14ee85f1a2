"""The speculative loop on tiny random-weight models: lossless greedy and sampled output, stops."""

from __future__ import annotations

import copy

import pytest
import torch

from laws import accept_all, exact_two_token_law, law_matches, two_token_frequencies
from verispec.core import step as step_module  # the one step both paths run
from verispec.drafters import DraftModelDrafter
from verispec.engine import GenerationConfig, SpeculativeEngine
from verispec.models.loading import load_model
from verispec.sampling import SamplingParams

PROMPTS = ["def add(a, b):", "The quick brown", "for i in range(10):\n", "class"]


@pytest.fixture(scope="module")
def other(other_tiny_dir):
    return load_model(other_tiny_dir, "float32")


def plain_engine(target):
    return SpeculativeEngine(target)


def greedy(max_new_tokens=40, k=4, **kwargs):
    # No eos: random weights would stop at random places and make short, uninformative outputs.
    return GenerationConfig(max_new_tokens=max_new_tokens, k=k, eos_token_ids=(), **kwargs)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_same_model_drafter_accepts_everything_and_matches_plain(target, k):
    spec = SpeculativeEngine(target, DraftModelDrafter(target.model, target.model.vocab_size))
    for prompt in PROMPTS:
        expected = plain_engine(target).generate(prompt, greedy(k=0))
        result = spec.generate(prompt, greedy(k=k))
        assert result.token_ids == expected.token_ids
        assert result.text == expected.text
        assert result.stats.acceptance_rate == 1.0
        assert result.stats.target_forwards == -(-40 // (k + 1))  # ceil: k + 1 tokens per forward


@pytest.mark.parametrize("k", [1, 4])
def test_unrelated_drafter_is_still_lossless(target, other, k):
    spec = SpeculativeEngine(target, DraftModelDrafter(other.model, target.model.vocab_size))
    rates = []
    for prompt in PROMPTS:
        expected = plain_engine(target).generate(prompt, greedy(k=0))
        result = spec.generate(prompt, greedy(k=k))
        assert result.token_ids == expected.token_ids
        rates.append(result.stats.acceptance_rate)
    assert sum(rates) / len(rates) < 0.3


def test_stats_add_up(target, other):
    spec = SpeculativeEngine(target, DraftModelDrafter(other.model, target.model.vocab_size))
    stats = spec.generate(PROMPTS[0], greedy(k=3)).stats
    assert stats.new_tokens == 40
    assert stats.drafted_tokens == sum(stats.drafted_by_position)
    assert stats.accepted_tokens == sum(stats.accepted_by_position)
    assert len(stats.drafted_by_position) == 3
    assert stats.target_forwards - 1 <= stats.drafted_by_position[0] <= stats.target_forwards
    assert stats.accepted_tokens + stats.target_forwards >= stats.new_tokens
    assert stats.draft_forwards == stats.drafted_tokens  # chain drafting: one forward per draft token
    assert 0 < stats.prefill_seconds + stats.draft_seconds + stats.verify_seconds <= stats.total_seconds
    data = stats.to_dict()
    for key in ("acceptance_rate", "mean_tokens_per_target_forward", "acceptance_by_position", "tokens_per_second"):
        assert key in data


def test_the_step_records_add_up_to_the_stats(target, other):
    spec = SpeculativeEngine(target, DraftModelDrafter(other.model, target.model.vocab_size))
    result = spec.generate(PROMPTS[0], greedy(k=3))
    stats, steps = result.stats, result.steps
    assert len(steps) == stats.target_forwards and all(len(step.rows) == 1 for step in steps)
    assert sum(step.rows[0].drafted for step in steps) == stats.drafted_tokens
    assert sum(step.rows[0].accepted for step in steps) == stats.accepted_tokens
    assert [sum(s.drafted_by_position[i] for s in steps if len(s.drafted_by_position) > i) for i in range(3)] == (
        stats.drafted_by_position
    )
    assert {step.rows[0].source for step in steps if step.rows[0].drafted} == {"draft-model"}
    assert all(step.forward_tokens == 1 + step.rows[0].drafted and step.chunk_tokens == 0 for step in steps)
    assert all(0 < step.forward_seconds < step.seconds for step in steps)


def test_same_seed_reproduces_and_seeds_differ(target, other):
    spec = SpeculativeEngine(target, DraftModelDrafter(other.model, target.model.vocab_size))
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    runs = [spec.generate(PROMPTS[1], greedy(sampling=sampling, seed=seed)).token_ids for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("drafter_kind", ["draft-model", "draft-model-small-head", "prompt-lookup", "cross-tokenizer"])
def test_sampled_output_follows_the_target_distribution(target, other, tiny_llama_dir, repeating_prompt, drafter_kind):
    """Through the whole engine, two sampled tokens follow plain decoding's exact law.

    draft-model proposes with its q; its small-head variant with q zero outside half the vocabulary (draft_vocab:
    tokens the target may well sample are never drafted); prompt-lookup and cross-tokenizer propose point masses
    (q = 1).
    """
    from verispec.drafters import PromptLookupDrafter, make_drafter

    sampling = SamplingParams(temperature=1.0, top_k=20)
    prompt_ids = target.encode(repeating_prompt)
    law = exact_two_token_law(target, prompt_ids, sampling)
    drafter = {
        "draft-model": lambda: DraftModelDrafter(other.model, target.model.vocab_size),
        "draft-model-small-head": lambda: DraftModelDrafter(small_head(other.model), target.model.vocab_size),
        "prompt-lookup": lambda: PromptLookupDrafter(min_ngram=1),
        "cross-tokenizer": lambda: make_drafter("cross-tokenizer", target, str(tiny_llama_dir), "float32"),
    }[drafter_kind]()
    spec = SpeculativeEngine(target, drafter)
    assert spec.generate(prompt_ids, greedy(max_new_tokens=2, k=3)).stats.drafted_tokens > 0  # it does propose
    runs = 1500
    assert law_matches(two_token_frequencies(spec, prompt_ids, sampling, runs), law, runs)


def small_head(model):
    """A copy of `model` whose head covers every other token id."""
    trimmed = copy.copy(model)
    trimmed.restrict_output_vocab(torch.arange(0, model.vocab_size, 2))
    return trimmed


def test_sampled_output_with_adaptive_k_follows_the_target_distribution(target, other, repeating_prompt):
    """k chosen per step by the controller (which learns across these runs) keeps the law exact."""
    sampling = SamplingParams(temperature=1.0, top_k=20)
    prompt_ids = target.encode(repeating_prompt)
    law = exact_two_token_law(target, prompt_ids, sampling)
    spec = SpeculativeEngine(target, DraftModelDrafter(other.model, target.model.vocab_size))
    runs = 1500
    assert law_matches(two_token_frequencies(spec, prompt_ids, sampling, runs, k="auto"), law, runs)
    assert len(spec.controller(8).chosen) > 1  # it really varied k


def test_negative_control_accept_all_fails_the_same_check(target, other, repeating_prompt, monkeypatch):
    """A verifier that accepts every draft emits the drafter's law; the check above must catch it."""
    monkeypatch.setattr(step_module, "verify", accept_all)
    sampling = SamplingParams(temperature=1.0, top_k=20)
    prompt_ids = target.encode(repeating_prompt)
    law = exact_two_token_law(target, prompt_ids, sampling)
    spec = SpeculativeEngine(target, DraftModelDrafter(other.model, target.model.vocab_size))
    runs = 1500
    assert not law_matches(two_token_frequencies(spec, prompt_ids, sampling, runs), law, runs)


def test_max_new_tokens_is_exact_even_mid_step(target):
    spec = SpeculativeEngine(target, DraftModelDrafter(target.model, target.model.vocab_size))
    result = spec.generate(PROMPTS[0], greedy(max_new_tokens=5, k=8))
    assert len(result.token_ids) == 5
    assert result.finish_reason == "length"


def test_eos_stops_and_is_kept(target):
    full = plain_engine(target).generate(PROMPTS[2], greedy(k=0)).token_ids
    eos = full[6]
    first = full.index(eos)
    spec = SpeculativeEngine(target, DraftModelDrafter(target.model, target.model.vocab_size))
    result = spec.generate(PROMPTS[2], GenerationConfig(max_new_tokens=40, k=4, eos_token_ids=(eos,)))
    assert result.token_ids == full[: first + 1]
    assert result.finish_reason == "stop"


def test_stop_string_cuts_text(target):
    full = plain_engine(target).generate(PROMPTS[0], greedy(k=0)).text
    stop = full[10:13]
    assert stop and full.find(stop) >= 0
    spec = SpeculativeEngine(target, DraftModelDrafter(target.model, target.model.vocab_size))
    result = spec.generate(PROMPTS[0], greedy(k=4, stop_strings=(stop,)))
    assert result.text == full[: full.find(stop)]
    assert result.finish_reason == "stop"


def test_stream_yields_the_text_in_pieces(target, other):
    spec = SpeculativeEngine(target, DraftModelDrafter(other.model, target.model.vocab_size))
    stream = spec.stream(PROMPTS[3], greedy(k=3))
    pieces = list(stream)
    assert len(pieces) > 1
    assert "".join(pieces) == stream.result.text == plain_engine(target).generate(PROMPTS[3], greedy(k=0)).text


def test_bad_requests_are_clear_errors(target):
    engine = plain_engine(target)
    with pytest.raises(ValueError, match="empty"):
        engine.generate("", greedy())
    with pytest.raises(ValueError, match="context"):
        engine.generate("x " * 600, greedy())
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="k"):
        GenerationConfig(k=-1)


def test_library_logprobs_are_the_targets_for_every_token_accepted_drafts_included(target, other):
    """GenerationConfig.logprobs, once accepted and ignored by the library, now returns what the server does."""
    spec = SpeculativeEngine(target, DraftModelDrafter(target.model, target.model.vocab_size))  # drafts accepted
    prompt_ids = target.encode("def add(a, b):")
    result = spec.generate(prompt_ids, GenerationConfig(max_new_tokens=20, k=3, logprobs=2))
    assert result.stats.accepted_tokens > 0
    assert [entry.token_id for entry in result.logprobs] == result.token_ids
    cache = target.model.new_cache(1, len(prompt_ids) + len(result.token_ids) + 1)
    logits = target.model.forward(torch.tensor([prompt_ids + result.token_ids[:-1]]), cache)[0]
    reference = torch.log_softmax(logits[len(prompt_ids) - 1 :].float(), dim=-1)  # (T, V)
    for position, entry in enumerate(result.logprobs):
        assert entry.logprob == pytest.approx(float(reference[position, entry.token_id]), abs=1e-4)
        assert len(entry.top) == 2 and entry.top[0][1] == pytest.approx(float(reference[position].max()), abs=1e-4)
    assert spec.generate(prompt_ids, GenerationConfig(max_new_tokens=5)).logprobs is None


def test_a_request_caps_or_turns_off_its_own_speculation(target, other_tiny_dir, repeating_prompt):
    """GenerationConfig.max_draft_tokens, the library's side of the served max_draft_tokens: 0 decodes plainly
    with a drafter attached, a cap of 1 under a fixed k of 4 drafts at most one token a step; same greedy text."""
    draft = load_model(str(other_tiny_dir), "float32")
    engine = SpeculativeEngine(target, DraftModelDrafter(draft.model, target.model.vocab_size))
    plain = SpeculativeEngine(target).generate(repeating_prompt, GenerationConfig(max_new_tokens=24, k=0))
    off = engine.generate(repeating_prompt, GenerationConfig(max_new_tokens=24, k=4, max_draft_tokens=0))
    one = engine.generate(repeating_prompt, GenerationConfig(max_new_tokens=24, k=4, max_draft_tokens=1))
    free = engine.generate(repeating_prompt, GenerationConfig(max_new_tokens=24, k=4))
    assert off.token_ids == one.token_ids == free.token_ids == plain.token_ids
    assert off.stats.drafted_tokens == 0 and off.stats.target_forwards == len(plain.token_ids)
    assert 0 < one.stats.drafted_tokens <= one.stats.target_forwards
    assert free.stats.drafted_tokens > free.stats.target_forwards  # k = 4 drafts more than one a step
    with pytest.raises(ValueError, match="max_draft_tokens"):
        GenerationConfig(max_draft_tokens=-1)


def test_a_draft_ended_where_the_draft_is_unsure_keeps_the_target_law(target, other, repeating_prompt):
    """draft_p_min ends a sampled draft before a token where the draft's top probability is low: a rule of q alone,
    so two sampled tokens still follow plain decoding's exact law. The threshold is one at which some drafts end
    early and some do not (checked), so the rule is exercised."""
    sampling = SamplingParams(temperature=1.0, top_k=20)
    prompt_ids = target.encode(repeating_prompt)
    spec = SpeculativeEngine(target, DraftModelDrafter(other.model, target.model.vocab_size))

    def drafted(p_min: float) -> int:
        configs = [greedy(max_new_tokens=8, k=3, sampling=sampling, seed=seed, draft_p_min=p_min) for seed in range(8)]
        return sum(spec.generate(prompt_ids, config).stats.drafted_tokens for config in configs)

    whole = drafted(0.0)
    p_min = next(p for p in (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9) if 0 < drafted(p) < whole)
    law = exact_two_token_law(target, prompt_ids, sampling)
    runs = 1500
    assert law_matches(two_token_frequencies(spec, prompt_ids, sampling, runs, draft_p_min=p_min), law, runs)


def test_a_bad_draft_p_min_is_refused():
    with pytest.raises(ValueError, match="draft_p_min is a probability"):
        GenerationConfig(draft_p_min=1.5)
