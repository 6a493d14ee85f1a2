"""The laws the tests hold every sampling path to, in one place: the exact distributions plain decoding
gives, statistical checks of drawn outputs against them, and broken verifiers for negative controls."""

from __future__ import annotations

from collections import Counter

import torch

from verispec.config import GenerationConfig
from verispec.grammar import grammar_for
from verispec.sampling import SamplingParams, logits_to_probs
from verispec.verify import VerifyResult


def frequency_mismatch(samples: torch.Tensor, probs: torch.Tensor) -> str | None:
    """Describe how samples (N,) of ids in [0, M) disagree with the law probs (M,); None if they agree.

    Three checks, each tight enough that a fixed-seed honest run passes with huge margin:
    no sample where probs is 0; every outcome's count within 5 sigma (+5 counts of slack for
    near-empty outcomes) of N * probs; and a chi-square test over outcomes, with expected
    counts below 5 pooled, at p-value 1e-6.
    """
    num, size = samples.shape[0], probs.shape[0]
    if ((samples < 0) | (samples >= size)).any():
        return "sample outside the support"
    counts = torch.bincount(samples, minlength=size).double()  # (M,)
    expected = num * probs.double()  # (M,)
    if (counts[expected == 0] > 0).any():
        impossible = torch.nonzero((expected == 0) & (counts > 0)).flatten().tolist()
        return f"outcomes of probability 0 were drawn: {impossible}"
    sigma = (expected * (1 - probs.double())).sqrt()  # (M,) binomial standard deviation of a count
    worst = ((counts - expected).abs() - 5 * sigma).max()
    if worst > 5:
        return f"a count is {float(worst):.1f} beyond 5 sigma: counts {counts.tolist()}, expected {expected.tolist()}"
    big = expected >= 5  # (M,)
    observed_bins = torch.cat([counts[big], counts[~big].sum().reshape(1)])  # (M' + 1,)
    expected_bins = torch.cat([expected[big], expected[~big].sum().reshape(1)])  # (M' + 1,)
    nonempty = expected_bins > 0
    chi2 = (((observed_bins - expected_bins) ** 2)[nonempty] / expected_bins[nonempty]).sum()
    dof = int(nonempty.sum()) - 1
    if dof > 0:
        p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2))
        if p_value < 1e-6:
            return f"chi-square {float(chi2):.1f} on {dof} degrees of freedom, p-value {p_value:.2e}"
    return None

def accept_all_verifier(draft_token_ids, draft_probs, target_probs, generator=None) -> VerifyResult:
    """BROKEN on purpose: accepts every draft and adds a bonus token from p_k."""
    num_rows, k = draft_token_ids.shape
    bonus = torch.multinomial(target_probs[:, k].float(), 1, generator=generator)  # (B, 1)
    return VerifyResult(torch.cat([draft_token_ids, bonus], dim=1), torch.full((num_rows,), k))

def accept_all(draft_token_ids, draft_probs, target_probs, generator=None):
    """A broken verifier for negative controls: keeps every draft, then a bonus token from p."""
    rows, k = draft_token_ids.shape
    bonus = torch.multinomial(target_probs[:, k], 1, generator=generator)  # (B, 1)
    return VerifyResult(torch.cat([draft_token_ids, bonus], dim=1), torch.full((rows,), k))

def exact_two_token_law(target, prompt_ids, sampling):
    """Exact joint law of the first two sampled tokens under plain decoding, (V, V)."""
    model = target.model
    cache = model.new_cache(1, len(prompt_ids) + 2)
    p1 = logits_to_probs(model.forward(torch.tensor([prompt_ids]), cache)[0, -1], sampling)  # (V,)
    vocab = p1.shape[0]
    batch = torch.tensor([prompt_ids] * vocab)  # (V, T)
    seconds = torch.cat([batch, torch.arange(vocab)[:, None]], dim=1)  # (V, T + 1)
    logits = model.forward(seconds, model.new_cache(vocab, seconds.shape[1] + 1), last_only=True)[:, 0]
    p2 = logits_to_probs(logits, sampling)  # (V, V): row t1 is p(t2 | t1)
    return p1[:, None] * p2


def two_token_frequencies(engine, prompt_ids, sampling, runs, k=3, draft_p_min=0.0):
    counts = Counter()
    for seed in range(runs):
        config = GenerationConfig(max_new_tokens=2, k=k, eos_token_ids=(), sampling=sampling, seed=seed,
                                  draft_p_min=draft_p_min)
        ids = engine.generate(prompt_ids, config).token_ids
        counts[tuple(ids)] += 1
    return counts


def marginal_matches(frequencies: torch.Tensor, p: torch.Tensor, runs: int) -> bool:
    """Each token within 5 sigma, and total variation within 1.5x its expected sampling noise."""
    sigma = (p * (1 - p) / runs).sqrt().clamp(min=1 / runs)  # (V,)
    if bool(((frequencies - p).abs() > 5 * sigma).any()):
        return False
    expected_tv = 0.5 * float((2 * p * (1 - p) / (torch.pi * runs)).sqrt().sum())
    return 0.5 * float((frequencies - p).abs().sum()) < 1.5 * expected_tv + 0.01


def law_matches(counts: Counter, law: torch.Tensor, runs: int) -> bool:
    """The first token, the second token, and every (first, second) pair follow the exact law."""
    joint = torch.zeros_like(law)  # (V, V) empirical
    for (first, second), n in counts.items():
        joint[first, second] = n / runs
    pairs_ok = bool(((joint - law).abs() <= 5 * (law * (1 - law) / runs).sqrt().clamp(min=1 / runs)).all())
    return pairs_ok and marginal_matches(joint.sum(1), law.sum(1), runs) and marginal_matches(joint.sum(0), law.sum(0), runs)

def exact_law(target, prompt_ids: list[int], schema: dict) -> dict[tuple[int, ...], float]:
    """Probability of every whole document (token ids up to and including eos) under the masked target."""
    grammar = grammar_for(target, schema)
    model = target.model
    law: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], mass: float) -> None:
        ids = prompt_ids + prefix
        logits = model.forward(torch.tensor([ids]), model.new_cache(1, len(ids) + 1))[0, -1]  # (V,)
        p = logits_to_probs(logits, SamplingParams(temperature=1.0), grammar.allowed())  # (V,)
        for token in p.nonzero().flatten().tolist():
            if token in target.eos_token_ids:
                law[tuple(prefix + [token])] = mass * float(p[token])
                continue
            grammar.advance([token])
            walk(prefix + [token], mass * float(p[token]))
            grammar.rollback(1)

    walk([], 1.0)
    return law


def frequencies_against(law: dict[tuple[int, ...], float], outputs: list[tuple[int, ...]]) -> str | None:
    """frequency_mismatch over documents; an output outside the law's support gets its own code."""
    documents = sorted(law)
    index = {document: i for i, document in enumerate(documents)}
    probs = torch.tensor([law[d] for d in documents] + [0.0], dtype=torch.float64)  # (M + 1,) last: outside
    samples = torch.tensor([index.get(o, len(documents)) for o in outputs])
    return frequency_mismatch(samples, probs / probs.sum())
