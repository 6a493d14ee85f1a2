"""Tests for verispec.sampling: parameter validation, each filter, their order, shapes, sampling."""

from __future__ import annotations

import math

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec import sampling
from verispec.sampling import SamplingParams, draw, logits_to_probs, sample

PROBS_4 = torch.tensor([0.4, 0.3, 0.2, 0.1])  # (V,) a reference distribution with distinct values
LOGITS_4 = PROBS_4.log()  # (V,) softmax(LOGITS_4) == PROBS_4


# ---- SamplingParams -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", -0.1),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("min_p", -0.1),
        ("min_p", 1.01),
        ("min_p", math.nan),
    ],
)
def test_invalid_params_raise_naming_the_parameter(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_boundary_params_are_valid() -> None:
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
    SamplingParams(temperature=1e-6, top_k=1, top_p=1e-9, min_p=1.0)


def test_greedy_property_and_defaults() -> None:
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0, top_k=5).greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_params_are_frozen() -> None:
    params = SamplingParams(temperature=1.0)
    with pytest.raises(AttributeError):
        params.temperature = 2.0  # type: ignore[misc]


# ---- greedy ---------------------------------------------------------------------------------


def test_greedy_is_one_hot_at_argmax_with_ties_to_lowest_index() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 2.0, 5.0]])  # (2, V)
    probs = logits_to_probs(logits, SamplingParams())  # (2, V)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_greedy_rows_equal_one_hot_of_the_argmax_bit_for_bit() -> None:
    logits = torch.randn(2, 3, 1000, generator=torch.Generator().manual_seed(1)).bfloat16()  # (2, 3, V) with ties
    expected = torch.nn.functional.one_hot(logits.argmax(-1), 1000).float()  # (2, 3, V)
    assert torch.equal(logits_to_probs(logits, SamplingParams()), expected)


def test_greedy_ignores_the_other_filters() -> None:
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))  # (3, 5, V)
    plain = logits_to_probs(logits, SamplingParams())
    filtered = logits_to_probs(logits, SamplingParams(top_k=3, top_p=0.2, min_p=0.5))
    assert torch.equal(plain, filtered)
    assert torch.equal(plain.argmax(-1), logits.argmax(-1))


# ---- temperature ----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.25, 1.0, 2.0, 10.0])
def test_temperature_divides_the_logits(temperature: float) -> None:
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(1))  # (4, V)
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature))  # (4, V)
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))


def test_higher_temperature_flattens_the_distribution() -> None:
    def entropy(probs: torch.Tensor) -> float:
        return float(-(probs * probs.clamp_min(1e-30).log()).sum())

    cold = logits_to_probs(LOGITS_4, SamplingParams(temperature=0.5))
    warm = logits_to_probs(LOGITS_4, SamplingParams(temperature=1.0))
    hot = logits_to_probs(LOGITS_4, SamplingParams(temperature=4.0))
    assert entropy(cold) < entropy(warm) < entropy(hot)


# ---- top-k ----------------------------------------------------------------------------------


def test_top_k_keeps_the_k_largest_and_renormalises() -> None:
    probs = logits_to_probs(LOGITS_4, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs, torch.tensor([0.4, 0.3, 0.0, 0.0]) / 0.7)


@pytest.mark.parametrize("top_k", [4, 100])
def test_top_k_at_or_above_vocab_is_a_no_op(top_k: int) -> None:
    probs = logits_to_probs(LOGITS_4, SamplingParams(temperature=1.0, top_k=top_k))
    torch.testing.assert_close(probs, PROBS_4)


def test_top_k_keeps_ties_at_the_boundary() -> None:
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0])  # (V,) tokens 1 and 2 tie for second place
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs[:3] > 0).all() and probs[3] == 0


# ---- top-p ----------------------------------------------------------------------------------


def top_p_kept(scores: torch.Tensor, top_p: float, candidates: int) -> torch.Tensor:
    """(..., V) bool: the tokens top-p keeps when it ranks the `candidates` highest scores first."""
    with mock.patch.object(sampling, "TOP_P_CANDIDATES", candidates):
        return sampling._top_p(scores, top_p).isfinite()


