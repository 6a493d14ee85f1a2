"""Logits -> probabilities, and drawing tokens from them.

`logits_to_probs` is the one place where sampling settings turn scores into a distribution.
Every path calls it with the same `SamplingParams`: the drafter (q), the target (p) and the
bonus token. Speculative decoding is lossless only with respect to the distribution the target
path actually samples from, so the draft and target must be shaped by the same code.

Transforms run in a fixed order: penalties on the tokens seen so far (repetition, then frequency and
presence), logit_bias, a grammar's mask of allowed tokens (structured output); then temperature,
top-k, top-p, min-p and one softmax. Each sees the scores left by the ones before it. Greedy decoding
(temperature 0) takes the argmax of the transformed scores and returns a one-hot row there.
Verification then compares one-hot targets instead of running a ratio test on a softmax.

Penalties depend on the tokens before each position, so a verify pass over drafts d_1..d_k scores
row t as if d_1..d_t had been generated (`TokenHistory`): the same scores plain decoding would see
after those tokens, which keeps speculation lossless under them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: -100 bans a token, 100 makes it all but certain
# Scores divided by a smaller temperature, or by a smaller repetition penalty (or multiplied by a larger one), can
# overflow float32 to infinity, and a softmax over infinities is NaN: no distribution to sample from.
MIN_TEMPERATURE = 1e-6
# top-p ranks this many of a row's highest scores first, and sorts the whole row only where they hold less than top_p
TOP_P_CANDIDATES = 1024
REPETITION_PENALTY_RANGE = (1e-3, 1e3)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (one-hot at the argmax); otherwise logits are divided by it
    top_k: int = 0  # keep the k highest-scoring tokens; 0 = off
    top_p: float = 1.0  # keep the smallest head of tokens whose probability mass reaches top_p; 1 = off
    min_p: float = 0.0  # drop tokens with probability < min_p * (largest probability); 0 = off
    # OpenAI's penalties, on the generated tokens: score -= frequency * count + presence * (count > 0).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Ctrl / Hugging Face / vLLM: a token already in the prompt or the output has its score divided by it
    # (multiplied when negative); 1 = off, > 1 discourages repeats.
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its score), OpenAI's logit_bias

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature!r}: a smaller "
                "one overflows the scores to infinity (use 0 for the most likely token)"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not (math.isfinite(self.repetition_penalty) and low <= self.repetition_penalty <= high):
            raise ValueError(
                f"repetition_penalty must be in [{low:g}, {high:g}] (1 = off), got {self.repetition_penalty!r}: "
                "beyond that the scores it divides or multiplies overflow"
            )
        for token_id, bias in self.logit_bias:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token_id}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether scores depend on the tokens seen so far (logits_to_probs then needs a TokenHistory)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def transforms_scores(self) -> bool:
        """Whether anything changes the model's scores before sampling (the argmax may move)."""
        return self.penalized or bool(self.logit_bias)


@dataclass(frozen=True)
class TokenHistory:
    """The tokens penalties look at, for a (..., T, V) block of scores.

    tokens: the prompt, the generated tokens, then the T - 1 drafts the block verifies (none for a single
    row). Row t scores the token after tokens[: len(tokens) - T + 1 + t], so row 0 sees everything committed
    and row t also the drafts before it. prompt_length: where the generated tokens start.
    """

    tokens: Sequence[int]
    prompt_length: int


def logits_to_probs(
    logits: torch.Tensor,
    params: SamplingParams,
    allowed: torch.Tensor | None = None,
    history: TokenHistory | None = None,
) -> torch.Tensor:
    """Turn raw scores (..., V) into the float32 distribution (..., V) that decoding samples from.

    history: the tokens before each row, needed when params are penalized (then the leading dims hold
    one sequence's T rows). Penalties and logit_bias change the scores first. allowed: (..., V) bool, a
    grammar's mask (each row allows at least one token); forbidden tokens then get probability exactly 0.
    Greedy gives a one-hot row at torch.argmax (ties go to the lowest index). Otherwise the filters run
    in the order temperature, top-k, top-p, min-p, and a softmax follows. A token a filter removes gets
    probability exactly 0. The top token always survives, so no row is empty.
    """
    if params.transforms_scores:
        logits = transform_scores(logits, params, history)  # (..., V) float32
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))  # (..., V)
    if params.greedy:
        return _one_hot_argmax(logits)  # (..., V)
    scores = logits.float() / params.temperature  # (..., V)
    scores = _top_k(scores, params.top_k)  # (..., V)
    scores = _top_p(scores, params.top_p)  # (..., V)
    scores = _min_p(scores, params.min_p)  # (..., V)
    return torch.softmax(scores, dim=-1)  # (..., V)


