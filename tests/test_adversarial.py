"""The adversarial drafter of `verispec bench --modes unrelated`: the real draft model with its head scrambled."""

from __future__ import annotations

import torch

from verispec.bench.adversarial import scrambled_drafter
from verispec.drafters import DraftModelDrafter
from verispec.engine import GenerationConfig, SpeculativeEngine
from verispec.sampling import SamplingParams

PROMPT = "def add(a, b):"


def test_a_scrambled_copy_of_the_target_proposes_its_guesses_permuted(target, tiny_dir):
    vocab = target.model.vocab_size
    honest = DraftModelDrafter(target.model, vocab)
    adversary = scrambled_drafter(honest, tiny_dir, seed=3)
    permutation = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))
    tokens = target.encode(PROMPT)
    for drafter in (honest, adversary):
        drafter.begin(tokens, 64)
    greedy = SamplingParams()
    guess, scrambled = (d.propose(tokens, 3, greedy, None).token_ids[0] for d in (honest, adversary))
    assert scrambled[0] == permutation[guess[0]]  # its argmax, reported as another token
    sampling = SamplingParams(temperature=1.0)
    guess, scrambled = (
        d.propose(tokens, 1, sampling, torch.Generator().manual_seed(0)).probs[0, 0] for d in (honest, adversary)
    )
    assert torch.allclose(scrambled[permutation], guess)  # q'(perm[x]) = q(x): its own distribution, relabelled


def test_the_scrambled_target_is_rejected_and_the_output_stays_plain(target, tiny_dir):
    adversary = scrambled_drafter(DraftModelDrafter(target.model, target.model.vocab_size), tiny_dir)
    config = GenerationConfig(max_new_tokens=32, k=3, eos_token_ids=())
    expected = SpeculativeEngine(target).generate(PROMPT, config)
    result = SpeculativeEngine(target, adversary).generate(PROMPT, config)
    assert result.token_ids == expected.token_ids
    assert result.stats.drafted_tokens > 0 and result.stats.acceptance_rate < 0.2
    honest_drafter = DraftModelDrafter(target.model, target.model.vocab_size)
    honest = SpeculativeEngine(target, honest_drafter).generate(PROMPT, config)
    assert honest.stats.acceptance_rate == 1.0  # what the same model unscrambled does
