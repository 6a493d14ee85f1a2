"""One request's failure is its own: a fault on one sequence's behalf ends that request alone, and every other
sequence in the batch goes on to the very tokens it gets alone. And requests that once ended the whole batch
(n >= 2, a one-token prompt, a prompt wholly in the prefix cache) work, with and without chunked prefill."""

from __future__ import annotations

import pytest

from conftest import FAST_FORMAT, REPEATING_PROMPT
from verispec.engine import GenerationConfig, SpeculativeEngine
from verispec.grammar import Grammar, SchemaError
from verispec.models.loading import load_model
from verispec.models.transformer import PREFILL_CHUNK
from verispec.sampling import SamplingParams
from verispec.drafters import batch_draft
from verispec.drafters.sequence_drafters import SequenceDrafters
from verispec.core import step as step_module
from verispec.core.requests import Sequence
from verispec.serving.scheduler import Scheduler, SchedulerLimits

# The faulty one (2) repeats itself, so its suffix index proposes.
PROMPTS = ["def add(a, b):\n", "class Point:\n    def __init__(self, x, y):\n", REPEATING_PROMPT, "x = 1\n"]
LENGTHS = [30, 24, 28, 20]
MARK = ((3, 0.0),)  # a logit_bias that changes nothing (greedy stays greedy) but tells the faulty request apart


@pytest.fixture(scope="module")
def draft(other_tiny_dir):
    return load_model(str(other_tiny_dir), "float32")


@pytest.fixture(scope="module")
def fast_target(tiny_dir):
    return load_model(str(tiny_dir), "float32", quantize=FAST_FORMAT)


def solo(target, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    return solo_outcome(target, prompt_ids, max_new_tokens)[0]


def solo_outcome(target, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], str, None]:
    """What the request gets alone: its tokens and finish reason ("stop" where the model ends it first)."""
    result = SpeculativeEngine(target, None).generate(prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens))
    return result.token_ids, result.finish_reason, None


def drive(scheduler: Scheduler, steps: int | None = None) -> None:
    """Run the model thread's loop here, `steps` turns or until idle: requests land at exact steps."""
    turns = 0
    while scheduler.run_once() or scheduler.num_waiting:
        turns += 1
        if steps is not None and turns >= steps:
            return


def outcome(handle) -> tuple[list[int], str, str | None]:
    events = list(handle.iter_events())
    return [t for e in events for t in e.token_ids], events[-1].finish_reason, events[-1].error


def is_marked(params: SamplingParams) -> bool:
    return params.logit_bias == MARK


def inject(monkeypatch, stage: str, after_calls: int) -> None:
    """Make one stage raise on the marked request's behalf, from its (after_calls + 1)-th call on."""
    calls = {"n": 0}

    def fault_now() -> bool:
        calls["n"] += 1
        return calls["n"] > after_calls

    if stage in ("verify", "draft"):
        module = step_module if stage == "verify" else batch_draft
        real = module.logits_to_probs

        def logits_to_probs(logits, params, *args, **kwargs):
            if is_marked(params) and fault_now():
                raise RuntimeError("injected")
            return real(logits, params, *args, **kwargs)

        monkeypatch.setattr(module, "logits_to_probs", logits_to_probs)
    elif stage == "emit":
        real = Scheduler._emit

        def emit(*args, **kwargs):
            sequence = next(a for a in args if isinstance(a, Sequence))
            if is_marked(sequence.config.sampling) and fault_now():
                raise RuntimeError("injected")
            return real(*args, **kwargs)

        monkeypatch.setattr(Scheduler, "_emit", emit)
    elif stage == "lookup":
        real = SequenceDrafters._propose_one

        def propose_one(drafter, tokens, k, params, generator, grammar):
            if is_marked(params) and fault_now():
                raise RuntimeError("injected")
            return real(drafter, tokens, k, params, generator, grammar)

        monkeypatch.setattr(SequenceDrafters, "_propose_one", staticmethod(propose_one))
    elif stage == "prefill":
        real = Scheduler._prefill_some

        def prefill_some(self, sequence, row):
            if is_marked(sequence.config.sampling):
                raise RuntimeError("injected")
            return real(self, sequence, row)

        monkeypatch.setattr(Scheduler, "_prefill_some", prefill_some)


