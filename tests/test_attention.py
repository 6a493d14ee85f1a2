"""verispec's attention kernel: each query alone over exactly its keys, so rows never change each other's bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verispec.models import attention
from verispec.models.loading import load_model

pytestmark = pytest.mark.skipif(
    not attention.kernels_available(), reason="the attention kernel needs AVX-512 and a C++ compiler"
)


def attend(q, keys, values, counts):
    return torch.ops.verispec.attend(q, keys, values, torch.tensor(counts, dtype=torch.long))


def inputs(dtype, batch=2, heads=12, kv_heads=2, tokens=5, slots=600, dim=128, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, tokens, dim, generator=generator).to(dtype)
    keys = torch.randn(batch, kv_heads, slots, dim, generator=generator).to(dtype)
    values = torch.randn(batch, kv_heads, slots, dim, generator=generator).to(dtype)
    return q, keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_query_is_softmax_attention_over_its_own_keys(dtype):
    q, keys, values = inputs(dtype)
    counts = [[500, 501, 502, 503, 504], [1, 2, 17, 33, 600]]  # one key, a masked tail, all slots
    out = attend(q, keys, values, counts)  # (B, H, T, D)
    for b in range(2):
        for t in range(5):
            n = counts[b][t]
            reference = F.scaled_dot_product_attention(
                q[b : b + 1, :, t : t + 1].double(), keys[b : b + 1, :, :n].double(), values[b : b + 1, :, :n].double(),
                enable_gqa=True,
            )  # (1, H, 1, D)
            error = (out[b : b + 1, :, t : t + 1].double() - reference).abs().max().item()
            assert error < {torch.float32: 1e-5, torch.bfloat16: 8e-3}[dtype], (b, t, error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_gets_the_same_bits_alone_as_in_any_pass(dtype):
    q, keys, values = inputs(dtype)
    counts = [[40, 41, 42, 43, 44], [7, 8, 9, 10, 11]]
    out = attend(q, keys, values, counts)
    for b in range(2):
        for t in range(5):
            n = counts[b][t]
            alone = attend(q[b : b + 1, :, t : t + 1], keys[b : b + 1, :, :n], values[b : b + 1, :, :n], [[n]])
            assert torch.equal(alone, out[b : b + 1, :, t : t + 1])


def test_narrowed_cache_views_read_like_contiguous_keys():
    q, keys, values = inputs(torch.bfloat16, slots=300)
    view_k, view_v = keys[:, :, :120], values[:, :, :120]  # what the KV cache hands out
    counts = [[100, 101, 102, 103, 104], [116, 117, 118, 119, 120]]
    assert torch.equal(attend(q, view_k, view_v, counts), attend(q, view_k.contiguous(), view_v.contiguous(), counts))


def test_counts_outside_the_slots_are_refused():
    q, keys, values = inputs(torch.float32, batch=1, tokens=1, slots=10)
    for bad in (0, 11):
        with pytest.raises(RuntimeError, match="sees"):
            attend(q, keys, values, [[bad]])


def test_without_the_kernel_a_fast_target_is_still_batch_invariant(tiny_dir, monkeypatch):
    """Where the kernel cannot run, one float32 torch call per query keeps verify == plain decoding."""
    monkeypatch.setattr(attention, "attention_kernel_runs", lambda head_dim, dtype: False)
    model = load_model(tiny_dir, "bfloat16", quantize="w4a8").model
    prefix, new = list(range(3, 40)), [50, 61, 72, 83, 94]
    cache = model.new_cache(1, 64)
    model.forward(torch.tensor([prefix]), cache)
    cache.commit(len(prefix))
    verify = model.forward(torch.tensor([new]), cache)[0]  # (T, V)
    rows = []
    for token in new:
        rows.append(model.forward(torch.tensor([[token]]), cache)[0, 0])
        cache.commit(1)
    assert torch.equal(verify, torch.stack(rows))