def transform_scores(logits: torch.Tensor, params: SamplingParams, history: TokenHistory | None) -> torch.Tensor:
    """(..., V) scores after the penalties and logit_bias of params, in float32 (see TokenHistory)."""
    shape, width = logits.shape, logits.shape[-1]
    scores = logits.to(torch.float32, copy=True).reshape(-1, width)  # (T, V), the caller's logits untouched
    if params.penalized:
        if history is None:
            raise ValueError("penalties depend on the tokens seen so far: pass a TokenHistory")
        rows = scores.shape[0]
        committed = len(history.tokens) - rows + 1  # row 0 sees tokens[:committed]
        if committed < history.prompt_length:
            raise ValueError(f"{rows} rows of scores need at least {rows - 1} drafts after the prompt")
        # Ids beyond width (a draft model's head may be narrower than the target's vocabulary) are skipped.
        generated = torch.tensor(history.tokens[history.prompt_length : committed], dtype=torch.long)
        counts = torch.bincount(generated[generated < width], minlength=width).float().expand(rows, width).clone()
        for row, token in enumerate(history.tokens[committed:], start=1):  # drafts count from the row after them
            if token < width:
                counts[row:, token] += 1  # (T, V) generated-token counts before each row
        if params.repetition_penalty != 1.0:
            prompt = torch.tensor(history.tokens[: history.prompt_length], dtype=torch.long)
            in_prompt = torch.zeros(width, dtype=torch.bool)
            in_prompt[prompt[prompt < width]] = True
            repeated = (counts > 0) | in_prompt  # (T, V)
            penalty = params.repetition_penalty
            scores = torch.where(repeated, torch.where(scores > 0, scores / penalty, scores * penalty), scores)
        scores = scores - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    if params.logit_bias:
        ids = torch.tensor([token for token, _ in params.logit_bias], dtype=torch.long)  # (B,)
        bias = torch.tensor([value for _, value in params.logit_bias], dtype=torch.float32)  # (B,)
        inside = ids < width
        scores.index_add_(1, ids[inside], bias[inside].expand(scores.shape[0], -1))
    return scores.reshape(shape)  # (..., V)


MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for at each position


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target's own distribution, and the likeliest tokens there."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), likeliest first


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprob]:
    """logits: (T, V), row t the target's scores for token_ids[t]; log-softmax of the raw scores.

    The model's own distribution, before temperature and truncation (as vLLM reports by default): the
    same whether a token was drafted and accepted or sampled by the target, and meaningful for greedy.
    """
    logprobs = torch.log_softmax(logits[: len(token_ids)].float(), dim=-1)  # (T, V)
    chosen = logprobs[torch.arange(len(token_ids)), torch.tensor(token_ids, dtype=torch.long)].tolist()
    if top:
        values, ids = logprobs.topk(top, dim=-1)  # (T, top) each
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(token_ids)
    return [TokenLogprob(t, lp, best) for t, lp, best in zip(token_ids, chosen, tops)]


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token id per row of probs (B, V) -> (B,). Also accepts any leading shape (..., V) -> (...).

    Uses only the given generator. With generator=None it uses torch's global RNG.
    """
    flat = probs.reshape(-1, probs.shape[-1])  # (N, V)
    return draw(flat, generator).reshape(probs.shape[:-1])  # (...)


def draw(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of non-negative weights (N, V) -> (N,), with probability proportional to weight.

    When every row has exactly one nonzero entry (greedy decoding: one-hot rows), that entry is
    drawn with probability 1, so it is returned directly: no multinomial over the whole vocabulary
    (milliseconds at 150k entries) and the generator is left untouched. Otherwise every row goes
    through torch.multinomial, which uses the generator exactly as a plain multinomial call does.
    """
    only_entries = _only_entries(weights)  # (N,) or None
    if only_entries is not None:
        return only_entries
    return torch.multinomial(weights, 1, generator=generator)[:, 0]  # (N,)