@pytest.mark.parametrize(
    "stage, drafter, after_calls",
    [
        ("prefill", "draft-model", 0),
        ("draft", "draft-model", 3),  # the batched draft model's sampling for that row, mid-request
        ("lookup", "composite", 0),  # its own suffix index
        ("verify", "draft-model", 4),
        ("verify", "none", 0),
        ("emit", "composite", 5),  # its tokenizer, while streaming
    ],
)
def test_a_fault_in_one_row_ends_that_request_and_no_other(target, draft, monkeypatch, stage, drafter, after_calls):
    prompts = [target.encode(p) for p in PROMPTS]
    expected = [solo(target, p, n) for p, n in zip(prompts, LENGTHS)]
    inject(monkeypatch, stage, after_calls)
    scheduler = Scheduler(
        target, draft.model if drafter in ("draft-model", "composite") else None, drafter, k=3,
        limits=SchedulerLimits(max_batch_size=4, max_context=256),
    )
    faulty = 2
    configs = [
        GenerationConfig(max_new_tokens=n, sampling=SamplingParams(logit_bias=MARK if i == faulty else ()))
        for i, n in enumerate(LENGTHS)
    ]
    handles = [scheduler.submit(p, c) for p, c in zip(prompts, configs)]
    drive(scheduler)
    for i, handle in enumerate(handles):
        tokens, reason, error = outcome(handle)
        if i == faulty:
            assert reason == "error"
            assert handle.request_id in error and "injected" not in error  # its id, not internals
        else:
            assert (tokens, reason) == (expected[i], "length")
    assert scheduler.num_active == 0
    assert scheduler.failure is None


@pytest.fixture(params=["packed", "chunked", "whole"])
def any_prefill(request, target, fast_target):
    """Chunked prefill inside the step's forward (batch-invariant format), by forwards of their own
    (float32), and whole prompts."""
    if request.param == "packed":
        return fast_target, True
    return target, request.param == "chunked"


def decoding_scheduler(model, chunked: bool, drafter: str, draft) -> tuple[Scheduler, object, tuple]:
    """A scheduler with one long request decoding for a few steps already (so its costs are measured), the request's
    handle and what it gets alone (solo_outcome)."""
    scheduler = Scheduler(
        model, draft.model if drafter != "none" else None, drafter, k="auto",
        limits=SchedulerLimits(max_batch_size=4, max_context=256), chunked_prefill=chunked,
    )
    prompt = model.encode(PROMPTS[1])
    handle = scheduler.submit(prompt, GenerationConfig(max_new_tokens=120))
    drive(scheduler, steps=6)
    assert scheduler.num_active == 1
    return scheduler, handle, solo_outcome(model, prompt, 120)


@pytest.mark.parametrize("drafter", ["none", "draft-model"])
def test_n_choices_and_a_one_token_prompt_while_another_request_decodes(any_prefill, draft, drafter):
    model, chunked = any_prefill
    scheduler, busy, busy_expected = decoding_scheduler(model, chunked, drafter, draft)
    prompt = model.encode(PROMPTS[0])
    choices = scheduler.submit_choices(prompt, [GenerationConfig(max_new_tokens=12)] * 3)
    one_token = scheduler.submit(prompt[:1], GenerationConfig(max_new_tokens=10))
    drive(scheduler)
    for handle in choices:
        assert outcome(handle) == solo_outcome(model, prompt, 12)
    assert outcome(one_token) == solo_outcome(model, prompt[:1], 10)
    assert outcome(busy) == busy_expected


