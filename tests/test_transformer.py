"""The model adapter: agreement with Hugging Face, KV-cache commit/rollback, ragged batches, trees."""

from __future__ import annotations

import pytest
import torch

from verispec.models import attention, transformer
from verispec.models.kv_cache import KVCache
from verispec.models.loading import load_model
from verispec.models.transformer import apply_rotary, rms_norm, rotate_half


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


# ---- the fast forward's pieces are bit-identical to the plain formulas ----------------------


def real_like(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Activations with a few huge channels, as in real residual streams; some exact zeros."""
    generator = torch.Generator().manual_seed(seed)
    channel_scales = torch.logspace(-2, 1, shape[-1])[torch.randperm(shape[-1], generator=generator)]  # (C,)
    x = torch.randn(shape, generator=generator) * channel_scales
    x[..., :3] *= 400.0
    x[..., 5::97] = 0.0
    return x.to(dtype)


def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 1536), (1, 5, 1536), (3, 7, 1536), (1, 512, 1536), (2, 3, 64)])
def test_rms_norm_without_the_kernel_is_the_float32_formula_bit_for_bit(dtype, shape, monkeypatch):
    monkeypatch.setattr(transformer, "norm_kernel_runs", lambda x: False)
    x = real_like(shape, dtype, seed=shape[1])
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=torch.Generator().manual_seed(1))).to(dtype)
    assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm_formula(x, weight, 1e-6))


@pytest.mark.skipif(not attention.kernels_available(), reason="the norm kernel needs AVX-512 and a C++ compiler")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 1536), (3, 7, 1536), (1, 512, 1536), (2, 3, 64)])
def test_the_norm_kernel_is_the_formula_and_gives_a_row_the_same_bits_in_any_batch(dtype, shape):
    assert transformer.norm_kernel_runs(torch.empty(shape, dtype=dtype))
    x = real_like(shape, dtype, seed=shape[1])
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=torch.Generator().manual_seed(1))).to(dtype)
    got, expected = rms_norm(x, weight, 1e-6), rms_norm_formula(x, weight, 1e-6)
    # The sum of squares runs in another order than torch's (1536 terms): float32 results differ in
    # their last bits, bfloat16 ones by one rounding step (2^-8 relative) and rarely.
    steps = 64 if dtype == torch.float32 else 2
    assert ((got.float() - expected.float()).abs() <= steps * torch.finfo(dtype).eps * expected.abs().float()).all()
    if dtype == torch.bfloat16:
        assert (got != expected).float().mean() < 0.02
    flat = x.reshape(-1, shape[-1])
    for row in (0, flat.shape[0] - 1):
        assert torch.equal(rms_norm(flat[row : row + 1], weight, 1e-6)[0], got.reshape(-1, shape[-1])[row])


def test_the_norm_kernel_refuses_mismatched_shapes_and_dtypes():
    if not attention.kernels_available():
        pytest.skip("the norm kernel needs AVX-512 and a C++ compiler")
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.verispec.rms_norm(torch.ones(2, 20), torch.ones(20), 1e-6)
    with pytest.raises(RuntimeError, match="float32 or both bfloat16"):
        torch.ops.verispec.rms_norm(torch.ones(2, 32), torch.ones(32, dtype=torch.bfloat16), 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_apply_rotary_is_rotate_half_bit_for_bit(dtype):
    x = real_like((2, 5, 14, 128), dtype, seed=3)  # (B, T, H, D)
    angles = torch.rand(2, 5, 1, 64, generator=torch.Generator().manual_seed(4)).double() * 1000  # (B, T, 1, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B, T, 1, D)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    signed_sin = torch.cat([-sin[..., :64], sin[..., 64:]], dim=-1)
    assert torch.equal(apply_rotary(x, cos, signed_sin), x * cos + rotate_half(x) * sin)


def test_write_plan_is_shared_by_layers_and_matches_a_planless_write():
    keys = torch.randn(3, 2, 4, 8)  # (B, Hkv, T, D)
    planned, planless = KVCache(2, 3, 2, 16, 8, torch.float32), KVCache(2, 3, 2, 16, 8, torch.float32)
    for lengths in ([5, 5, 5], [5, 2, 9]):  # uniform, then ragged
        for cache in (planned, planless):
            cache.truncate(0)
            cache.commit(torch.tensor(lengths))
        plan = planned.plan_write(4)
        assert plan.uniform == (len(set(lengths)) == 1) and plan.end == max(lengths) + 4
        for layer in range(2):
            got = planned.write(layer, keys + layer, -keys, plan)
            expected = planless.write(layer, keys + layer, -keys)
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
            assert got[0].shape == (3, 2, max(lengths) + 4, 8)
    assert torch.equal(planned.keys[1], planless.keys[1]) and torch.equal(planned.values[0], planless.values[0])
    with pytest.raises(ValueError, match="plan"):
        planned.write(0, keys[:, :, :2], keys[:, :, :2], plan)
    with pytest.raises(RuntimeError, match="overflow"):
        planned.plan_write(8)


@pytest.mark.parametrize("dtype,quantize", [("float32", "none"), ("bfloat16", "w4a8")])
def test_a_packed_forward_gives_each_row_what_it_gets_alone(tiny_dir, dtype, quantize):
    """Rows of different widths (an empty row, verify passes, a prompt chunk past the padded-group size) in one
    packed forward: each row's logits and keys are those of its own forward; bit for bit where batch-invariant."""
    model = load_model(tiny_dir, dtype, quantize=quantize).model
    generator = torch.Generator().manual_seed(3)
    prefixes = [torch.randint(3, model.vocab_size, (n,), generator=generator).tolist() for n in (7, 0, 12, 30, 5)]
    new = [torch.randint(3, model.vocab_size, (n,), generator=generator).tolist() for n in (4, 1, 0, 40, 2)]
    with_logits = [True, True, True, False, True]
    packed = model.new_cache(len(prefixes), 128)
    for b, prefix in enumerate(prefixes):
        if prefix:
            model.prefill(prefix, packed.rows(b, b + 1))
    results = model.forward_packed(new, packed, with_logits)
    exact = model.batch_invariant
    for b, (prefix, tokens) in enumerate(zip(prefixes, new)):
        alone = model.new_cache(1, 128)
        if prefix:
            model.prefill(prefix, alone)
        if not tokens:
            assert results[b] is None
            continue
        expected = model.forward(torch.tensor([tokens]), alone)[0]  # (T, V)
        span = len(prefix) + len(tokens)
        for layer in range(len(alone.keys)):
            got, want = packed.keys[layer][b, :, :span], alone.keys[layer][0, :, :span]
            assert torch.equal(got, want) if exact else torch.allclose(got, want, atol=1e-5), (b, layer)
        if not with_logits[b]:
            assert results[b] is None
            continue
        assert results[b].shape == expected.shape
        assert torch.equal(results[b], expected) if exact else torch.allclose(results[b], expected, atol=1e-4), b
    assert torch.equal(packed.lengths, torch.tensor([len(p) for p in prefixes]))  # nothing committed
    with pytest.raises(ValueError, match="one entry per cache row"):
        model.forward_packed(new[:2], packed, with_logits[:2])
    with pytest.raises(RuntimeError, match="overflow"):
        model.forward_packed([[1] * 200] + [[]] * 4, packed, with_logits)


def test_attention_groups_pad_short_rows_together_and_leave_long_rows_alone():
    assert attention.attention_groups([3, 1, 0, 40, 2, 5]) == [(0, 2), (3, 4), (4, 6)]
    assert attention.attention_groups([0, 0]) == []
    assert attention.attention_groups([17, 2]) == [(0, 1), (1, 2)]


def test_feature_layers_hand_on_the_hidden_states_after_those_layers(tiny_dir):
    """With feature_layers, hidden_out gets the states after each of those layers side by side (a fused draft
    head's input), in forward and forward_packed alike; the last of them, after every layer, is what it hands
    on without them."""
    model = load_model(tiny_dir, "float32").model
    ids = [5, 9, 2, 7]
    width, layers = model.embed.shape[1], model.config.num_layers
    last: list[torch.Tensor] = []
    model.forward(torch.tensor([ids]), model.new_cache(1, 8), hidden_out=last)
    model.feature_layers = (1, layers)
    fused: list[torch.Tensor] = []
    model.forward(torch.tensor([ids]), model.new_cache(1, 8), hidden_out=fused)
    packed: list[torch.Tensor | None] = []
    model.forward_packed([ids], model.new_cache(1, 8), [True], hidden_out=packed)
    assert fused[0].shape == (1, len(ids), 2 * width)
    assert torch.equal(fused[0][..., width:], last[0])
    assert not torch.allclose(fused[0][..., :width], last[0])  # the first layer's, not the last's
    torch.testing.assert_close(packed[0], fused[0][0])
