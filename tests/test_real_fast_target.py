"""The default fast target (w4a8 or w8a8, whichever `auto` picks on this CPU) on the packaged models: bit-exact greedy.

Default settings, 20 HumanEval and 5 chat prompts, 128 new tokens each: speculative decoding one request
at a time (draft model, k chosen by the controller) equals plain decoding token for token; plain decoding
runs 8 rows at a time in the serving scheduler, and equals plain decoding alone (4 of the prompts); and the
scheduler's batched verify passes (12 of the prompts through 8 rows) equal them too. Batch invariance is
what makes this hold in bfloat16, where a dense target flips near-ties (see benchmarks/results/xeon/quantized/).
"""

from __future__ import annotations

import pytest
import torch

from conftest import FAST_FORMATS, real_thread_count
from verispec import GenerationConfig, SpeculativeEngine, load_model
from verispec.bench.workloads import chat, humaneval
from verispec.serving.scheduler import Scheduler, SchedulerLimits

pytestmark = [
    pytest.mark.real,
    pytest.mark.skipif(not FAST_FORMATS, reason="no batch-invariant format runs on this CPU"),
]

TARGET = "qwen2.5-coder-1.5b-instruct"
NEW_TOKENS = 128
ALONE = (0, 7, 20, 24)  # prompts also decoded plainly one at a time: code and chat, the first and last of each


@pytest.fixture(scope="module", params=["auto", "the other fast format"][: len(FAST_FORMATS)])
def fast_pair(request, default_pair):
    """The default target (auto: w4a8 or w8a8, measured), and the fast format auto did not pick, where both run."""
    previous = torch.get_num_threads()
    torch.set_num_threads(real_thread_count())
    target, drafter = default_pair
    if request.param != "auto" or not target.model.batch_invariant:
        # the other format; or auto measured dense as faster here: test the fast format itself
        quantize = "w8a8" if target.format.choice.weight_format == "w4a8" else "w4a8"
        target = load_model(TARGET, "bfloat16", quantize=quantize if request.param != "auto" else FAST_FORMATS[0])
        # the default pair's draft drafts for it too: a draft model keeps no request's state
    yield target, drafter
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def prompts(fast_pair):
    target, _ = fast_pair
    code = [p["prompt"] for p in humaneval()[:20]]
    talk = [target.tokenizer.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
            for p in chat()[:5]]
    return code + talk


def served_outputs(target, draft_model, drafter: str, k, prompts: list[str]) -> list[list[int]]:
    """Each prompt's greedy tokens, decoded 8 at a time by the serving scheduler: rows fill, leave as their texts end
    and take the waiting prompts in."""
    scheduler = Scheduler(target, draft_model, drafter, k=k, limits=SchedulerLimits(8, 32, 2048))
    handles = [scheduler.submit(target.encode(p), GenerationConfig(max_new_tokens=NEW_TOKENS)) for p in prompts]
    scheduler.start()
    try:
        return [[t for e in h.iter_events() for t in e.token_ids] for h in handles]
    finally:
        scheduler.stop()


@pytest.fixture(scope="module")
def plain_outputs(fast_pair, prompts):
    """Plain decoding of every prompt, batched: a batch-invariant target gives each row the tokens it gives alone
    (test_plain_decoding_batched_equals_alone checks it), and 25 prompts one at a time took 4-5 minutes of the
    suite for each format on one thread."""
    target, _ = fast_pair
    return served_outputs(target, None, "none", 0, prompts)


def test_plain_decoding_batched_equals_alone(fast_pair, prompts, plain_outputs):
    target, _ = fast_pair
    engine = SpeculativeEngine(target)
    for index in ALONE:
        alone = engine.generate(prompts[index], GenerationConfig(max_new_tokens=NEW_TOKENS, k=0)).token_ids
        assert alone == plain_outputs[index], f"prompt {index}: plain decoding differs alone and batched"


def test_default_speculation_equals_plain_decoding_bit_for_bit(fast_pair, prompts, plain_outputs):
    target, drafter = fast_pair
    engine = SpeculativeEngine(target, drafter)
    # w4a8's one-token passes are cheap enough that `auto` may not draft: a fixed k verifies 5 rows a step.
    k = 4 if target.format.choice.weight_format == "w4a8" else "auto"
    drafted = accepted = 0
    for index, (prompt, want) in enumerate(zip(prompts, plain_outputs)):
        result = engine.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, k=k))
        assert result.token_ids == want, f"prompt {index} differs from plain decoding"
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    assert drafted > 0 and accepted / drafted > 0.5  # the drafts were really verified in multi-row passes
    assert sum(len(t) for t in plain_outputs) > 20 * NEW_TOKENS // 2  # long outputs, not early stops


def test_batched_serving_equals_single_requests(fast_pair, prompts, plain_outputs):
    target, drafter = fast_pair
    # 8 code and 4 chat prompts through 8 rows (the 25 prompts of the test above took 9 minutes more on one thread
    # of an AVX2 Zen 1, for no other path)
    chosen = [*range(8), *range(20, 24)]
    outputs = served_outputs(target, drafter.model, "draft-model", "auto", [prompts[i] for i in chosen])
    for index, output in zip(chosen, outputs):
        assert output == plain_outputs[index], f"prompt {index} differs when batched"
