"""The model adapter: agreement with Hugging Face, KV-cache commit/rollback, ragged batches, trees."""

from __future__ import annotations

import pytest
import torch

from verispec.models.loading import load_model


def fresh_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits for every position of `ids`, computed from an empty cache. (T, V)"""
    cache = model.new_cache(1, len(ids) + 4)
    return model.forward(torch.tensor([ids]), cache)[0]


@pytest.mark.parametrize("fixture", ["tiny_dir", "tiny_llama_dir"])
def test_logits_match_huggingface(fixture, request):
    from transformers import AutoModelForCausalLM

    directory = request.getfixturevalue(fixture)
    ours = load_model(directory, "float32").model
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ids = torch.randint(0, ours.vocab_size, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits[0]  # (T, V)
    assert torch.allclose(fresh_logits(ours, ids[0].tolist()), expected, atol=1e-4, rtol=1e-4)


def test_incremental_decoding_equals_one_pass(tiny_dir):
    model = load_model(tiny_dir, "float32").model
    ids = list(range(5, 25))
    full = fresh_logits(model, ids)  # (T, V)
    cache = model.new_cache(1, 32)
    pieces = []
    for start, end in [(0, 7), (7, 8), (8, 13), (13, 20)]:
        pieces.append(model.forward(torch.tensor([ids[start:end]]), cache)[0])
        cache.commit(end - start)
    assert torch.allclose(torch.cat(pieces), full, atol=1e-5)


def test_rollback_equals_recomputing_the_prefix(tiny_dir):
    """Rejected tokens are rolled back in O(1); what follows matches a cache built without them."""
    model = load_model(tiny_dir, "float32").model
    prefix, rejected, continuation = [3, 9, 27, 81, 11], [50, 51, 52, 53], [7, 8, 9]
    cache = model.new_cache(1, 32)
    model.forward(torch.tensor([prefix]), cache)
    cache.commit(len(prefix))
    model.forward(torch.tensor([rejected]), cache)
    cache.commit(2)  # two of them were even committed before the rollback
    cache.truncate(len(prefix))
    after_rollback = model.forward(torch.tensor([continuation]), cache)[0]  # (3, V)
    expected = fresh_logits(model, prefix + continuation)[len(prefix):]
    assert torch.allclose(after_rollback, expected, atol=1e-5)


def test_uncommitted_tokens_are_scratch(tiny_dir):
    model = load_model(tiny_dir, "float32").model
    cache = model.new_cache(1, 32)
    model.forward(torch.tensor([[1, 2, 3]]), cache)
    cache.commit(3)
    model.forward(torch.tensor([[90, 91, 92, 93]]), cache)  # verified but nothing accepted
    logits = model.forward(torch.tensor([[4, 5]]), cache)[0]
    assert torch.allclose(logits, fresh_logits(model, [1, 2, 3, 4, 5])[3:], atol=1e-5)


def test_truncate_cannot_grow(tiny_dir):
    cache = load_model(tiny_dir, "float32").model.new_cache(1, 8)
    cache.commit(2)
    with pytest.raises(ValueError):
        cache.truncate(3)


def test_cache_overflow_is_an_error(tiny_dir):
    model = load_model(tiny_dir, "float32").model
    with pytest.raises(RuntimeError, match="overflow"):
        model.forward(torch.tensor([[1] * 9]), model.new_cache(1, 8))


def test_ragged_batch_rows_match_single_sequences(tiny_dir):
    """Rows with different committed lengths decode together through positions and masks."""
    model = load_model(tiny_dir, "float32").model
    first, second = [4, 8, 15, 16, 23, 42, 7], [11, 12]
    cache = model.new_cache(2, 16)
    model.forward(torch.tensor([first[:5], second + [0, 0, 0]]), cache)
    cache.commit(torch.tensor([5, 2]))
    new = torch.tensor([first[5:], [13, 14]])  # (2, 2)
    batched = model.forward(new, cache)  # (2, 2, V)
    assert torch.allclose(batched[0], fresh_logits(model, first)[5:], atol=1e-5)
    assert torch.allclose(batched[1], fresh_logits(model, second + [13, 14])[2:], atol=1e-5)


def test_tree_mask(tiny_dir):
    """Two sibling branches verified in one forward see the root but not each other."""
    model = load_model(tiny_dir, "float32").model
    prefix = [5, 6, 7]
    cache = model.new_cache(1, 16)
    model.forward(torch.tensor([prefix]), cache)
    cache.commit(3)
    # new tokens: root r=20, children a=30 and b=40 at the same position
    tree_mask = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)  # (1, 3, 3)
    positions = torch.tensor([[3, 4, 4]])
    logits = model.forward(torch.tensor([[20, 30, 40]]), cache, positions=positions, tree_mask=tree_mask)[0]
    assert torch.allclose(logits[1], fresh_logits(model, prefix + [20, 30])[-1], atol=1e-5)
    assert torch.allclose(logits[2], fresh_logits(model, prefix + [20, 40])[-1], atol=1e-5)
    chain = torch.tril(torch.ones(1, 3, 3, dtype=torch.bool))
    cache2 = model.new_cache(1, 16)
    model.forward(torch.tensor([prefix]), cache2)
    cache2.commit(3)
    chain_logits = model.forward(torch.tensor([[20, 30, 40]]), cache2, tree_mask=chain)[0]
    assert torch.allclose(chain_logits, fresh_logits(model, prefix + [20, 30, 40])[3:], atol=1e-5)


def test_restricted_output_vocabulary_keeps_those_logits(tiny_dir):
    full = load_model(tiny_dir, "float32").model
    subset = load_model(tiny_dir, "float32").model
    keep = torch.tensor([0, 5, 17, 200, 3])
    subset.restrict_output_vocab(keep)
    ids = [1, 2, 3, 4]
    assert torch.allclose(fresh_logits(subset, ids), fresh_logits(full, ids)[:, keep], atol=1e-5)


@pytest.mark.parametrize("weight_format", ["int8", "int4"])
def test_weight_quantization_stays_close(tiny_dir, weight_format):
    """Quantized drafts are cheaper, not identical; they must still rank tokens much like bf16."""
    exact = load_model(tiny_dir, "bfloat16").model
    quantized = load_model(tiny_dir, "bfloat16").model
    quantized.quantize(weight_format)
    ids = list(range(10, 14))  # few rows: the quantized kernels (prefill-sized inputs use the dense copy)
    a, b = fresh_logits(exact, ids), fresh_logits(quantized, ids)
    long_ids = list(range(10, 30))
    assert torch.equal(fresh_logits(exact, long_ids), fresh_logits(quantized, long_ids))
    correlation = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
    assert correlation > (0.99 if weight_format == "int8" else 0.9)
    assert not torch.equal(a, b)


def test_weight_only_quantization_needs_bfloat16(tiny_dir):
    with pytest.raises(ValueError, match="bfloat16"):
        load_model(tiny_dir, "float32").model.quantize("int4")
