"""benchmarks/draft_head/fused.py's warm start (issue 48): a fused head started from a last-layer head's file drafts as
that head does, and training-time test moves the fuse's columns of the layers that head never read. study.py's
acceptance at step starts (the engine's count) and a head file over another output vocabulary."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import benchmark_script
from test_draft_head import trainable_head
from verispec.drafters.draft_head import load_head, save_head


@pytest.fixture(scope="module")
def fused():
    return benchmark_script("fused", folder="draft_head")


def test_a_fused_head_started_from_a_last_layer_head_drafts_as_it_does_until_trained(fused, target, tmp_path,
                                                                                    monkeypatch):
    layers = (0, 1, target.model.config.num_layers)  # low, mid, high: the last layer's state is the file's feature
    monkeypatch.setitem(fused.ARMS, "warm-fused-ttt", (layers, 3, "ce"))
    path = tmp_path / "head.safetensors"
    save_head(trainable_head(target, seed=3, vocab=torch.arange(0, target.model.vocab_size, 2)), path, target.name)
    last = fused.warm_head("last-ttt", target, path)
    warm = fused.warm_head("warm-fused-ttt", target, path)
    assert torch.equal(warm.vocab, last.vocab) and warm.feature_layers == layers
    width = target.model.embed.shape[1]
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 12, len(layers) * width, generator=generator)  # (B, T, 3 C): low, mid, high
    next_ids = torch.randint(0, target.model.vocab_size, (2, 12), generator=generator)
    with torch.no_grad():
        expected = last.logits(last(last.target_features(hidden[..., -width:]), next_ids))
        started = warm.logits(warm(warm.target_features(hidden), next_ids))
    torch.testing.assert_close(started, expected, atol=1e-4, rtol=1e-4)

    row = {"ids": next_ids[0], "argmax": next_ids[1], "answer_start": 0, "features": hidden[0, :, -width:]}
    row |= {name: hidden[0, :, i * width : (i + 1) * width] for i, name in enumerate(("low", "mid"))}
    row["high"] = row["features"]
    windows = fused.chain_windows([row], depth=2)
    batch = fused.chain_batch([row], windows, "warm-fused-ttt", depth=2)
    index = fused.head_rows(warm.vocab, target.model.vocab_size)
    results = fused.ttt_losses(warm, "warm-fused-ttt", batch, 2, index)
    assert len(results) == 2 and all(counted > 0 for _, _, counted, _ in results)
    sum(loss for loss, *_ in results).backward()
    assert warm.fuse.weight.grad[:, :-width].abs().sum() > 0  # the layers the file's head never read get a gradient


def test_feature_noise_moves_the_step0_features_within_its_bound(fused, target, tmp_path, monkeypatch):
    """fused.py train --feature-noise A: uniform noise of +-A on the step-0 features (EAGLE-1's regularizer), none
    at A = 0."""
    path = tmp_path / "head.safetensors"
    save_head(trainable_head(target, seed=3), path, target.name)
    head = fused.warm_head("last-ttt", target, path)
    width = target.model.embed.shape[1]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.model.vocab_size, (2, 12), generator=generator)
    row = {"ids": ids[0], "argmax": ids[1], "answer_start": 0, "features": torch.randn(12, width, generator=generator)}
    batch = fused.chain_batch([row], fused.chain_windows([row], depth=2), "last-ttt", depth=2)
    index = fused.head_rows(head.vocab, target.model.vocab_size)
    clean = fused.step0_features(head, "last-ttt", batch)
    fed = []
    layer_input = head.layer_input
    monkeypatch.setattr(head, "layer_input", lambda features, next_ids: fed.append(features) or layer_input(
        features, next_ids))
    with torch.no_grad():
        fused.ttt_losses(head, "last-ttt", batch, 2, index)
        fused.ttt_losses(head, "last-ttt", batch, 2, index, noise=0.1)
    assert torch.equal(fed[0], clean)  # no noise by default
    moved = (fed[2] - clean).abs()
    assert 0 < moved.max() <= 0.1 and moved.mean() > 0.02  # +-0.1, spread over the elements


def test_a_fused_head_whose_last_layer_is_not_the_targets_last_is_not_started_from_a_last_layer_head(
        fused, target, tmp_path, monkeypatch):
    monkeypatch.setitem(fused.ARMS, "warm-fused-ttt", ((0, 1, 1), 3, "ce"))
    path = tmp_path / "head.safetensors"
    save_head(trainable_head(target, seed=3), path, target.name)
    with pytest.raises(ValueError, match="whose last layer is the target's last"):
        fused.warm_head("warm-fused-ttt", target, path)


def test_greedy_steps_count_acceptance_where_steps_start_not_at_every_position(study):
    truth = torch.tensor([10, 11, 12, 13, 14, 15])  # x_{first+1} ..
    drafts = torch.tensor([  # the chain of 2 after each truth[i]
        [11, 99],  # step 1 starts here: one accepted, the second rejected
        [12, 13],  # right, but no step starts here
        [77, 14],  # step 2: rejected at once
        [14, 15],  # step 3: both accepted, the end
        [15, 0],
        [0, 0],
    ])
    tried, right = [0, 0], [0, 0]
    assert study.greedy_steps(truth, drafts, 2, tried, right) == (3, 6)
    assert (tried, right) == ([3, 2], [2, 1])
    assert study.position_acceptance(truth, drafts)[0] == pytest.approx(4 / 5)  # every position: not the engine's


def test_a_head_file_over_another_vocabulary_drafts_the_same_feature_over_those_rows(study, target, tmp_path):
    path, pruned_path = tmp_path / "head.safetensors", tmp_path / "pruned.safetensors"
    vocab_size = target.model.vocab_size
    save_head(trainable_head(target, seed=5, vocab=torch.arange(0, vocab_size, 2)), path, target.name, weights="int8")
    kept = torch.arange(0, vocab_size, 6)  # a third of the file's rows
    about = study.with_vocab(path, kept, pruned_path, {"from": path.name})
    assert about["vocab"] == {"size": len(kept), "from": path.name} and about["weights"] == "int8"
    original, pruned = load_file(str(path)), load_file(str(pruned_path))
    assert torch.equal(pruned.pop("vocab"), kept) and original.pop("vocab").numel() == vocab_size // 2
    assert pruned.keys() == original.keys() and all(torch.equal(pruned[n], original[n]) for n in original)

    full, cut = study.file_head(target, path), study.file_head(target, pruned_path)
    width = target.model.embed.shape[1]
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(1, 9, width, generator=generator)
    next_ids = torch.randint(0, vocab_size, (1, 9), generator=generator)
    with torch.no_grad():
        full_logits = full.logits(full(full.target_features(features), next_ids))  # (1, 9, V/2)
        cut_logits = cut.logits(cut(cut.target_features(features), next_ids))  # (1, 9, V/6)
    torch.testing.assert_close(cut_logits, full_logits[..., ::3])  # target id 6j is the file's row 3j
    assert torch.equal(load_head(str(pruned_path), target).vocab, kept)  # the engine drafts over the kept rows


def test_export_writes_the_head_over_the_ids_the_target_chose_most_in_the_training_rows(study, target, tmp_path):
    chosen = torch.tensor([7, 3, 7, 9, 7, 3, 1, 3, 7, 3, 9, 0])  # 7 and 3 four times, 9 twice, 1 and 0 once
    torch.save([{"argmax": chosen[:6]}], tmp_path / "train-a.pt")
    torch.save([{"argmax": chosen[6:]}], tmp_path / "train-b.pt")
    torch.save([{"argmax": torch.tensor([5, 5, 5, 5, 5])}], tmp_path / "eval-a.pt")  # measured rows rank nothing
    out = tmp_path / "head.safetensors"
    args = argparse.Namespace(ship=False, out=str(out), weights="int8", vocab_rows=3, work=str(tmp_path))
    study.write_head(trainable_head(target, seed=2), {"minutes": 1}, args)
    assert load_file(str(out))["vocab"].tolist() == [3, 7, 9]
    with safe_open(str(out), "pt") as opened:
        about = json.loads(opened.metadata()["about"])
    assert about == {"minutes": 1, "vocab": {"size": 3, "ranked_by": ["train-a", "train-b"], "from": "its training's"}}


def test_train_init_file_goes_on_from_a_head_files_weights_and_vocabulary(study, target, tiny_dir, tmp_path,
                                                                         monkeypatch):
    vocab_size = target.model.vocab_size
    path = tmp_path / "shipped.safetensors"
    save_head(trainable_head(target, seed=8, vocab=torch.arange(0, vocab_size, 3)), path, target.name,
              about={"runs": [{"minutes": 40}]})
    width = target.model.embed.shape[1]
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab_size, (40,), generator=generator)
    torch.save([{"features": torch.randn(40, width, generator=generator).to(torch.bfloat16), "ids": ids,
                 "argmax": torch.randint(0, vocab_size, (40,), generator=generator), "answer_start": 10}],
               tmp_path / "train-a.pt")
    monkeypatch.setattr(study, "TARGET", str(tiny_dir))
    args = argparse.Namespace(work=str(tmp_path), threads=1, init=False, init_file=str(path), vocab=64,
                              intermediate=32, lr=0.0, batch=2, minutes=0.02, ce_weight=0.1)
    study.cmd_train(args)  # at lr 0: the file's weights, kept
    saved = torch.load(tmp_path / "head.pt")
    started = study.file_head(target, path)
    assert torch.equal(saved["vocab"], started.vocab) and saved["intermediate"] == 96
    assert saved["runs"][0] == {"from": path.name, "runs": [{"minutes": 40}]} and saved["steps"] >= 1
    for name, tensor in started.state_dict().items():
        if name in saved["state"]:
            assert torch.equal(saved["state"][name], tensor), name

    # A head fused.py exported (`make head`'s last part, the one shipped): its whole record goes on, with the head
    # it started from, so the shipped head's history is not cut off.
    ttt_record = {"arm": "last-ttt", "minutes": 20, "recipe": "benchmarks/draft_head/fused.py",
                  "started_from": {"file": "chain-head.safetensors", "trained": {"runs": [{"minutes": 40}]}}}
    save_head(trainable_head(target, seed=8, vocab=torch.arange(0, vocab_size, 3)), path, target.name,
              about=ttt_record)
    study.cmd_train(args)
    assert torch.load(tmp_path / "head.pt")["runs"][0] == {"from": path.name, **ttt_record}
