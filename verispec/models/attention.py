"""Attention over the KV cache's slots, and whether verispec's attention and norm kernels run here.

Two ways to attend: one query at a time over exactly the slots it sees (`attention_per_row`), which
gives a token the same bits in any batch, or one masked call over all of them (`masked_attention`).
verispec.models.transformer chooses between them per forward; this module holds the arithmetic, so
the forward itself reads as projections, rotary and layers.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from verispec.models import w4a8
from verispec.models.kv_cache import WritePlan


# torch's CPU attention in bfloat16 costs several times its float32 one for one query, so torch attention
# runs in float32, which is also the more exact. Passes of a few tokens attend one query at a time in
# verispec's kernel where it runs, which is faster still.
ATTENTION_DTYPE = torch.float32
INVARIANT_ATTENTION_MAX_ROWS = 64  # longer inputs take one masked attention call


def visible_slots(plan: WritePlan, mask: torch.Tensor | None) -> list[list[int | torch.Tensor]]:
    """[b][t]: n when new token t of row b sees cache slots 0 .. n-1 (chains), else their indices (trees).

    mask: (B, 1, T, S) for token trees; None for chains (each new token sees its row's prefix,
    the new tokens before it and itself).
    """
    if mask is None:
        return [[length + t + 1 for t in range(plan.num_new)] for length in plan.lengths]
    rows = []
    for b, visible in enumerate(mask[:, 0]):  # (T, S) each
        counts = visible.sum(-1).tolist()
        rows.append([
            n if bool(visible[t, :n].all()) else visible[t].nonzero()[:, 0] for t, n in enumerate(counts)
        ])
    return rows


def attention_kernel_runs(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether verispec's attention kernel (kernels/attention.cpp) takes these heads here."""
    supported = head_dim % 16 == 0 and head_dim <= 256 and dtype in (torch.float32, torch.bfloat16)
    return supported and kernels_available()


@functools.cache
def kernels_available() -> bool:
    """Whether verispec's attention and norm kernels, built with the w4a8 kernel, run here.

    Asked once per process, so every forward of a process attends and normalises the same way.
    """
    if w4a8.unavailable_reason() is not None:
        return False
    try:
        w4a8.load_kernel()
    except w4a8.KernelUnavailable:
        return False
    return True


def windowed(row_keys: list[list[int | torch.Tensor]], window: int) -> list[list[int | slice | torch.Tensor]]:
    """row_keys (see visible_slots) for a sliding-window layer: a query that sees slots 0 .. n-1 of a chain
    sees the last `window` of them, slots n - window .. n - 1 (a slice), as transformers' sliding mask."""
    rows = []
    for per_token in row_keys:
        if any(not isinstance(seen, int) for seen in per_token):
            raise ValueError("token trees do not run on models with sliding-window layers")
        rows.append([slice(seen - window, seen) if seen > window else seen for seen in per_token])
    return rows


def _softcapped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, softcap: float
) -> torch.Tensor:
    """softmax(cap * tanh(q k^T / (sqrt(D) cap)), over the visible keys) v, in float32 (Gemma 2: no fused
    kernel does it).

    q: (B, H, T, D); keys, values: (B, Hkv, S, D); mask: (B, 1, T, S) True = may attend, or None.
    """
    q, keys, values = (t.to(ATTENTION_DTYPE) for t in (q, keys, values))
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)  # (B, H, S, D)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, H, T, S)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values)  # (B, H, T, D)


def masked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, softcap: float | None
) -> torch.Tensor:
    """One attention call over (B, H, T, D) queries and (B, Hkv, S, D) keys; mask (B, 1, T, S) or None = all."""
    if softcap is not None:
        return _softcapped_attention(q, keys, values, mask, softcap)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


def attention_per_row(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    row_keys: list[list[int | slice | torch.Tensor]],
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention one query at a time over exactly the keys it sees, in slot order.

    q: (B, H, T, D); keys, values: (B, Hkv, S, D); row_keys[b][t]: a slot count n (slots 0 .. n-1), a slice
    of slots (a sliding window) or slot indices (a tree node). A token verified at position p gets the very
    computation (one query, keys 0 .. p) that plain decoding makes for it, so its result is
    bit-identical; a batched or masked call would reorder the sums with the number of rows.
    verispec's attention kernel does all queries of a pass in one call, each alone; without it,
    one float32 torch call per query. Soft-capped scores (Gemma 2) take a float32 torch computation per query.
    """
    if softcap is not None:
        q, keys, values = (t.to(ATTENTION_DTYPE) for t in (q, keys, values))

        def attend_one(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return _softcapped_attention(query, k, v, None, softcap)  # (1, H, 1, D)
    elif attention_kernel_runs(q.shape[-1], q.dtype):
        if all(isinstance(seen, int) for per_token in row_keys for seen in per_token):  # chains: one call
            return torch.ops.verispec.attend(q, keys, values, torch.tensor(row_keys, dtype=torch.long))  # (B, H, T, D)

        def attend_one(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.ops.verispec.attend(query, k, v, torch.tensor([[k.shape[2]]]))  # (1, H, 1, D)
    else:
        q, keys, values = (t.to(ATTENTION_DTYPE) for t in (q, keys, values))
        if len(row_keys) == 1 and len(row_keys[0]) == 1 and _sees_all(row_keys[0][0], keys):
            return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)  # (1, H, 1, D) plain decoding

        def attend_one(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(query, k, v, enable_gqa=True)  # (1, H, 1, D)
    # A tree node's keys (a subset of slots) are gathered in slot order: the arithmetic of a chain over them.
    rows = []
    for b, per_token in enumerate(row_keys):
        row_q, row_k, row_v = q.narrow(0, b, 1), keys.narrow(0, b, 1), values.narrow(0, b, 1)  # (1, ., ., D)
        tokens = []
        for t, seen in enumerate(per_token):
            if isinstance(seen, int):
                k, v = row_k.narrow(2, 0, seen), row_v.narrow(2, 0, seen)  # (1, Hkv, n, D)
            else:  # a window's slice of slots (a view) or a tree node's slot indices (gathered)
                k, v = row_k[:, :, seen], row_v[:, :, seen]  # (1, Hkv, n, D)
            tokens.append(attend_one(row_q.narrow(2, t, 1), k, v))  # (1, H, 1, D)
        rows.append(torch.cat(tokens, dim=2))  # (1, H, T, D)
    return torch.cat(rows)  # (B, H, T, D)


PACKED_GROUP_MAX_TOKENS = 16  # rows of a packed forward with at most this many new tokens attend in one padded call


def attention_groups(counts: list[int]) -> list[tuple[int, int]]:
    """Row ranges [first, last) that attend together in a packed forward: runs of short rows (at most
    PACKED_GROUP_MAX_TOKENS new tokens, padded to the longest of the run) and each longer row alone
    (a prompt chunk: padding the others to its length would cost more than a call); rows with none skipped."""
    groups: list[tuple[int, int]] = []
    for b, count in enumerate(counts):
        if count == 0:
            continue
        short = count <= PACKED_GROUP_MAX_TOKENS
        if short and groups and groups[-1][1] == b and max(counts[groups[-1][0] : b]) <= PACKED_GROUP_MAX_TOKENS:
            groups[-1] = (groups[-1][0], b + 1)
        else:
            groups.append((b, b + 1))
    return groups


def _sees_all(seen: int | torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether a query that sees `seen` (a slot count or slot indices) sees every slot of keys (B, Hkv, S, D)."""
    return isinstance(seen, int) and seen == keys.shape[2]
