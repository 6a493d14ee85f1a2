"""Tests for verispec.verify: the accept/reject rule that makes speculative decoding lossless.

Four layers:

1. Hand-built cases whose outcome is forced (p == q, p(x) = 0, one-hot targets, k = 0, errors).
2. An exact oracle. `exact_output_law` enumerates every draft and every accept/reject event and
   returns the law of one output row. It is written from the rule alone and imports nothing from
   verispec. On it we check the theorem: the first output token follows p_0, and a token that
   follows accepted drafts follows its own p row, whatever the draft values were.
3. Statistics on the real function. With 60,000 draws in the batch dimension, we compare verify's
   output rows with the exact law and its first output token with p_0.
4. Negative controls. Two verifiers broken on purpose must fail the same check, which shows the
   check can fail.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from laws import accept_all_verifier, frequency_mismatch
from verispec.sampling import SamplingParams, logits_to_probs
from verispec.verify import PAD_ID, VerifyResult, verify, verify_greedy

NUM_DRAWS = 60_000  # rows per statistical check; each row is one independent verification


# ---- helpers --------------------------------------------------------------------------------


def random_distribution(shape: tuple[int, ...], seed: int, zero_fraction: float = 0.0) -> torch.Tensor:
    """Random float64 distributions over the last axis. Entries can be zeroed, but never a whole row."""
    gen = torch.Generator().manual_seed(seed)
    weights = -torch.rand(shape, generator=gen, dtype=torch.float64).log()  # (..., V) Exp(1): a flat Dirichlet
    if zero_fraction > 0:
        keep = torch.rand(shape, generator=gen) >= zero_fraction  # (..., V)
        keep |= torch.nn.functional.one_hot(weights.argmax(-1), shape[-1]).bool()  # (..., V) never empty
        weights = weights * keep
    return weights / weights.sum(-1, keepdim=True)  # (..., V)


def draw_drafts(q: torch.Tensor, num_rows: int, seed: int) -> torch.Tensor:
    """Draft ids (N, k), with x_i drawn from q_i (k, V) independently for every row."""
    if q.shape[0] == 0:
        return torch.zeros((num_rows, 0), dtype=torch.long)  # (N, 0)
    gen = torch.Generator().manual_seed(seed)
    return torch.multinomial(q.float(), num_rows, replacement=True, generator=gen).T  # (N, k)


def one_hot_rows(ids: list[int], vocab_size: int) -> torch.Tensor:
    """Greedy target rows (len(ids), V): one-hot at each id."""
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab_size).double()  # (k+1, V)


def exact_output_law(p: torch.Tensor, q: torch.Tensor, point_mass: bool = False) -> dict[tuple[int, ...], float]:
    """Exact law of one output row (k+1 ids, PAD_ID-padded), from the rule written out by hand.

    p: (k+1, V) target rows. q: (k, V) law that draft x_i is drawn from. With point_mass=True
    the verifier is not told q (draft_probs=None) and treats each draft as certain: it
    accepts x with probability p(x) and recovers from p with x removed.
    """
    k, vocab_size = q.shape[0], p.shape[1]
    p_rows, q_rows = p.tolist(), q.tolist()
    law: dict[tuple[int, ...], float] = defaultdict(float)

    def emit(prefix: tuple[int, ...], weights: list[float], mass: float) -> None:
        total = sum(weights)
        for y, w in enumerate(weights):
            if w > 0 and mass > 0:
                law[prefix + (y,) + (PAD_ID,) * (k - len(prefix))] += mass * w / total

    def walk(i: int, prefix: tuple[int, ...], mass: float) -> None:
        if i == k:
            emit(prefix, p_rows[k], mass)  # bonus token
            return
        for x in range(vocab_size):
            if q_rows[i][x] == 0:
                continue
            seen_q = [float(v == x) for v in range(vocab_size)] if point_mass else q_rows[i]
            accept = min(1.0, p_rows[i][x] / seen_q[x])
            if accept > 0:
                walk(i + 1, prefix + (x,), mass * q_rows[i][x] * accept)
            if accept < 1:
                residual = [max(a - b, 0.0) for a, b in zip(p_rows[i], seen_q)]
                emit(prefix, residual if sum(residual) > 0 else p_rows[i], mass * q_rows[i][x] * (1 - accept))

    walk(0, (), 1.0)
    return dict(law)


def marginal(
    law: dict[tuple[int, ...], float], position: int, given_prefix: tuple[int, ...], vocab_size: int
) -> torch.Tensor:
    """Law (V,) of the output token at `position`, given the rows start with the accepted drafts given_prefix."""
    probs = torch.zeros(vocab_size, dtype=torch.float64)  # (V,)
    for row, mass in law.items():
        if row[: len(given_prefix)] == given_prefix and row[position] != PAD_ID:
            probs[row[position]] += mass
    return probs / probs.sum()


def encode_rows(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """One integer per output row (N, k+1) -> (N,), treating PAD_ID as digit V in base V+1."""
    digits = torch.where(token_ids == PAD_ID, vocab_size, token_ids)  # (N, k+1)
    place = (vocab_size + 1) ** torch.arange(token_ids.shape[1])  # (k+1,)
    return (digits * place).sum(-1)  # (N,)


def law_as_tensor(law: dict[tuple[int, ...], float], vocab_size: int, width: int) -> torch.Tensor:
    """The law of output rows as a dense vector over the codes of encode_rows, ((V+1)^width,)."""
    probs = torch.zeros((vocab_size + 1) ** width, dtype=torch.float64)  # (M,)
    for row, mass in law.items():
        probs[encode_rows(torch.tensor([row]), vocab_size)] += mass
    return probs


def run_verify(verifier, p: torch.Tensor, q: torch.Tensor, point_mass: bool, seed: int) -> VerifyResult:
    """Run NUM_DRAWS independent verifications of drafts drawn from q (k, V) against p (k+1, V)."""
    drafts = draw_drafts(q, NUM_DRAWS, seed)  # (N, k)
    target = p.expand(NUM_DRAWS, -1, -1)  # (N, k+1, V)
    draft_probs = None if point_mass else q.expand(NUM_DRAWS, -1, -1)  # (N, k, V)
    return verifier(drafts, draft_probs, target, torch.Generator().manual_seed(seed + 1))


# ---- negative controls: broken on purpose ----------------------------------------------------


def resample_from_p_verifier(draft_token_ids, draft_probs, target_probs, generator=None) -> VerifyResult:
    """BROKEN on purpose: a correct acceptance test, but it recovers from p_j, not max(p_j - q_j, 0)."""
    num_rows, k = draft_token_ids.shape
    p_of_draft = target_probs[:, :k].gather(-1, draft_token_ids[..., None]).squeeze(-1)  # (B, k)
    q_of_draft = draft_probs[:, :k].gather(-1, draft_token_ids[..., None]).squeeze(-1)  # (B, k)
    u = torch.rand((num_rows, k), generator=generator, dtype=target_probs.dtype)  # (B, k)
    num_accepted = (u * q_of_draft < p_of_draft).long().cumprod(-1).sum(-1)  # (B,)
    p_last = target_probs[torch.arange(num_rows), num_accepted]  # (B, V) the bug: p_j, not the residual
    final = torch.multinomial(p_last.float(), 1, generator=generator)  # (B, 1)
    padded = torch.cat([draft_token_ids, final], dim=1)  # (B, k+1)
    positions = torch.arange(k + 1)  # (k+1,)
    token_ids = torch.where(positions < num_accepted[:, None], padded, PAD_ID)  # (B, k+1)
    return VerifyResult(token_ids.scatter(1, num_accepted[:, None], final), num_accepted)


# ---- hand-built cases -----------------------------------------------------------------------


def test_equal_p_and_q_accepts_every_draft() -> None:
    p = random_distribution((500, 4, 6), seed=0)  # (B, k+1, V)
    q = p[:, :3].clone()  # (B, k, V)
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q.reshape(-1, 6).float(), 1, generator=gen).reshape(500, 3)  # (B, k) x_i ~ q_i
    result = verify(drafts, q, p, torch.Generator().manual_seed(1))
    assert (result.num_accepted == 3).all()
    assert torch.equal(result.token_ids[:, :3], drafts)
    assert (p[:, 3].gather(-1, result.token_ids[:, 3:]) > 0).all()


@pytest.mark.parametrize("point_mass", [False, True])
def test_draft_with_zero_target_probability_is_rejected_and_replaced(point_mass: bool) -> None:
    num_rows = 1000
    p = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]).expand(num_rows, 2, 3)  # (B, k+1, V)
    q = None if point_mass else torch.tensor([[0.9, 0.05, 0.05]]).expand(num_rows, 1, 3)  # (B, k, V)
    drafts = torch.zeros((num_rows, 1), dtype=torch.long)  # (B, k)
    result = verify(drafts, q, p, torch.Generator().manual_seed(2))
    assert (result.num_accepted == 0).all()
    assert set(result.token_ids[:, 0].tolist()) == {1, 2}
    assert (result.token_ids[:, 1] == PAD_ID).all()


def test_point_mass_draft_with_target_probability_one_is_accepted() -> None:
    p = one_hot_rows([2, 0], 3).expand(100, 2, 3)  # (B, k+1, V)
    result = verify(torch.full((100, 1), 2), None, p, torch.Generator().manual_seed(3))
    assert (result.num_accepted == 1).all()
    assert (result.token_ids == torch.tensor([2, 0])).all()


@pytest.mark.parametrize("point_mass", [False, True])
def test_one_hot_targets_accept_the_matching_prefix_then_emit_argmax(point_mass: bool) -> None:
    p = one_hot_rows([2, 1, 3, 0], 5).expand(4, 4, 5)  # (B, k+1, V) greedy target argmaxes 2, 1, 3, 0
    drafts = torch.tensor([[2, 1, 0], [2, 1, 3], [0, 1, 3], [2, 0, 3]])  # (B, k)
    q = None if point_mass else random_distribution((4, 3, 5), seed=4)  # (B, k, V)
    result = verify(drafts, q, p, torch.Generator().manual_seed(5))
    assert result.num_accepted.tolist() == [2, 3, 0, 1]
    assert result.num_emitted.tolist() == [3, 4, 1, 2]
    assert result.token_ids.tolist() == [[2, 1, 3, -1], [2, 1, 3, 0], [2, -1, -1, -1], [2, 1, -1, -1]]


def test_one_hot_targets_emit_the_argmax_without_a_draw_from_the_generator() -> None:
    """Greedy rows over a real-size vocabulary: the final token needs no randomness, so only u is drawn."""
    vocab_size = 151_936
    p = one_hot_rows([7, 150_000, 42], vocab_size).float().expand(2, 3, vocab_size)  # (B, k+1, V) as greedy makes them
    drafts = torch.tensor([[7, 150_000], [7, 9]])  # (B, k): all accepted (bonus), rejected at 1 (recovered)
    generator = torch.Generator().manual_seed(13)
    result = verify(drafts, None, p, generator)
    assert result.token_ids.tolist() == [[7, 150_000, 42], [7, 150_000, PAD_ID]]
    only_u = torch.Generator().manual_seed(13)
    torch.rand((2, 2), generator=only_u, dtype=torch.float32)  # verify's acceptance draws, nothing more
    assert torch.equal(generator.get_state(), only_u.get_state())


@given(st.integers(0, 5), st.integers(0, 2**31 - 1), st.booleans())
@settings(max_examples=60, deadline=None)
def test_greedy_verify_from_scores_gives_verifys_tokens(k: int, seed: int, ties: bool) -> None:
    """verify_greedy (the scheduler's greedy path) returns what verify does on the one-hot rows greedy makes of the
    same scores: matching prefixes, rejections, the bonus token, and ties to the lowest index."""
    generator = torch.Generator().manual_seed(seed)
    vocab_size = 6
    logits = torch.randn(k + 1, vocab_size, generator=generator)  # (k+1, V)
    if ties:
        logits = logits.round()  # many rows with equal maxima
    best = logits.argmax(-1)
    drafts = best[:k].clone()  # (k,) right up to a random position, then anything
    wrong_from = int(torch.randint(0, k + 1, (1,), generator=generator))
    drafts[wrong_from:] = torch.randint(0, vocab_size, (k - wrong_from,), generator=generator)
    p = logits_to_probs(logits[None], SamplingParams(temperature=0.0))  # (1, k+1, V)
    result = verify(drafts[None], None, p, torch.Generator().manual_seed(0))
    accepted = int(result.num_accepted[0])
    assert verify_greedy(drafts, logits) == (accepted, result.token_ids[0, : accepted + 1].tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_verify_breaks_ties_to_the_lowest_index_over_a_real_vocabulary(dtype) -> None:
    """Over a real model's vocabulary (its rows span many vector lanes) verify_greedy's token is still the first
    maximum, argmax's and plain decoding's, wherever the tied maxima fall."""
    vocab_size = 151_936
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, vocab_size, generator=generator).to(dtype)  # (k+1, V), k = 3
    tied = [[7, 8, 151_935], [0, 64, 100_000], [151_934, 151_935], [33, 17]]
    for row, positions in enumerate(tied):
        logits[row, positions] = 9.0
    drafts = torch.tensor([7, 0, 151_934])  # (k,) each its row's first maximum
    assert verify_greedy(drafts, logits) == (3, [7, 0, 151_934, 17])
    assert verify_greedy(torch.tensor([8, 0, 151_934]), logits) == (0, [7])  # a later tied maximum is rejected
    assert logits.argmax(-1).tolist() == [7, 0, 151_934, 17]


def test_batch_mixing_one_hot_and_spread_targets_keeps_both_laws() -> None:
    """k = 0: even rows are greedy (always the argmax), odd rows draw their bonus from p0."""
    p0 = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)  # (V,)
    greedy = one_hot_rows([2], 3)[0]  # (V,)
    p = torch.stack([greedy, p0]).repeat(NUM_DRAWS, 1)[:, None]  # (2N, 1, V)
    result = verify(torch.zeros((2 * NUM_DRAWS, 0), dtype=torch.long), None, p, torch.Generator().manual_seed(14))
    assert (result.token_ids[0::2, 0] == 2).all()
    assert frequency_mismatch(result.token_ids[1::2, 0], p0) is None


def test_k_zero_samples_the_bonus_from_p0() -> None:
    p = one_hot_rows([3], 4).expand(6, 1, 4)  # (B, 1, V)
    drafts = torch.zeros((6, 0), dtype=torch.long)  # (B, 0)
    for q in (None, torch.zeros((6, 0, 4))):
        result = verify(drafts, q, p, torch.Generator().manual_seed(6))
        assert result.token_ids.shape == (6, 1)
        assert (result.token_ids == 3).all()
        assert (result.num_accepted == 0).all() and (result.num_emitted == 1).all()


def test_k_zero_bonus_follows_p0() -> None:
    p0 = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)  # (V,)
    drafts = torch.zeros((NUM_DRAWS, 0), dtype=torch.long)  # (N, 0)
    result = verify(drafts, None, p0.expand(NUM_DRAWS, 1, 3), torch.Generator().manual_seed(7))
    assert frequency_mismatch(result.token_ids[:, 0], p0) is None


def test_rows_of_a_batch_do_not_interact() -> None:
    # Row 0: p == q (always accepted). Row 1: the draft has p = 0 (always rejected). Row 2: greedy.
    p = torch.stack(
        [
            torch.tensor([[0.2, 0.8, 0.0], [0.5, 0.5, 0.0]]),
            torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]),
            torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]),
        ]
    )  # (B, k+1, V)
    q = torch.stack([p[0, :1], torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([[0.1, 0.8, 0.1]])])  # (B, k, V)
    drafts = torch.tensor([[1], [0], [1]])  # (B, k)
    for seed in range(20):
        result = verify(drafts, q, p, torch.Generator().manual_seed(seed))
        assert result.num_accepted.tolist() == [1, 0, 1]
        assert result.token_ids[1].tolist() == [2, PAD_ID]
        assert result.token_ids[2].tolist() == [1, 2]
        assert result.token_ids[0, 0] == 1 and result.token_ids[0, 1] in (0, 1)


def test_degenerate_residual_falls_back_to_p() -> None:
    # q is not a distribution here (sums to 2), so max(p - q, 0) is all zeros after the rejection.
    p = torch.tensor([[[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]]).expand(200, 2, 3)  # (B, k+1, V)
    q = torch.tensor([[[1.0, 0.5, 0.5]]]).expand(200, 1, 3)  # (B, k, V)
    result = verify(torch.zeros((200, 1), dtype=torch.long), q, p, torch.Generator().manual_seed(8))
    assert (result.num_accepted == 0).all()
    assert set(result.token_ids[:, 0].tolist()) == {1, 2}


@pytest.mark.parametrize(
    ("p_dtype", "q_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        (torch.float32, torch.float64),
        (torch.float16, torch.bfloat16),
    ],
)
def test_accepts_float_dtypes(p_dtype: torch.dtype, q_dtype: torch.dtype) -> None:
    p = random_distribution((64, 3, 5), seed=9).to(p_dtype)  # (B, k+1, V)
    q = random_distribution((64, 2, 5), seed=10).to(q_dtype)  # (B, k, V)
    drafts = torch.randint(0, 5, (64, 2), generator=torch.Generator().manual_seed(11))  # (B, k)
    result = verify(drafts, q, p, torch.Generator().manual_seed(12))
    assert result.token_ids.dtype == torch.long and result.num_accepted.dtype == torch.long
    assert result.token_ids.shape == (64, 3)


def test_inputs_are_not_modified_and_global_rng_is_untouched() -> None:
    p = random_distribution((32, 3, 4), seed=13)  # (B, k+1, V)
    q = random_distribution((32, 2, 4), seed=14)  # (B, k, V)
    drafts = torch.randint(0, 4, (32, 2), generator=torch.Generator().manual_seed(15))  # (B, k)
    copies = (p.clone(), q.clone(), drafts.clone())
    rng_before = torch.get_rng_state()
    verify(drafts, q, p, torch.Generator().manual_seed(16))
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert all(torch.equal(a, b) for a, b in zip(copies, (p, q, drafts)))


def test_without_generator_uses_global_rng() -> None:
    p = random_distribution((8, 2, 4), seed=17)  # (B, k+1, V)
    result = verify(torch.zeros((8, 1), dtype=torch.long), None, p)
    assert result.token_ids.shape == (8, 2)


def test_same_seed_same_result_different_seed_different_result() -> None:
    p = random_distribution((2000, 4, 6), seed=18)  # (B, k+1, V)
    q = random_distribution((2000, 3, 6), seed=19)  # (B, k, V)
    drafts = torch.randint(0, 6, (2000, 3), generator=torch.Generator().manual_seed(20))  # (B, k)
    first = verify(drafts, q, p, torch.Generator().manual_seed(21))
    again = verify(drafts, q, p, torch.Generator().manual_seed(21))
    other = verify(drafts, q, p, torch.Generator().manual_seed(22))
    assert torch.equal(first.token_ids, again.token_ids) and torch.equal(first.num_accepted, again.num_accepted)
    assert not torch.equal(first.token_ids, other.token_ids)


@pytest.mark.parametrize(
    ("drafts", "q", "p", "message"),
    [
        (torch.zeros(4, dtype=torch.long), None, torch.rand(4, 2, 5), "draft_token_ids must be"),
        (torch.zeros((4, 1)), None, torch.rand(4, 2, 5), "integer"),
        (torch.zeros((4, 1), dtype=torch.long), None, torch.rand(4, 1, 5), "target_probs must be"),
        (torch.zeros((4, 1), dtype=torch.long), None, torch.rand(3, 2, 5), "target_probs must be"),
        (torch.zeros((4, 1), dtype=torch.long), None, torch.rand(4, 2), "target_probs must be"),
        (torch.zeros((4, 1), dtype=torch.long), None, torch.ones(4, 2, 5, dtype=torch.long), "floating"),
        (torch.zeros((4, 1), dtype=torch.long), torch.rand(4, 1, 6), torch.rand(4, 2, 5), "draft_probs must be"),
        (torch.zeros((4, 1), dtype=torch.long), torch.rand(4, 2, 5), torch.rand(4, 2, 5), "draft_probs must be"),
        (torch.zeros((4, 1), dtype=torch.long), torch.ones(4, 1, 5, dtype=torch.long), torch.rand(4, 2, 5), "floating"),
        (torch.full((4, 1), 5), None, torch.rand(4, 2, 5), r"\[0, V\)"),
        (torch.full((4, 1), -1), None, torch.rand(4, 2, 5), r"\[0, V\)"),
        (torch.zeros((4, 1), dtype=torch.long), None, torch.rand(4, 2, 0), "empty vocabulary"),
    ],
)
def test_bad_inputs_raise_clear_errors(drafts, q, p, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        verify(drafts, q, p, torch.Generator().manual_seed(0))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    num_rows=st.integers(1, 4),
    k=st.integers(0, 4),
    vocab_size=st.integers(1, 6),
    zero_fraction=st.sampled_from([0.0, 0.4, 0.8]),
    point_mass=st.booleans(),
)
def test_output_rows_are_well_formed(
    seed: int, num_rows: int, k: int, vocab_size: int, zero_fraction: float, point_mass: bool
) -> None:
    """Accepted drafts first, then one token with p > 0, then padding; accepted drafts have p > 0."""
    p = random_distribution((num_rows, k + 1, vocab_size), seed, zero_fraction)  # (B, k+1, V)
    q = random_distribution((num_rows, k, vocab_size), seed + 1, zero_fraction)  # (B, k, V)
    drafts = torch.stack([draw_drafts(q[b], 1, seed + 2 + b)[0] for b in range(num_rows)])  # (B, k)
    result = verify(drafts, None if point_mass else q, p, torch.Generator().manual_seed(seed))
    assert result.token_ids.shape == (num_rows, k + 1) and result.num_accepted.shape == (num_rows,)
    for b in range(num_rows):
        n = int(result.num_accepted[b])
        row = result.token_ids[b]
        assert 0 <= n <= k
        assert torch.equal(row[:n], drafts[b, :n])
        assert (p[b, torch.arange(n), drafts[b, :n]] > 0).all()
        assert 0 <= row[n] < vocab_size and p[b, n, row[n]] > 0
        assert (row[n + 1 :] == PAD_ID).all()


# ---- the exact law (the theorem, on an oracle independent of verispec) ----------------------


EXACT_CASES = {
    "random V=3 k=1": (random_distribution((2, 3), 30), random_distribution((1, 3), 31)),
    "random V=4 k=2": (random_distribution((3, 4), 32), random_distribution((2, 4), 33)),
    "sparse V=4 k=2": (random_distribution((3, 4), 34, 0.5), random_distribution((2, 4), 35, 0.5)),
    "p == q V=4 k=2": (random_distribution((3, 4), 36), random_distribution((3, 4), 36)[:2]),
    "disjoint supports": (
        torch.tensor([[0.5, 0.5, 0, 0], [0, 0, 0.3, 0.7], [0.25] * 4], dtype=torch.float64),
        torch.tensor([[0, 0, 0.5, 0.5], [0.6, 0.4, 0, 0]], dtype=torch.float64),
    ),
    "one-hot target": (one_hot_rows([1, 3, 0], 4), random_distribution((2, 4), 37)),
    "one-hot draft": (random_distribution((3, 4), 38), one_hot_rows([2, 2], 4)),
}


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_exact_law_first_output_token_is_p0(case: str, point_mass: bool) -> None:
    p, q = EXACT_CASES[case]
    law = exact_output_law(p, q, point_mass)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    torch.testing.assert_close(marginal(law, 0, (), p.shape[1]), p[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("case", [c for c in EXACT_CASES if EXACT_CASES[c][1].shape[0] == 2])
def test_exact_law_tokens_after_accepted_drafts_follow_their_p_row(case: str, point_mass: bool) -> None:
    """For every accepted prefix of any value, the next output token follows p at that position."""
    p, q = EXACT_CASES[case]
    vocab_size = p.shape[1]
    law = exact_output_law(p, q, point_mass)
    for a in range(vocab_size):
        if any(row[0] == a and row[1] != PAD_ID for row in law):
            torch.testing.assert_close(marginal(law, 1, (a,), vocab_size), p[1], atol=1e-12, rtol=0)
        for b in range(vocab_size):
            if any(row[:2] == (a, b) and row[2] != PAD_ID for row in law):
                torch.testing.assert_close(marginal(law, 2, (a, b), vocab_size), p[2], atol=1e-12, rtol=0)


@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_exact_law_acceptance_rate_is_sum_of_min_p_q(case: str) -> None:
    p, q = EXACT_CASES[case]
    law = exact_output_law(p, q)
    k = q.shape[0]
    accepted_first = sum(mass for row, mass in law.items() if k >= 1 and row[1] != PAD_ID)
    assert accepted_first == pytest.approx(float(torch.minimum(p[0], q[0]).sum()), abs=1e-12)


# ---- the real function against the exact law (statistics) -----------------------------------


STAT_CASES = [
    ("random V=4 k=2", False),
    ("random V=4 k=2", True),
    ("random V=3 k=1", False),
    ("sparse V=4 k=2", False),
    ("sparse V=4 k=2", True),
    ("p == q V=4 k=2", False),
    ("disjoint supports", False),
    ("one-hot draft", False),
]


@pytest.mark.parametrize(("case", "point_mass"), STAT_CASES)
def test_output_rows_follow_the_exact_law(case: str, point_mass: bool) -> None:
    p, q = EXACT_CASES[case]
    vocab_size, width = p.shape[1], p.shape[0]
    result = run_verify(verify, p, q, point_mass, seed=40)
    expected = law_as_tensor(exact_output_law(p, q, point_mass), vocab_size, width)  # (M,)
    mismatch = frequency_mismatch(encode_rows(result.token_ids, vocab_size), expected)
    assert mismatch is None, mismatch


@pytest.mark.parametrize(("case", "point_mass"), STAT_CASES)
def test_first_output_token_follows_p0(case: str, point_mass: bool) -> None:
    p, q = EXACT_CASES[case]
    result = run_verify(verify, p, q, point_mass, seed=41)
    mismatch = frequency_mismatch(result.token_ids[:, 0], p[0])
    assert mismatch is None, mismatch


@pytest.mark.parametrize("point_mass", [False, True])
def test_later_output_tokens_follow_their_p_rows(point_mass: bool) -> None:
    """k = 2: after one accepted draft the next token follows p_1; after two, the bonus follows p_2."""
    p, q = EXACT_CASES["random V=4 k=2"]
    result = run_verify(verify, p, q, point_mass, seed=42)
    after_one = result.num_accepted >= 1  # (N,)
    after_two = result.num_accepted == 2  # (N,)
    assert after_one.sum() > 10_000 and after_two.sum() > 3_000
    assert frequency_mismatch(result.token_ids[after_one, 1], p[1]) is None
    assert frequency_mismatch(result.token_ids[after_two, 2], p[2]) is None


def test_acceptance_rate_is_sum_of_min_p_q() -> None:
    p, q = EXACT_CASES["random V=4 k=2"]
    result = run_verify(verify, p, q, False, seed=43)
    rate = float(torch.minimum(p[0], q[0]).sum())
    observed = float((result.num_accepted >= 1).double().mean())
    assert abs(observed - rate) <= 5 * (rate * (1 - rate) / NUM_DRAWS) ** 0.5


@pytest.mark.parametrize("point_mass", [False, True])
def test_large_vocabulary_first_token_follows_p0(point_mass: bool) -> None:
    """V = 50, k = 3, sparse rows: the residual must cover the whole vocabulary."""
    p = random_distribution((4, 50), 44, zero_fraction=0.3)  # (k+1, V)
    q = random_distribution((3, 50), 45, zero_fraction=0.3)  # (k, V)
    result = run_verify(verify, p, q, point_mass, seed=46)
    mismatch = frequency_mismatch(result.token_ids[:, 0], p[0])
    assert mismatch is None, mismatch


def test_point_mass_drafts_from_any_proposal_are_lossless() -> None:
    """Drafts chosen by a fixed rule (here: always token 0, then always token 2) with q = None."""
    p = random_distribution((3, 4), 47)  # (k+1, V)
    drafts = torch.tensor([0, 2]).expand(NUM_DRAWS, 2)  # (N, k)
    result = verify(drafts, None, p.expand(NUM_DRAWS, -1, -1), torch.Generator().manual_seed(48))
    assert frequency_mismatch(result.token_ids[:, 0], p[0]) is None
    assert frequency_mismatch(result.token_ids[result.num_accepted >= 1, 1], p[1]) is None


@pytest.mark.parametrize("point_mass", [False, True])
def test_one_hot_targets_always_emit_the_argmax_sequence(point_mass: bool) -> None:
    argmaxes = [1, 3, 0, 2]
    p = one_hot_rows(argmaxes, 4)  # (k+1, V)
    q = random_distribution((3, 4), 49)  # (k, V)
    result = run_verify(verify, p, q, point_mass, seed=50)
    drafts = draw_drafts(q, NUM_DRAWS, 50)  # (N, k) the drafts run_verify used
    matches = (drafts == torch.tensor(argmaxes[:3])).long()  # (N, k)
    expected_accepted = matches.cumprod(-1).sum(-1)  # (N,)
    assert torch.equal(result.num_accepted, expected_accepted)
    emitted = torch.arange(4) <= expected_accepted[:, None]  # (N, k+1)
    expected_ids = torch.where(emitted, torch.tensor(argmaxes), PAD_ID)  # (N, k+1)
    assert torch.equal(result.token_ids, expected_ids)


# ---- negative controls ----------------------------------------------------------------------


@pytest.mark.parametrize("broken", [accept_all_verifier, resample_from_p_verifier])
def test_broken_verifiers_fail_the_same_checks(broken) -> None:
    p, q = EXACT_CASES["random V=4 k=2"]
    result = run_verify(broken, p, q, False, seed=41)
    assert frequency_mismatch(result.token_ids[:, 0], p[0]) is not None
    expected = law_as_tensor(exact_output_law(p, q), 4, 3)  # (M,)
    assert frequency_mismatch(encode_rows(result.token_ids, 4), expected) is not None


def test_negative_control_case_is_far_from_lossless() -> None:
    """Accept-all emits x_0 ~ q_0 first, and q_0 is far from p_0 here, so the check has a real gap to find."""
    p, q = EXACT_CASES["random V=4 k=2"]
    assert (q[0] - p[0]).abs().max() > 0.05
    result = run_verify(accept_all_verifier, p, q, False, seed=51)
    assert frequency_mismatch(result.token_ids[:, 0], q[0]) is None