def test_top_p_from_the_highest_scores_keeps_what_sorting_the_whole_row_keeps() -> None:
    """The fast path (the highest scores ranked alone) against the whole row sorted: ties cut at any place, -inf
    scores, and rows whose candidates hold too little (sorted whole) beside rows that do not, in one batch."""
    generator = torch.Generator().manual_seed(7)
    peaked = torch.randn(8, 500, generator=generator) * 5  # (B, V) a few tokens hold most of the mass
    tied = (torch.randn(8, 500, generator=generator) * 3).round()  # (B, V) ties at every score
    tied[:, torch.randperm(500, generator=generator)[:12]] = 9.0  # twelve tokens tie for the top, scattered
    flat = torch.randn(4, 500, generator=generator) * 0.05  # (B, V) the 32 highest hold about 6%
    masked = peaked.masked_fill(torch.rand(8, 500, generator=generator) < 0.9, float("-inf"))  # after top-k
    found = {True: 0, False: 0}
    among_candidates = sampling._top_p_among_candidates

    def counted(*args):
        kept = among_candidates(*args)
        found[kept is not None] += 1
        return kept

    with mock.patch.object(sampling, "_top_p_among_candidates", counted):
        for rows in (peaked, tied, flat, masked, torch.cat([peaked, flat]), tied[0]):
            for top_p in (0.05, 0.3, 0.8, 0.95, 0.999):
                whole = top_p_kept(rows, top_p, 10**9)
                assert torch.equal(top_p_kept(rows, top_p, 32), whole), (rows.shape, top_p)
                assert torch.equal(top_p_kept(rows, top_p, 1), whole)
    assert found[True] >= 15 and found[False] >= 15, found  # both ways were taken
    assert top_p_kept(tied, 0.3, 32).sum(-1).min() >= 1


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    values=st.lists(st.sampled_from([-math.inf, -3.0, 0.0, 0.5, 1.0, 2.0, 7.0]) | st.floats(-20, 20), min_size=2,
                    max_size=12),
    top_p=st.floats(0.01, 0.999),
    candidates=st.integers(1, 11),
)
def test_top_p_keeps_the_same_tokens_however_many_candidates_it_ranks_first(
    values: list[float], top_p: float, candidates: int
) -> None:
    scores = torch.tensor(values)  # (V,) ties and -inf drawn often
    if not scores.isfinite().any():
        scores[0] = 0.0
    assert torch.equal(top_p_kept(scores, top_p, candidates), top_p_kept(scores, top_p, 10**9))


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.05, 1), (0.39, 1), (0.41, 2), (0.69, 2), (0.71, 3), (0.91, 4), (1.0, 4)],
)
def test_top_p_keeps_the_smallest_head_reaching_top_p(top_p: float, kept: int) -> None:
    probs = logits_to_probs(LOGITS_4, SamplingParams(temperature=1.0, top_p=top_p))
    expected = torch.cat([PROBS_4[:kept], torch.zeros(4 - kept)])  # (V,)
    torch.testing.assert_close(probs, expected / expected.sum())


def test_top_p_breaks_ties_towards_the_lowest_index() -> None:
    logits = torch.tensor([0.0, 1.0, 1.0, 1.0])  # (V,) three tied top tokens, each about 0.30
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.25))
    torch.testing.assert_close(probs, torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_top_p_works_on_unsorted_vocabulary_order() -> None:
    order = torch.tensor([2, 0, 3, 1])  # (V,) shuffles the reference distribution
    probs = logits_to_probs(LOGITS_4[order], SamplingParams(temperature=1.0, top_p=0.6))
    expected = torch.tensor([0.4, 0.3, 0.0, 0.0])[order]  # (V,)
    torch.testing.assert_close(probs, expected / 0.7)


# ---- min-p ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("min_p", "kept"),
    [(0.0, 4), (0.2, 4), (0.3, 3), (0.6, 2), (0.8, 1), (1.0, 1)],
)
def test_min_p_drops_tokens_below_a_fraction_of_the_max(min_p: float, kept: int) -> None:
    probs = logits_to_probs(LOGITS_4, SamplingParams(temperature=1.0, min_p=min_p))
    expected = torch.cat([PROBS_4[:kept], torch.zeros(4 - kept)])  # (V,)
    torch.testing.assert_close(probs, expected / expected.sum())


