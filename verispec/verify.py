"""Accept or reject drafted tokens so that output tokens follow the target distribution exactly.

This is the rejection-sampling rule of Leviathan et al. (2023) and Chen et al. (2023). It is a
pure function of tensors and one explicit `torch.Generator`. It makes no model calls and mutates
nothing. It touches torch's global RNG only when no generator is given.

Terms:

- drafts: x_0 ... x_{k-1}, shape (B, k), proposed to follow the committed prefix.
- p: target distribution, one row per verified position: p_0 ... p_k, shape (B, k+1, V).
  p_i is the target's distribution for the token after the committed prefix and x_0..x_{i-1}.
  Greedy decoding passes one-hot rows.
- q: draft distribution q_i that draft x_i was sampled from, shape (B, k, V). `None` means
  every draft token was proposed deterministically (n-gram, another tokenizer's text). That is a
  point mass: q_i(x_i) = 1.
- accepted: draft x_i is accepted when u_i < p_i(x_i) / q_i(x_i), with u_i ~ U[0, 1). Checking
  stops at the first rejection. Drafts after it are discarded unexamined.
- recovered token: at the first rejected position j, a replacement drawn from the residual
  norm(max(p_j - q_j, 0)) over the full vocabulary. If the residual has no mass (rounding, or a
  q that is not a distribution), it is drawn from p_j instead.
- bonus token: when all k drafts are accepted, one extra token drawn from p_k. The target
  forward pass computes p_k for free.
- output tokens: the accepted drafts followed by exactly one recovered or bonus token, so
  1..k+1 tokens per row. Rows are padded to width k+1 with -1.

Each output token then has exactly the target's distribution, whatever q is. That includes a
draft token chosen by any rule that does not look at u, passed with q = None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.sampling import draw

PAD_ID = -1  # fills token_ids after each row's last output token


@dataclass(frozen=True)
class VerifyResult:
    token_ids: torch.Tensor  # (B, k+1) accepted drafts, then the recovered or bonus token, then PAD_ID
    num_accepted: torch.Tensor  # (B,) accepted draft tokens per row, 0..k

    @property
    def num_emitted(self) -> torch.Tensor:
        """Output tokens per row, (B,): the accepted drafts plus one recovered or bonus token."""
        return self.num_accepted + 1


def verify(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Accept a prefix of each row's drafts and append one recovered or bonus token.

    draft_token_ids: (B, k) integer ids x_0..x_{k-1}.
    draft_probs: (B, k, V) q, or None for deterministic (point-mass) drafts.
    target_probs: (B, k+1, V) p. Row k is used only for the bonus token.
    generator: the only randomness used. It must live on the same device as the tensors.
    """
    _check_shapes(draft_token_ids, draft_probs, target_probs)
    num_rows, k = draft_token_ids.shape
    vocab_size = target_probs.shape[2]
    dtype = _compute_dtype(draft_probs, target_probs)
    p = target_probs.to(dtype)  # (B, k+1, V)
    x = draft_token_ids.long()  # (B, k)

    p_of_draft = p[:, :k].gather(-1, x[..., None]).squeeze(-1)  # (B, k) p_i(x_i)
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)  # (B, k) point mass: q_i(x_i) = 1
    else:
        q_of_draft = draft_probs.gather(-1, x[..., None]).squeeze(-1).to(dtype)  # (B, k) q_i(x_i)

    u = torch.rand((num_rows, k), generator=generator, dtype=dtype, device=p.device)  # (B, k)
    accepted = u * q_of_draft < p_of_draft  # (B, k) u < p/q without dividing; p(x) = 0 never passes
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # (B,) length of the accepted prefix

    rows = torch.arange(num_rows, device=p.device)  # (B,)
    p_last = p[rows, num_accepted]  # (B, V) p at the first rejection, or p_k when all were accepted
    q_last = _draft_row(x, draft_probs, num_accepted, vocab_size, dtype)  # (B, V), zeros when all were accepted
    final = draw(_residual(p_last, q_last), generator)[:, None]  # (B, 1); greedy one-hot rows need no draw

    return VerifyResult(token_ids=_assemble(x, num_accepted, final), num_accepted=num_accepted)


def verify_greedy(draft_token_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, list[int]]:
    """`verify` for one greedy row with point-mass drafts, from the target's scores without building p.

    draft_token_ids: (k,) ids. target_logits: (k+1, V) scores whose one-hot argmax rows (ties to the
    lowest index) are p. A draft passes exactly when it is its row's argmax (u < p(x) / 1 with u in
    [0, 1) and p one-hot), and the recovered or bonus token of a one-hot p is its argmax. So this gives
    verify's tokens without its passes over the vocabulary, and draws nothing: a greedy row's output
    never depends on its generator. Returns (accepted drafts, the accepted drafts then the final token).
    """
    # max's indices, not argmax: the same token (the first maximum), and torch's CPU max reduction over a whole
    # vocabulary runs well ahead of its argmax; a greedy step pays it for every row it verifies.
    best = target_logits.max(dim=-1).indices.tolist()  # (k+1,) p's one token per position
    drafts = draft_token_ids.tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == best[accepted]:
        accepted += 1
    return accepted, drafts[:accepted] + [best[accepted]]


