"""Prefix reuse and chunked prefill: a prompt after a cached prefix, or fed in pieces, gets a whole prefill's bits."""

from __future__ import annotations

import pytest
import torch

from verispec.engine import GenerationConfig, SpeculativeEngine
from verispec.models.loading import load_model
from verispec.models.transformer import PREFILL_CHUNK
from verispec.core.prefix_cache import PrefixCache
from verispec.core import admission as admission_module
from verispec.core.admission import prefill_budget
from verispec.serving.scheduler import Scheduler, SchedulerLimits

# Dense float32, dense bfloat16 (whose matmuls are not batch-invariant: only the chunk boundaries make
# the splits exact) and the batch-invariant w4a8.
FORMATS = [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "w4a8")]


@pytest.fixture(scope="module", params=FORMATS, ids=lambda f: "-".join(f))
def model(request, tiny_dir):
    dtype, quantize = request.param
    return load_model(str(tiny_dir), dtype, quantize=quantize).model


def token_ids(count: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefilled(model, ids: list[int], capacity: int = 400):
    cache = model.new_cache(1, capacity)
    assert model.prefill(ids, cache) == len(ids)
    return cache


def assert_same_cache(a, b, length: int) -> None:
    assert int(a.lengths[0]) == int(b.lengths[0]) == length
    for layer, (ka, kb, va, vb) in enumerate(zip(a.keys, b.keys, a.values, b.values)):
        assert torch.equal(ka[:, :, :length], kb[:, :, :length]), f"keys of layer {layer}"
        assert torch.equal(va[:, :, :length], vb[:, :, :length]), f"values of layer {layer}"


def run_to_the_end(scheduler: Scheduler, prompts: list[list[int]], configs: list[GenerationConfig]) -> list[list]:
    """Every request's events; all are submitted before the loop starts, so they share steps."""
    handles = [scheduler.submit(p, c) for p, c in zip(prompts, configs)]
    scheduler.start()
    try:
        return [list(h.iter_events()) for h in handles]
    finally:
        scheduler.stop()


def next_logits(model, cache, token: int) -> torch.Tensor:
    return model.forward(torch.tensor([[token]]), cache)


def test_prefill_in_pieces_at_chunk_boundaries_equals_one_call(model):
    ids = token_ids(150, 0, model.vocab_size)
    whole = prefilled(model, ids)
    pieces = model.new_cache(1, 400)
    assert model.prefill(ids[:PREFILL_CHUNK], pieces) == PREFILL_CHUNK
    assert model.prefill(ids[PREFILL_CHUNK:], pieces, max_tokens=PREFILL_CHUNK) == PREFILL_CHUNK
    assert model.prefill(ids[2 * PREFILL_CHUNK :], pieces, max_tokens=500) == 150 - 2 * PREFILL_CHUNK
    assert_same_cache(whole, pieces, 150)
    assert torch.equal(next_logits(model, whole, 7), next_logits(model, pieces, 7))
    with pytest.raises(ValueError, match="one row"):
        model.prefill(ids, model.new_cache(2, 400))
    with pytest.raises(ValueError, match="max_tokens"):
        model.prefill(ids, model.new_cache(1, 400), max_tokens=0)


def test_a_batch_invariant_model_prefills_in_pieces_of_any_size_to_the_same_bits(tiny_dir):
    model = load_model(str(tiny_dir), "bfloat16", quantize="w4a8").model
    assert model.batch_invariant
    ids = token_ids(150, 0, model.vocab_size)
    pieces, fed = model.new_cache(1, 400), 0
    for size in (5, 37, 1, 30, 64, 13):  # ragged pieces, none ending on a chunk boundary but the last
        fed += model.prefill(ids[fed:], pieces, max_tokens=size)
    assert fed == 150
    whole = prefilled(model, ids)
    assert_same_cache(whole, pieces, 150)
    assert torch.equal(next_logits(model, whole, 7), next_logits(model, pieces, 7))


def test_a_prompt_after_a_cached_prefix_gets_the_bits_of_a_whole_prefill(model):
    vocab = model.vocab_size
    shared = token_ids(140, 1, vocab)  # two whole blocks and a part of a third
    first, second = shared + token_ids(20, 2, vocab), shared + token_ids(30, 3, vocab)
    prefix_cache = PrefixCache(max_bytes=1 << 30)
    prefix_cache.store(first, prefilled(model, first))
    assert len(prefix_cache) == 2  # whole blocks only: the third holds tokens of `first` alone

    reused_row = model.new_cache(1, 400)
    assert prefix_cache.load(second, reused_row) == 2 * PREFILL_CHUNK
    model.prefill(second[2 * PREFILL_CHUNK :], reused_row)
    assert_same_cache(prefilled(model, second), reused_row, len(second))
    assert torch.equal(next_logits(model, prefilled(model, second), 9), next_logits(model, reused_row, 9))
    assert prefix_cache.stats.hit_tokens == 2 * PREFILL_CHUNK
    assert prefix_cache.stats.missed_tokens == len(second) - 2 * PREFILL_CHUNK

    other = model.new_cache(1, 400)
    assert prefix_cache.load(token_ids(140, 4, vocab), other) == 0 and int(other.lengths[0]) == 0
    with pytest.raises(ValueError, match="empty cache row"):
        prefix_cache.load(second, reused_row)


def test_eviction_keeps_within_budget_and_drops_least_recently_used_leaves_first(target):
    model, vocab = target.model, target.model.vocab_size
    a, b = token_ids(3 * PREFILL_CHUNK, 5, vocab), token_ids(PREFILL_CHUNK + 10, 6, vocab)  # b: one whole block
    block_bytes = PrefixCache(1 << 30)
    block_bytes.store(a[:PREFILL_CHUNK], prefilled(model, a[:PREFILL_CHUNK]))
    size = block_bytes.nbytes
    prefix_cache = PrefixCache(max_bytes=2 * size + size // 2)  # room for two blocks
    prefix_cache.store(a, prefilled(model, a))
    assert len(prefix_cache) == 2 and prefix_cache.nbytes == 2 * size  # the third did not fit
    assert prefix_cache.load(a, model.new_cache(1, 400)) == 2 * PREFILL_CHUNK
    prefix_cache.store(b, prefilled(model, b))
    # b's first block pushed out a's second (a leaf); a's first stays, it no longer has a child.
    assert prefix_cache.nbytes <= prefix_cache.max_bytes
    assert prefix_cache.load(a, model.new_cache(1, 400)) == PREFILL_CHUNK
    assert prefix_cache.load(b, model.new_cache(1, 400)) == PREFILL_CHUNK
    assert prefix_cache.stats.evicted_blocks == 2  # a's third (at once) and a's second
    nothing = PrefixCache(max_bytes=0)
    nothing.store(a, prefilled(model, a))
    assert len(nothing) == 0 and nothing.nbytes == 0
    with pytest.raises(ValueError, match=">= 0 bytes"):
        PrefixCache(max_bytes=-1)


def test_served_requests_reuse_a_shared_prefix_and_keep_their_single_request_output(target):
    vocab = target.model.vocab_size
    system = token_ids(150, 7, vocab)  # a shared "system prompt": two whole blocks
    prompts = [system + token_ids(5 + 3 * i, 10 + i, vocab) for i in range(4)]
    expected = [
        SpeculativeEngine(target, None).generate(p, GenerationConfig(max_new_tokens=12)).token_ids for p in prompts
    ]
    for prefix_bytes, cached in ((1 << 30, 2 * PREFILL_CHUNK), (0, 0)):
        scheduler = Scheduler(target, None, "none", limits=SchedulerLimits(2, 8, 256, prefix_bytes))
        events = run_to_the_end(scheduler, prompts, [GenerationConfig(max_new_tokens=12)] * len(prompts))
        assert [[t for e in evs for t in e.token_ids] for evs in events] == expected
        assert [evs[-1].stats.cached_prompt_tokens for evs in events] == [0] + [cached] * 3
        assert (scheduler.prefix_cache is None) == (prefix_bytes == 0)
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        Scheduler(target, None, "none", limits=SchedulerLimits(2, 8, 256, -1))


def test_prefill_budget_gives_the_prompts_their_share_of_the_step():
    assert prefill_budget(None, 0.001, 1, 4) == prefill_budget(0.1, None, 1, 4) == PREFILL_CHUNK  # unmeasured
    assert prefill_budget(0.1, 0.005, 1, 4) == 15  # one prompt, 4 streams: not a fair fifth, 0.75 of a step
    assert prefill_budget(0.1, 0.005, 1, 1) == 20  # one prompt, one stream: as long as its step
    assert prefill_budget(0.1, 0.005, 15, 1) == 300  # a burst: the prompts' 15 shares
    assert prefill_budget(0.001, 0.005, 1, 8) == 1  # always some progress
    # What is left of a short prompt goes in at once where that lasts 8 of the streams' steps at most.
    assert prefill_budget(0.1, 0.005, 1, 4, 160) == 160  # 0.8 s: 8 steps
    assert prefill_budget(0.1, 0.005, 1, 4, 161) == 15  # longer: the share of a step
    assert prefill_budget(None, 0.005, 1, 4, 10) == PREFILL_CHUNK  # unmeasured: one chunk, however short


def test_a_short_prompt_rides_whole_in_the_step_and_a_long_one_by_its_share(tiny_dir):
    """Packed chunks: the rest of a prompt goes in at once where carrying it lengthens the step by 8 steps at most."""
    loaded = load_model(str(tiny_dir), "bfloat16", quantize="w4a8")
    scheduler = Scheduler(loaded, None, "none", limits=SchedulerLimits(3, 8, 512, 0), chunked_prefill=True)
    # Measured on the real target: 4 tokens 50 ms, 8: 64, 12: 108 (another kernel past 8), 64: 285; 3.6 ms a prompt token.
    scheduler.controller.verify_cost.update({4: 0.050, 8: 0.064, 12: 0.108, 64: 0.285})
    scheduler._prefill_token_seconds = 0.0036
    scheduler.active = [None] * 2  # two streams (only their count matters here), nobody waiting
    vocab = loaded.model.vocab_size
    # A step of 4 verify tokens, no drafting: 50 ms, so 8 more steps allow a 450 ms forward: 64 + 45 tokens.
    short = scheduler._new_sequence(token_ids(106, 1, vocab), GenerationConfig(max_new_tokens=4))
    assert len(scheduler._packed_chunk(short, 4, 0.0)) == 105
    longer = scheduler._new_sequence(token_ids(107, 1, vocab), GenerationConfig(max_new_tokens=4))
    # 106 tokens would take 453 ms: the share (1 / 2 streams, at least 0.75) of the steps, 37.5 ms each, saved up
    # until it pays for a chunk past the jump at 8 tokens (prompt_chunk).
    sizes = [len(scheduler._packed_chunk(longer, 4, 0.0)) for _ in range(4)]
    assert sizes[0] == 0 and max(sizes) > 8 and longer.chunk_credit >= 0
    longer.prefilled = 100  # its last 6 tokens fit at once
    assert scheduler._packed_chunk(longer, 4, 0.0) == longer.prompt_ids[100:-1]


def long_prompt_among_short_ones(loaded) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Two short prompts and a 300-token one, their max_new_tokens, and each one's single-request output."""
    vocab = loaded.model.vocab_size
    prompts = [token_ids(9, 20, vocab), token_ids(12, 21, vocab), token_ids(300, 22, vocab)]
    lengths = [3, 40, 10]  # the first finishes (and its row is taken back) while the long prompt goes in
    expected = [
        SpeculativeEngine(loaded, None).generate(p, GenerationConfig(max_new_tokens=n)).token_ids
        for p, n in zip(prompts, lengths)
    ]
    return prompts, lengths, expected


def test_a_long_prompt_goes_in_by_chunks_of_its_own_while_others_decode_and_keeps_its_output(tiny_dir, monkeypatch):
    """A model that is not batch-invariant: the chunks are forwards of their own, on chunk boundaries."""
    loaded = load_model(str(tiny_dir), "float32", quantize="none")
    assert not loaded.model.batch_invariant
    prompts, lengths, expected = long_prompt_among_short_ones(loaded)
    monkeypatch.setattr(admission_module, "prefill_budget", lambda *args: 7)  # a fixed share, whatever the timing
    real_prefill = loaded.model.prefill
    for chunked in (True, False):
        calls = []  # (tokens offered, max_tokens, tokens fed)

        def prefill(token_ids, cache, max_tokens=None, hidden_out=None):
            fed = real_prefill(token_ids, cache, max_tokens, hidden_out)
            calls.append((len(token_ids), max_tokens, fed))
            return fed

        monkeypatch.setattr(loaded.model, "prefill", prefill)
        scheduler = Scheduler(loaded, None, "none", limits=SchedulerLimits(3, 8, 512, 0), chunked_prefill=chunked)
        events = run_to_the_end(scheduler, prompts, [GenerationConfig(max_new_tokens=n) for n in lengths])
        assert [[t for e in evs for t in e.token_ids] for evs in events] == expected
        assert scheduler.num_active == 0
        start = next(i for i, (offered, _, _) in enumerate(calls) if offered == 299)
        assert all(offered < 20 for offered, _, _ in calls[:start])  # the short prompts went in first
        long = calls[start:]
        assert sum(fed for _, _, fed in long) == 299
        if not chunked:
            assert long == [(299, None, 299)] and all(budget is None for _, budget, _ in calls)
            continue
        fed = [fed for _, _, fed in long]  # whole chunks while others decode; once nobody decodes, the rest at once
        assert len(fed) >= 3 and all(f == PREFILL_CHUNK for f in fed[:-1]), fed
        ttft = [evs[-1].stats.time_to_first_token for evs in events]
        assert ttft[2] > max(ttft[:2])  # the short requests streamed while the long prompt went in



def test_a_batch_invariant_target_carries_the_chunks_in_the_decoding_steps_and_keeps_every_output(tiny_dir, monkeypatch):
    """Chunks of a long prompt ride in the streams' own verify forwards (no forward of their own), each of the size the
    cost model gives; every request keeps its single-request output (the chunk's bits: the test after this one)."""
    loaded = load_model(str(tiny_dir), "bfloat16", quantize="w4a8")
    assert loaded.model.batch_invariant
    prompts, lengths, expected = long_prompt_among_short_ones(loaded)
    sizes = []  # verify tokens the scheduler asked a chunk size for
    monkeypatch.setattr(
        admission_module, "prompt_chunk",
        lambda costs, base, share, draft, per_token, most, credit, stall: sizes.append(base) or (7, credit),
    )
    prefills, packed = [], []  # prompt tokens fed by prefill; row widths of each packed forward
    real_prefill, real_packed = loaded.model.prefill, loaded.model.forward_packed
    monkeypatch.setattr(
        loaded.model, "prefill",
        lambda ids, cache, most=None, hidden_out=None: prefills.append(len(ids)) or real_prefill(ids, cache, most, hidden_out),
    )
    monkeypatch.setattr(
        loaded.model, "forward_packed",
        lambda rows, cache, wanted, hidden_out=None: packed.append((len(rows[-1]), wanted[-1]))
        or real_packed(rows, cache, wanted, hidden_out),
    )
    scheduler = Scheduler(loaded, None, "none", limits=SchedulerLimits(3, 8, 512, 0), chunked_prefill=True)
    scheduler._prefill_token_seconds = 0.01  # as if a whole prefill had been timed: chunks of prompt_chunk's size
    events = run_to_the_end(scheduler, prompts, [GenerationConfig(max_new_tokens=n) for n in lengths])
    assert [[t for e in evs for t in e.token_ids] for evs in events] == expected
    assert scheduler.num_active == 0
    assert 299 not in prefills  # the long prompt never went in by a forward of its own while others decoded
    chunks = [width for width, wants_logits in packed if not wants_logits]  # the rows that carried a chunk
    # Chunks of 7 but each prompt's last; the first prompt went in whole (nothing decoded yet), and so would a rest
    # that finds nobody decoding any more.
    assert len(chunks) >= 30 and all(c <= 7 for c in chunks) and sum(c < 7 for c in chunks) <= 2, chunks
    assert sum(chunks) + sum(prefills) == sum(len(p) - 1 for p in prompts)
    # Every chunk was sized by the cost model but a prompt's rest that fit in at once (WHOLE_PROMPT_STEPS): one a prompt.
    assert len(sizes) <= len(chunks) <= len(sizes) + len(prompts) - 1
    ttft = [evs[-1].stats.time_to_first_token for evs in events]
    assert ttft[2] > max(ttft[:2])  # the short requests streamed while the long prompt went in


def test_a_packed_chunk_gets_the_keys_of_a_whole_prefill(tiny_dir):
    """What the scheduler relies on to store packed prompts in the prefix cache: same bits as prefill."""
    model = load_model(str(tiny_dir), "bfloat16", quantize="w4a8").model
    vocab = model.vocab_size
    stream, prompt = token_ids(20, 30, vocab), token_ids(150, 31, vocab)
    cache = model.new_cache(2, 400)
    model.prefill(stream, cache.rows(0, 1))
    fed = 0
    for size in (7, 61, 1, 81):  # across chunk boundaries, beside a verify row of 3 tokens
        model.forward_packed([token_ids(3, 40 + size, vocab), prompt[fed : fed + size]], cache, [True, False])
        cache.rows(1, 2).commit(size)
        fed += size
    assert_same_cache(prefilled(model, prompt), cache.rows(1, 2), 150)