def test_n_choices_on_an_idle_server_after_its_costs_were_measured(any_prefill, draft):
    model, chunked = any_prefill
    scheduler, busy, _ = decoding_scheduler(model, chunked, "draft-model", draft)
    drive(scheduler)
    outcome(busy)
    prompt = model.encode(PROMPTS[2])
    choices = scheduler.submit_choices(prompt, [GenerationConfig(max_new_tokens=9)] * 2)
    drive(scheduler)
    assert [outcome(h) for h in choices] == [solo_outcome(model, prompt, 9)] * 2


@pytest.mark.parametrize("blocks", [1, 2])
def test_a_prompt_wholly_in_the_prefix_cache(any_prefill, draft, blocks):
    """A prompt of blocks * PREFILL_CHUNK + 1 tokens, again: every token but the last comes from the cache."""
    model, chunked = any_prefill
    text = "".join(PROMPTS) * 40
    prompt = model.encode(text)[: blocks * PREFILL_CHUNK + 1]
    assert len(prompt) == blocks * PREFILL_CHUNK + 1
    scheduler, busy, busy_expected = decoding_scheduler(model, chunked, "draft-model", draft)
    first = scheduler.submit(prompt, GenerationConfig(max_new_tokens=6))
    drive(scheduler, steps=12)
    again = scheduler.submit(prompt, GenerationConfig(max_new_tokens=6))
    drive(scheduler)
    want = solo_outcome(model, prompt, 6)
    assert outcome(first) == want
    events = list(again.iter_events())
    assert ([t for e in events for t in e.token_ids], events[-1].finish_reason) == want[:2]
    assert events[-1].stats.cached_prompt_tokens == len(prompt) - 1
    assert outcome(busy) == busy_expected


@pytest.mark.parametrize("params", [dict(temperature=1e-40), dict(temperature=1e-7), dict(repetition_penalty=1e-40),
                                    dict(repetition_penalty=1e6)])
def test_settings_that_make_probabilities_non_finite_are_refused(params):
    with pytest.raises(ValueError, match="temperature|repetition_penalty"):
        SamplingParams(**params)


def test_the_smallest_allowed_settings_give_finite_probabilities(target):
    from verispec.sampling import MIN_TEMPERATURE, REPETITION_PENALTY_RANGE, TokenHistory, logits_to_probs

    logits = target.model.forward(__import__("torch").tensor([target.encode("def add(")]), target.model.new_cache(1, 32))
    logits = logits[0, -1:] * 1000  # scores far larger than a model's
    history = TokenHistory(list(range(50)), 0)
    for params in (SamplingParams(temperature=MIN_TEMPERATURE),
                   SamplingParams(temperature=MIN_TEMPERATURE, repetition_penalty=REPETITION_PENALTY_RANGE[0]),
                   SamplingParams(temperature=1.0, repetition_penalty=REPETITION_PENALTY_RANGE[1])):
        probs = logits_to_probs(logits, params, None, history)
        assert bool(probs.isfinite().all()) and abs(float(probs.sum()) - 1) < 1e-4


@pytest.mark.parametrize("schema", [{"$ref": "#"}, {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}])
def test_a_schema_that_admits_no_value_is_refused_at_submit(target, schema):
    scheduler = Scheduler(target, limits=SchedulerLimits(max_batch_size=2, max_context=64))
    with pytest.raises(SchemaError, match="admits no value"):
        scheduler.submit(target.encode("x"), GenerationConfig(max_new_tokens=4, json_schema=schema))
    assert scheduler.num_waiting == 0


def test_a_grammar_that_fails_on_its_first_mask_is_refused_at_submit(target, monkeypatch):
    """The grammar engine may compile a schema and fail only when it computes a mask (a regex that explodes):
    that shows at submit, not in the decoding loop."""

    def explode(self):
        raise RuntimeError("the grammar allows no next token: lexer too big")

    monkeypatch.setattr(Grammar, "allowed", explode)
    scheduler = Scheduler(target, limits=SchedulerLimits(max_batch_size=2, max_context=64))
    schema = {"type": "string", "pattern": "(a|b)*a(a|b){40}"}
    with pytest.raises(SchemaError, match="cannot be used"):
        scheduler.submit(target.encode("x"), GenerationConfig(max_new_tokens=4, json_schema=schema))