def _check_shapes(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor) -> None:
    """Raise ValueError unless the inputs are (B, k) ids, (B, k, V) q or None, and (B, k+1, V) p."""
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be (B, k), got shape {tuple(draft_token_ids.shape)}")
    id_dtype = draft_token_ids.dtype
    if id_dtype.is_floating_point or id_dtype.is_complex or id_dtype == torch.bool:
        raise ValueError(f"draft_token_ids must hold integer ids, got dtype {draft_token_ids.dtype}")
    num_rows, k = draft_token_ids.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (num_rows, k + 1):
        raise ValueError(
            f"target_probs must be (B, k+1, V) = ({num_rows}, {k + 1}, V) for draft_token_ids of shape "
            f"({num_rows}, {k}), got {tuple(target_probs.shape)}"
        )
    if not target_probs.dtype.is_floating_point:
        raise ValueError(f"target_probs must be floating point, got dtype {target_probs.dtype}")
    vocab = target_probs.shape[2]
    if vocab == 0:
        raise ValueError("target_probs has an empty vocabulary (V = 0)")
    if draft_probs is not None:
        if tuple(draft_probs.shape) != (num_rows, k, vocab):
            raise ValueError(
                f"draft_probs must be (B, k, V) = ({num_rows}, {k}, {vocab}) or None, got {tuple(draft_probs.shape)}"
            )
        if not draft_probs.dtype.is_floating_point:
            raise ValueError(f"draft_probs must be floating point, got dtype {draft_probs.dtype}")
    if draft_token_ids.numel() and bool(((draft_token_ids < 0) | (draft_token_ids >= vocab)).any()):
        raise ValueError(f"draft_token_ids must lie in [0, V) = [0, {vocab})")


def _compute_dtype(draft_probs: torch.Tensor | None, target_probs: torch.Tensor) -> torch.dtype:
    """The precision for the arithmetic: the wider of the inputs' dtypes, and at least float32."""
    dtype = torch.promote_types(target_probs.dtype, torch.float32)
    if draft_probs is not None:
        dtype = torch.promote_types(dtype, draft_probs.dtype)
    return dtype


def _draft_row(
    x: torch.Tensor, draft_probs: torch.Tensor | None, position: torch.Tensor, vocab_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """q at each row's given position, (B, V). Rows at position k get zeros, so the residual there is p_k.

    x: (B, k) drafts. position: (B,) in 0..k. With draft_probs None, q is one-hot at the draft.
    """
    num_rows, k = x.shape
    if k == 0:
        return torch.zeros((num_rows, vocab_size), dtype=dtype, device=x.device)  # (B, V)
    rows = torch.arange(num_rows, device=x.device)  # (B,)
    clamped = position.clamp(max=k - 1)  # (B,) a valid index even where position == k
    has_draft = (position < k)[:, None]  # (B, 1)
    if draft_probs is None:
        q_row = torch.zeros((num_rows, vocab_size), dtype=dtype, device=x.device)  # (B, V)
        return q_row.scatter_(1, x[rows, clamped][:, None], has_draft.to(dtype))  # (B, V) 1 at the draft, if any
    q_row = draft_probs[rows, clamped].to(dtype)  # (B, V) a copy (advanced indexing), ours to modify
    return q_row.masked_fill_(~has_draft, 0.0)  # (B, V)


def _residual(p_row: torch.Tensor, q_row: torch.Tensor) -> torch.Tensor:
    """Unnormalised max(p - q, 0) per row, (B, V), or p where that has (numerically) no mass.

    Falling back to p is safe. The residual mass equals the chance of a rejection at this
    position. So when the mass is below rounding level, the choice changes the output law by
    less than that.
    """
    residual = (p_row - q_row).clamp_(min=0)  # (B, V)
    mass = residual.sum(dim=-1, keepdim=True)  # (B, 1)
    has_mass = mass > torch.finfo(residual.dtype).eps  # (B, 1)
    if bool(has_mass.all()):
        return residual  # (B, V); the usual case, without a pass over the rows
    return torch.where(has_mass, residual, p_row)  # (B, V); multinomial normalises


def _assemble(x: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """Output rows (B, k+1): the accepted drafts, then the final token, then PAD_ID.

    x: (B, k) drafts. num_accepted: (B,). final: (B, 1) recovered or bonus token.
    """
    num_rows, k = x.shape
    padded = torch.cat([x, x.new_full((num_rows, 1), PAD_ID)], dim=1)  # (B, k+1)
    positions = torch.arange(k + 1, device=x.device)  # (k+1,)
    is_accepted = positions < num_accepted[:, None]  # (B, k+1)
    token_ids = torch.where(is_accepted, padded, torch.full_like(padded, PAD_ID))  # (B, k+1)
    return token_ids.scatter(1, num_accepted[:, None], final)  # (B, k+1)
