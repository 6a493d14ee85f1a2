"""benchmarks/draft_head/block.py (issue 48): a block drafter's rows, computed for every anchor at once in training
and evaluation, are what one causal pass over the true inputs up to the anchor and the block's rows gives; row 0 is
the head's own first draft. A block row's input is its depth's vector, or that added to row 0's input ("carry")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import benchmark_script
from test_draft_head import trainable_head
from verispec.drafters.draft_head import rms


@pytest.fixture(scope="module")
def block():
    return benchmark_script("block", folder="draft_head")


def drafter_and_row(block, target, depth: int = 4, length: int = 20, row_input: str = "mask"):
    head = trainable_head(target, seed=5).eval()
    drafter = block.BlockDrafter(head, depth, row_input).eval()
    generator = torch.Generator().manual_seed(1)
    width = target.model.embed.shape[1]
    with torch.no_grad():
        drafter.masks.normal_(0, 1.0, generator=generator)
    row = {"features": torch.randn(length, width, generator=generator),
           "ids": torch.randint(0, target.model.vocab_size, (length,), generator=generator), "answer_start": 8}
    return drafter, row


def one_pass(drafter, features: torch.Tensor, next_ids: torch.Tensor, anchor: int, d: int) -> torch.Tensor:
    """Block row d at `anchor`, the slow way: one causal pass over the true inputs 0..anchor, then rows 1..d."""
    head = drafter.head
    true = head.layer_input(features[: anchor + 1], next_ids[: anchor + 1])  # (anchor + 1, C)
    rows = drafter.masks[:d] + (true[-1] if drafter.row_input == "carry" else 0)  # (d, C)
    x = torch.cat([true, rows])[None]
    q, k, v = head.project(x, torch.arange(len(x[0])))
    return head.finish(x, F.scaled_dot_product_attention(q, k, v.float(), is_causal=True))[0, -1]


@pytest.mark.parametrize("row_input", ["mask", "carry"])
@torch.no_grad()
def test_every_block_row_is_one_causal_pass_over_the_true_inputs_and_the_rows_before_it(block, target, row_input):
    drafter, row = drafter_and_row(block, target, row_input=row_input)
    features, next_ids = rms(row["features"][:-1]), row["ids"][1:]
    anchors = torch.tensor([0, 3, 7, 18])
    predicted = drafter(features[None], next_ids[None], anchors)
    assert len(predicted) == 4 and predicted[0].shape == (1, 19, features.shape[1])
    assert torch.allclose(predicted[0][0], drafter.head(features[None], next_ids[None])[0], atol=1e-5)
    for d in range(1, 4):
        assert predicted[d].shape == (1, 4, features.shape[1])
        for a, anchor in enumerate(anchors.tolist()):
            assert torch.allclose(predicted[d][0, a], one_pass(drafter, features, next_ids, anchor, d), atol=1e-4)
    with torch.no_grad():  # a later row's input changes no row before it (causal inside the block)
        drafter.masks[2].mul_(-3.0)
    moved = drafter(features[None], next_ids[None], anchors)
    assert torch.equal(moved[1], predicted[1]) and torch.equal(moved[2], predicted[2])
    assert not torch.allclose(moved[3], predicted[3])


@torch.no_grad()
def test_a_blocks_first_draft_is_the_heads_chain_first_draft_and_its_others_come_from_its_rows(block, study, target):
    drafter, row = drafter_and_row(block, target)
    drafts = block.block_drafts(drafter, row)
    chain = study.chains(drafter.head, row, 4)
    assert drafts.shape == chain.shape == (len(row["ids"]) - row["answer_start"], 4)
    assert torch.equal(drafts[:, 0], chain[:, 0])
    features, next_ids = rms(row["features"][:-1]), row["ids"][1:]
    anchor = row["answer_start"] + 2
    for d in range(1, 4):
        expected = drafter.head.vocab[drafter.head.logits(one_pass(drafter, features, next_ids, anchor, d)).argmax()]
        assert drafts[anchor - row["answer_start"] + 1, d] == expected