# ---- filter order ---------------------------------------------------------------------------


def test_top_k_runs_before_top_p() -> None:
    # top-k=2 leaves [4/7, 3/7]; top-p=0.5 on that keeps only the first token. The other order
    # (top-p on [0.4, 0.3, 0.2, 0.1] keeps two tokens, then top-k keeps both) would give [4/7, 3/7].
    probs = logits_to_probs(LOGITS_4, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    torch.testing.assert_close(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_top_p_runs_before_min_p() -> None:
    # top-p=0.75 keeps [0.4, 0.3, 0.2]; min-p=0.3 (threshold 0.12 of the max) keeps them all.
    # The other order (min-p first renormalises to [4, 3, 2]/9, then top-p keeps two) differs.
    probs = logits_to_probs(LOGITS_4, SamplingParams(temperature=1.0, top_p=0.75, min_p=0.3))
    torch.testing.assert_close(probs, torch.tensor([0.4, 0.3, 0.2, 0.0]) / 0.9)


def test_temperature_runs_before_top_p() -> None:
    # At temperature 0.5 the distribution is [16, 9, 4, 1]/30, so top-p=0.75 keeps [16, 9]. The
    # other order (top-p on [0.4, 0.3, 0.2, 0.1] keeps three tokens) would give [16, 9, 4]/29.
    probs = logits_to_probs(LOGITS_4, SamplingParams(temperature=0.5, top_p=0.75))
    torch.testing.assert_close(probs, torch.tensor([16.0, 9.0, 0.0, 0.0]) / 25.0)


def test_all_filters_combined() -> None:
    logits = torch.tensor([0.5, 0.25, 0.12, 0.08, 0.05]).log()  # (V,)
    # top-k=4 -> [.5, .25, .12, .08]/.95; top-p=0.85 keeps three (mass .5+.25=.75/.95 < .85);
    # min-p=0.3 then drops .12 (< .3 * .5 = .15), leaving [.5, .25].
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=4, top_p=0.85, min_p=0.3))
    torch.testing.assert_close(probs, torch.tensor([2.0, 1.0, 0.0, 0.0, 0.0]) / 3.0)


# ---- shapes, dtypes, normalisation ------------------------------------------------------------


SAMPLED_PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("params", SAMPLED_PARAMS)
@pytest.mark.parametrize("shape", [(32,), (3, 32), (2, 3, 32), (2, 2, 3, 32)])
def test_any_leading_shape_gives_float32_distributions(params: SamplingParams, shape: tuple[int, ...]) -> None:
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 3  # (..., V)
    probs = logits_to_probs(logits, params)  # (..., V)
    assert probs.shape == logits.shape
    assert probs.dtype == torch.float32
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(shape[:-1]))


def test_rows_are_filtered_independently() -> None:
    logits = torch.randn(6, 4, 17, generator=torch.Generator().manual_seed(3))  # (6, 4, V)
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.7, min_p=0.1)
    batched = logits_to_probs(logits, params)  # (6, 4, V)
    for i in range(6):
        for j in range(4):
            torch.testing.assert_close(batched[i, j], logits_to_probs(logits[i, j], params))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_high_precision_inputs_give_float32(dtype: torch.dtype) -> None:
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(4)).to(dtype)  # (4, V)
    for params in SAMPLED_PARAMS:
        probs = logits_to_probs(logits, params)
        assert probs.dtype == torch.float32
        torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_masked_vocabulary_entries_get_zero_probability() -> None:
    logits = torch.tensor([1.0, float("-inf"), 0.5, float("-inf")])  # (V,)
    for params in SAMPLED_PARAMS:
        probs = logits_to_probs(logits, params)
        assert probs[1] == 0 and probs[3] == 0
        torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    values=st.lists(st.floats(-20, 20), min_size=1, max_size=12),
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(0, 14),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_filtered_distribution_properties(
    values: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    """Whatever the settings: a distribution, the top token kept, support inside the top k."""
    logits = torch.tensor(values)  # (V,)
    scaled = logits / temperature  # (V,) what the filters rank; can tie where logits did not
    probs = logits_to_probs(logits, SamplingParams(temperature, top_k, top_p, min_p))  # (V,)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert abs(float(probs.sum()) - 1.0) < 1e-5
    assert probs[scaled.argmax()] > 0
    if 0 < top_k < len(values):
        kth = scaled.topk(top_k).values[-1]
        assert (probs[scaled < kth] == 0).all()


# ---- sample ---------------------------------------------------------------------------------


def test_sample_shape_dtype_and_support() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(5))  # (B, V)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))  # (B, V)
    ids = sample(probs, torch.Generator().manual_seed(6))  # (B,)
    assert ids.shape == (64,) and ids.dtype == torch.long
    assert (probs.gather(-1, ids[:, None]) > 0).all()