def _only_entries(weights: torch.Tensor) -> torch.Tensor | None:
    """(N,) index of each row's single nonzero entry when every row of weights (N, V) has exactly
    one and it is positive and finite (a valid point mass); None otherwise."""
    if weights.shape[0] == 0:
        return None
    # sign().abs() is 1 at each nonzero entry (NaN at NaN), so the sum counts them: in any float
    # dtype a count of two or more never rounds to 1. (Several times faster than count_nonzero.)
    nonzero_counts = weights.sign().abs_().sum(dim=-1)  # (N,)
    if not bool((nonzero_counts == 1).all()):
        return None
    values, indices = weights.max(dim=-1)  # (N,) each: the nonzero entry when it is positive
    if not bool(((values > 0) & values.isfinite()).all()):
        return None  # a negative, infinite or NaN weight: leave the error to multinomial
    return indices


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """One-hot float32 rows (..., V) at the first maximum of each row."""
    best = logits.argmax(dim=-1, keepdim=True)  # (..., 1)
    return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, best, 1.0)  # (..., V)


def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Mask (set to -inf) everything below the k-th largest score. Ties with the k-th are kept."""
    if k == 0 or k >= scores.shape[-1]:
        return scores
    kth = scores.topk(k, dim=-1).values[..., -1:]  # (..., 1)
    return scores.masked_fill(scores < kth, float("-inf"))  # (..., V)


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose total probability is >= top_p.

    A token is kept when the mass of the tokens ranked above it is still < top_p. So the top
    token is always kept, and so is the token whose mass first reaches top_p. Tied scores rank
    by lower index first, as in greedy's argmax.

    Sorting a whole vocabulary costs about 14 ms a row on these CPUs (more than a step's drafting), so the
    TOP_P_CANDIDATES highest scores are ranked first; the whole row is sorted only where they hold too little.
    Both ways keep the same tokens, to the bit where a prefix sum does not depend on what follows it (CPUs: a
    row's cumsum runs in order).
    """
    if top_p >= 1.0:
        return scores
    log_total = torch.logsumexp(scores, dim=-1, keepdim=True)  # (..., 1)
    if TOP_P_CANDIDATES < scores.shape[-1]:
        kept = _top_p_among_candidates(scores, log_total, top_p, TOP_P_CANDIDATES)  # (..., V) or None
        if kept is not None:
            return scores.masked_fill(~kept, float("-inf"))  # (..., V)
    sorted_scores, order = scores.sort(dim=-1, descending=True, stable=True)  # (..., V), (..., V)
    drop_sorted = _mass_above(sorted_scores, log_total) >= top_p  # (..., V)
    drop_sorted[..., 0] = False  # the top token survives even if rounding says otherwise
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # (..., V) back in vocabulary order
    return scores.masked_fill(drop, float("-inf"))  # (..., V)


def _mass_above(ranked_scores: torch.Tensor, log_total: torch.Tensor) -> torch.Tensor:
    """(..., N) the probability of the tokens ranked above each of the N highest-ranked ones: a prefix sum, so the
    same figure however many tokens follow, and never less for a later token."""
    probs = torch.exp(ranked_scores - log_total)  # (..., N)
    return torch.cat([torch.zeros_like(probs[..., :1]), probs.cumsum(dim=-1)[..., :-1]], dim=-1)  # (..., N)


def _top_p_among_candidates(
    scores: torch.Tensor, log_total: torch.Tensor, top_p: float, candidates: int
) -> torch.Tensor | None:
    """_top_p's kept tokens (..., V) bool, found among each row's `candidates` highest scores; None where in some row
    the candidates scored above the lowest of them hold less than top_p.

    Where they hold top_p, the first token tied with that lowest score is dropped, and so is every token ranked
    after it (none has less mass above it): ranking the candidates alone decides the row."""
    top_scores, top_ids = scores.topk(candidates, dim=-1)  # (..., C) each, descending; ties in any order
    ids, by_id = top_ids.sort(dim=-1)  # (..., C) each: tied scores then rank by lower index, as the full sort
    ranked_scores, rank = top_scores.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)  # (..., C) each
    ranked_ids = ids.gather(-1, rank)  # (..., C)
    mass_above = _mass_above(ranked_scores, log_total)  # (..., C)
    first_at_lowest = (ranked_scores > ranked_scores[..., -1:]).sum(dim=-1, keepdim=True)  # (..., 1)
    if not bool(mass_above.gather(-1, first_at_lowest).ge(top_p).all()):
        return None
    keep_ranked = mass_above < top_p  # (..., C)
    keep_ranked[..., 0] = True  # the top token survives even if rounding says otherwise
    return torch.zeros_like(scores, dtype=torch.bool).scatter(-1, ranked_ids, keep_ranked)  # (..., V)


def _min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's largest probability."""
    if min_p <= 0.0:
        return scores
    probs = torch.softmax(scores, dim=-1)  # (..., V)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values  # (..., 1)
    return scores.masked_fill(probs < threshold, float("-inf"))  # (..., V)
