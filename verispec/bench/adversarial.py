"""A drafter that cannot pay: the real draft model with its guesses scrambled.

The draft's output head reports each row's score under another token: a fixed random permutation of the
vocabulary (`Transformer.restrict_output_vocab` with every id, permuted). So the draft proposes perm(x) with the
probability it gave x, q stays its own distribution (verification stays exact), acceptance drops to about zero,
and drafting costs what it always costs: the same layers, a head of the same size in the same format. It is a
draft model like any other, so the library and the server run it through their one batched draft-model path:
the worst case a controller must notice, measured on real models.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.draft_vocab import dense_head


def scrambled_drafter(drafter: DraftModelDrafter, directory: Path, seed: int = 0) -> DraftModelDrafter:
    """A draft-model drafter like `drafter` whose model's head is scrambled; directory: the draft's weights."""
    model = drafter.model
    vocab = drafter.target_vocab_size
    ids = model.output_token_ids if model.output_token_ids is not None else torch.arange(min(model.vocab_size, vocab))
    rows = dense_head(model, directory)[ids]  # (N, C): the draft's own scores for ids, in that order
    permutation = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))  # (V,)
    scrambled = copy.copy(model)  # shares the layers; only the head is its own
    scrambled.restrict_output_vocab(permutation[ids], rows)
    return DraftModelDrafter(scrambled, vocab, drafter.lazy_prefill)