def test_sample_accepts_leading_dimensions() -> None:
    probs = torch.softmax(torch.randn(2, 3, 7), dim=-1)  # (2, 3, V)
    assert sample(probs, torch.Generator().manual_seed(0)).shape == (2, 3)


def test_sample_is_reproducible_with_a_seeded_generator() -> None:
    probs = torch.softmax(torch.randn(256, 30, generator=torch.Generator().manual_seed(7)), dim=-1)  # (B, V)
    first = sample(probs, torch.Generator().manual_seed(123))
    again = sample(probs, torch.Generator().manual_seed(123))
    other = sample(probs, torch.Generator().manual_seed(124))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_sample_of_greedy_probs_is_the_argmax() -> None:
    logits = torch.randn(100, 20, generator=torch.Generator().manual_seed(8))  # (B, V)
    ids = sample(logits_to_probs(logits, SamplingParams()), torch.Generator().manual_seed(0))  # (B,)
    assert torch.equal(ids, logits.argmax(-1))


def test_sample_frequencies_follow_probs() -> None:
    num_draws = 40_000
    probs = PROBS_4.expand(num_draws, 4)  # (N, V)
    ids = sample(probs, torch.Generator().manual_seed(9))  # (N,)
    freq = torch.bincount(ids, minlength=4).double() / num_draws  # (V,)
    sigma = (PROBS_4.double() * (1 - PROBS_4.double()) / num_draws).sqrt()  # (V,)
    assert ((freq - PROBS_4.double()).abs() <= 5 * sigma).all()


# ---- draw -----------------------------------------------------------------------------------


def test_draw_of_one_hot_rows_is_their_entry_and_leaves_the_generator_alone() -> None:
    ids = torch.tensor([3, 151_000, 0])  # (N,)
    weights = torch.nn.functional.one_hot(ids, 151_936).float() * torch.tensor([[1.0], [0.25], [7.0]])  # (N, V)
    generator = torch.Generator().manual_seed(10)
    state = generator.get_state()
    assert torch.equal(draw(weights, generator), ids)
    assert torch.equal(generator.get_state(), state)


def test_draw_with_any_spread_row_is_one_multinomial_over_all_rows() -> None:
    """A batch mixing one-hot and spread rows draws exactly what torch.multinomial draws, one-hot rows included."""
    weights = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 0.0, 2.0]]).repeat(100, 1)  # (N, V)
    ids = draw(weights, torch.Generator().manual_seed(11))  # (N,)
    assert torch.equal(ids, torch.multinomial(weights, 1, generator=torch.Generator().manual_seed(11))[:, 0])
    assert (ids[0::3] == 1).all() and (ids[2::3] == 3).all()
    assert len(set(ids[1::3].tolist())) > 1


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_draw_leaves_invalid_single_entries_to_multinomial(bad: float) -> None:
    weights = torch.tensor([[0.0, bad, 0.0]])  # (1, V) one nonzero entry, but not a valid weight
    with pytest.raises(RuntimeError):
        draw(weights, torch.Generator().manual_seed(12))
