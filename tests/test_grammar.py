"""Structured output (verispec.grammar): a JSON schema's mask on p and q keeps speculation lossless.

The law test enumerates every token sequence a small schema allows (21 on the tiny tokenizer) and
computes its exact probability under the masked target (plain forwards, one prefix at a time); sampled
speculative generations, through the library engine (lookup and unmasked sampled drafts, cut before the
verify pass) and through the scheduler (a batched draft model sampling from masked q), must follow it.
Negative controls: a verifier that accepts every draft, and a target whose p is not masked, must fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

import verispec.core.step as step_module
from laws import accept_all_verifier, exact_law, frequencies_against
from verispec.drafters import DraftModelDrafter
from verispec.drafters.base import Proposal
from verispec.engine import GenerationConfig, SpeculativeEngine
from verispec.drafters.base import cut_to_grammar
from verispec.grammar import SchemaError, fit_mask, grammar_for
from verispec.models.loading import load_model
from verispec.sampling import SamplingParams, logits_to_probs
from verispec.serving.scheduler import Scheduler, SchedulerLimits

SMALL_SCHEMA = {"type": "array", "items": {"enum": ["add", "def"]}, "maxItems": 2}
PROMPT = "def add(a, b):\n"
# Bounded documents, so that even random weights finish them within max_tokens.
TEST_SCHEMAS = {
    "record": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "vip": {"type": "boolean"},
        },
        "required": ["name", "age", "vip"],
        "additionalProperties": False,
    },
    "choice": {"enum": ["add", "def", "class", "for"]},
    "list": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
}
BENCH_SCHEMAS = json.loads((Path(__file__).parents[1] / "benchmarks/workloads/json-schemas.json").read_text())


@pytest.fixture(scope="module")
def draft(other_tiny_dir):
    return load_model(str(other_tiny_dir), "float32")


SAMPLED = SamplingParams(temperature=1.0)
NUM_RUNS = 2000
BATCH = SchedulerLimits(max_batch_size=16, max_waiting=4096, max_context=256)  # every run queued at once


@pytest.fixture(scope="module")
def law(target):
    law = exact_law(target, target.encode(PROMPT), SMALL_SCHEMA)
    assert len(law) == 21 and abs(sum(law.values()) - 1) < 1e-6
    return law


def scheduler_outputs(target, draft, runs: int, k: int = 3) -> list[tuple[int, ...]]:
    scheduler = Scheduler(target, draft.model, "draft-model", k=k, limits=BATCH)
    configs = [
        GenerationConfig(max_new_tokens=40, sampling=SAMPLED, seed=seed, json_schema=SMALL_SCHEMA)
        for seed in range(runs)
    ]
    handles = [scheduler.submit(target.encode(PROMPT), config) for config in configs]
    scheduler.start()
    try:
        return [tuple(t for event in handle.iter_events() for t in event.token_ids) for handle in handles]
    finally:
        scheduler.stop()


def test_scheduler_with_masked_draft_follows_the_masked_target_law(target, draft, law):
    outputs = scheduler_outputs(target, draft, NUM_RUNS)
    mismatch = frequencies_against(law, outputs)
    assert mismatch is None, mismatch


@pytest.mark.parametrize("drafter", ["draft-model", "prompt-lookup"])
def test_engine_with_cut_drafts_follows_the_masked_target_law(target, draft, law, drafter):
    """The library's drafters do not see the grammar: sampled drafts are cut after, lookups at, the first
    forbidden token (the prompt repeats 'add', so lookups propose tokens the array grammar must cut)."""
    from verispec.drafters import make_drafter

    if drafter == "draft-model":
        made = DraftModelDrafter(draft.model, target.model.vocab_size)
    else:
        made = make_drafter("prompt-lookup", target)
    engine = SpeculativeEngine(target, made)
    outputs = []
    for seed in range(NUM_RUNS // 2):
        config = GenerationConfig(max_new_tokens=40, sampling=SAMPLED, seed=seed, k=3, json_schema=SMALL_SCHEMA)
        outputs.append(tuple(engine.generate(PROMPT, config).token_ids))
    mismatch = frequencies_against(law, outputs)
    assert mismatch is None, mismatch


def test_negative_control_accept_every_draft_fails(target, draft, law, monkeypatch):
    monkeypatch.setattr(step_module, "verify", accept_all_verifier)
    assert frequencies_against(law, scheduler_outputs(target, draft, NUM_RUNS // 2)) is not None


def test_negative_control_unmasked_target_fails(target, draft, law, monkeypatch):
    real = step_module.logits_to_probs
    monkeypatch.setattr(step_module, "logits_to_probs", lambda logits, params, allowed=None: real(logits, params))
    assert frequencies_against(law, scheduler_outputs(target, draft, NUM_RUNS // 4)) is not None


# ---- documents are valid, greedy is exact ----------------------------------------------------


@pytest.mark.parametrize("drafter", ["draft-model", "composite", "none"])
def test_sampled_requests_all_parse_and_validate(target, draft, drafter):
    """200 sampled requests over 3 schemas in one batch: every document parses and validates."""
    model = draft.model if drafter in ("draft-model", "composite") else None
    scheduler = Scheduler(target, model, drafter, k="auto", limits=BATCH)
    names = list(TEST_SCHEMAS) * 67
    handles = []
    for seed, name in enumerate(names[:200]):
        config = GenerationConfig(max_new_tokens=60, sampling=SAMPLED, seed=seed, json_schema=TEST_SCHEMAS[name])
        handles.append((name, scheduler.submit(target.encode(PROMPT), config)))
    scheduler.start()
    try:
        for name, handle in handles:
            events = list(handle.iter_events())
            assert events[-1].finish_reason == "stop"
            text = "".join(event.text for event in events)
            jsonschema.validate(json.loads(text), TEST_SCHEMAS[name])
    finally:
        scheduler.stop()


@pytest.mark.parametrize("drafter", ["draft-model", "composite", "suffix-index"])
def test_greedy_speculative_equals_greedy_plain_under_a_schema(target, draft, drafter):
    configs = [GenerationConfig(max_new_tokens=60, json_schema=schema) for schema in TEST_SCHEMAS.values()]
    plain = [SpeculativeEngine(target).generate(PROMPT, c).token_ids for c in configs]
    for tokens, schema in zip(plain, TEST_SCHEMAS.values()):
        jsonschema.validate(json.loads(target.decode(tokens)), schema)
    model = draft.model if drafter in ("draft-model", "composite") else None
    scheduler = Scheduler(target, model, drafter, k=3, limits=SchedulerLimits(max_batch_size=4, max_context=256))
    handles = [scheduler.submit(target.encode(PROMPT), c) for c in configs]
    scheduler.start()
    try:
        served = [[t for e in h.iter_events() for t in e.token_ids] for h in handles]
    finally:
        scheduler.stop()
    assert served == plain
    engine = SpeculativeEngine(target, DraftModelDrafter(draft.model, target.model.vocab_size))
    assert [engine.generate(PROMPT, GenerationConfig(**{**c.__dict__, "k": 3})).token_ids for c in configs] == plain


def test_unconstrained_greedy_differs_so_the_mask_matters(target):
    config = GenerationConfig(max_new_tokens=20, json_schema=SMALL_SCHEMA)
    constrained = SpeculativeEngine(target).generate(PROMPT, config)
    free = SpeculativeEngine(target).generate(PROMPT, GenerationConfig(max_new_tokens=20))
    assert constrained.token_ids != free.token_ids
    assert json.loads(constrained.text) in ([], ["add"], ["def"], ["add", "add"], ["add", "def"], ["def", "add"],
                                            ["def", "def"])


# ---- the pieces -------------------------------------------------------------------------------


def test_masks_along_reads_each_position_and_leaves_the_state(target, law):
    grammar = grammar_for(target, SMALL_SCHEMA)
    document = list(max(law))  # some whole document, eos last
    before = grammar.allowed()
    masks = grammar.masks_along(document[:-1])  # (T + 1, V)
    assert masks.shape == (len(document), target.model.vocab_size)
    assert torch.equal(masks[0], before) and torch.equal(grammar.allowed(), before)
    assert all(bool(masks[i, token]) for i, token in enumerate(document))
    assert masks[-1].sum() == 1 and bool(masks[-1, target.eos_token_ids[0]])  # finished: only eos
    grammar.advance(document[:2])
    assert torch.equal(grammar.allowed(), masks[2])


def test_masks_along_drafts_past_the_end_of_the_document_leave_the_state(target, law):
    """A lookup may draft the closing token, eos and more: a finished matcher records no more tokens, so
    rolling back one per draft would undo a committed token too (seen on the real pair, composite drafter)."""
    grammar = grammar_for(target, SMALL_SCHEMA)
    document = list(max(law))
    grammar.advance(document[:1])
    after_first = grammar.allowed()
    masks = grammar.masks_along(document[1:] + [target.eos_token_ids[0]])  # eos twice: drafted past the end
    assert torch.equal(masks[0], after_first) and torch.equal(grammar.allowed(), after_first)
    assert grammar.valid_prefix(document[1:]) == len(document) - 1
    grammar.advance(document[1:])
    assert grammar.finished


def test_cut_keeps_a_sampled_drafts_first_forbidden_token_and_drops_a_lookups(target, law):
    grammar = grammar_for(target, SMALL_SCHEMA)
    document = list(next(iter(law)))
    forbidden = int((~grammar.masks_along(document[:2])[2]).nonzero()[0])
    drafts = torch.tensor([document[:2] + [forbidden, document[3]]])  # (1, 4)
    lookup = cut_to_grammar(Proposal(drafts, None), grammar)
    assert lookup.token_ids.tolist() == [document[:2]]
    q = torch.full((1, 4, target.model.vocab_size), 1 / target.model.vocab_size)
    sampled = cut_to_grammar(Proposal(drafts, q), grammar)
    assert sampled.token_ids.tolist() == [document[:2] + [forbidden]] and sampled.probs.shape[1] == 3
    masks = grammar.masks_along(sampled.token_ids[0].tolist())  # the forbidden last token: a repeated row
    assert torch.equal(masks[3], masks[2])
    assert cut_to_grammar(Proposal(drafts, None), None) is not None


def test_mask_applies_before_every_other_filter():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    allowed = torch.tensor([[False, False, True, True]])
    assert logits_to_probs(logits, SamplingParams(), allowed).tolist() == [[0.0, 0.0, 1.0, 0.0]]
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=1), allowed)
    assert probs.tolist() == [[0.0, 0.0, 1.0, 0.0]]  # top-k counts only the allowed tokens
    spread = logits_to_probs(logits, SamplingParams(temperature=1.0), allowed)
    assert spread[0, :2].sum() == 0 and torch.allclose(spread[0, 2:], torch.softmax(torch.tensor([3.0, 2.0]), -1))
    assert fit_mask(allowed, 6).tolist() == [[False, False, True, True, False, False]]
    assert fit_mask(allowed, 3).tolist() == [[False, False, True]]


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "objectx"}, "cannot be used"),
        ({"type": "string", "pattern": "("}, "cannot be used"),
        ({"type": "string", "pattern": "^(a{1000}){1000}$"}, "cannot be used"),  # its lexer fails as the string opens
    ],
)
def test_bad_schemas_are_clear_errors(target, schema, message):
    with pytest.raises(SchemaError, match=message):
        grammar_for(target, schema)
    with pytest.raises(ValueError, match=message):
        SpeculativeEngine(target).generate(PROMPT, GenerationConfig(json_schema=schema))


def test_an_empty_schema_still_constrains(target):
    """{} allows any JSON value: a grammar all the same, not "no response_format"."""
    engine = SpeculativeEngine(target)
    constrained = engine.generate(PROMPT, GenerationConfig(json_schema={}, max_new_tokens=24)).token_ids
    tokens = [t for t in constrained if t not in target.eos_token_ids]
    assert grammar_for(target, {}).valid_prefix(tokens) == len(tokens)
    free = engine.generate(PROMPT, GenerationConfig(max_new_tokens=24)).token_ids
    assert grammar_for(target, {}).valid_prefix(free) < len(free)  # unconstrained, the tiny model writes no JSON


def test_ignore_eos_cannot_end_a_document():
    with pytest.raises(ValueError, match="ignore_eos"):
        GenerationConfig(json_schema=SMALL_SCHEMA, eos_token_ids=())


@pytest.mark.real
@pytest.mark.parametrize("drafter", ["draft-model", "composite"])
def test_real_models_follow_the_benchmark_schemas_greedy_exact(default_pair, real_threads, drafter):
    """The packaged pair: greedy speculative under each benchmark schema equals greedy plain, and validates."""
    target, draft_model = default_pair
    prompts = {
        "customer": "Extract the customer as JSON: Maria Lopez, 42, maria.lopez@example.org, a VIP member.",
        "order": "Order A-77 shipped: 2 x USB-C cable (SKU CB-2) at 9.99 each and 1 x charger (SKU CH-65) at 39.",
        "ticket": "Classify this support ticket as JSON: 'My invoice charged me twice for the same month!'",
    }
    configs, prompt_ids = [], []
    for name, text in prompts.items():
        messages = [{"role": "user", "content": text}]
        rendered = target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids.append(target.encode(rendered))
        configs.append(GenerationConfig(max_new_tokens=96, json_schema=BENCH_SCHEMAS[name]))
    plain = [SpeculativeEngine(target).generate(ids, c) for ids, c in zip(prompt_ids, configs)]
    for result, name in zip(plain, prompts):
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(result.text), BENCH_SCHEMAS[name])
    model = draft_model.model if drafter in ("draft-model", "composite") else None
    scheduler = Scheduler(target, model, drafter, k="auto", limits=SchedulerLimits(max_batch_size=4, max_context=1024))
    handles = [scheduler.submit(ids, c) for ids, c in zip(prompt_ids, configs)]
    scheduler.start()
    try:
        served = [[t for e in h.iter_events() for t in e.token_ids] for h in handles]
    finally:
        scheduler.stop()
    assert served == [r.token_ids for r in plain]
