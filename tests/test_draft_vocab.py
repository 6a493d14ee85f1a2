"""A draft head over the most frequent tokens (draft_vocab): which tokens, chosen how, and the output unchanged."""

from __future__ import annotations

import pytest
import torch

from verispec import GenerationConfig, SpeculativeEngine
from verispec.drafters import draft_vocab, load_draft_model, make_drafter
from verispec.models.loading import load_model
from verispec.models.machine import remembered_choices
from verispec.serving.scheduler import Scheduler, SchedulerLimits

PROMPTS = ["def add(a, b):", "for i in range(10):\n", "The quick brown fox", "class Point:"]


@pytest.fixture
def cache(own_cache, monkeypatch):
    """A cache of the test's own and a small corpus."""
    monkeypatch.setattr(draft_vocab, "CORPUS_BYTES", 300_000)
    return own_cache


def test_ids_are_ranked_by_count_then_id_and_always_keep_the_special_ones():
    counts = torch.tensor([0, 5, 9, 5, 0, 1])
    assert draft_vocab.ranked_ids(counts).tolist() == [2, 1, 3, 5, 0, 4]  # ties and the never-seen by id
    assert draft_vocab.kept_ids(counts, 2, always=[4], vocab_size=6).tolist() == [1, 2, 4]
    assert draft_vocab.kept_ids(counts, 3, always=[9], vocab_size=4).tolist() == [1, 2, 3]  # ids past the vocabulary
    held_out = torch.tensor([0, 1, 1, 0, 0, 2])
    assert draft_vocab.coverage(counts, held_out, 2, always=[]) == pytest.approx(0.5)  # ids 1 and 2 of 4 tokens


def test_bad_sizes_are_refused_with_what_to_give():
    assert draft_vocab.parse_vocab("16384") == 16384 and draft_vocab.parse_vocab("auto") == "auto"
    with pytest.raises(ValueError, match="give full, auto or a number of tokens"):
        draft_vocab.parse_vocab("half")
    with pytest.raises(ValueError, match="keep at least 256 tokens"):
        draft_vocab.parse_vocab("100")


def test_the_corpus_is_counted_once_per_tokenizer_from_text_python_ships(cache, target):
    train, held_out = draft_vocab.token_counts(target.tokenizer)
    assert train.sum() > 10_000 and held_out.sum() > 10_000  # both halves hold real text
    assert (train > 0).sum() > 100  # many distinct tokens
    assert len(list((cache / "token-counts").iterdir())) == 1
    again = draft_vocab.token_counts(target.tokenizer)
    assert torch.equal(again[0], train) and torch.equal(again[1], held_out)


@pytest.mark.parametrize("size", [256, "auto"])
def test_a_small_head_drafts_and_the_output_stays_plain_in_the_library_and_the_server(cache, tiny_dir, size):
    target = load_model(tiny_dir, "float32")
    plain = [SpeculativeEngine(target).generate(p, GenerationConfig(max_new_tokens=32, k=0)).token_ids for p in PROMPTS]
    drafter = load_draft_model(str(tiny_dir), target, "bfloat16", "auto", vocab=size)  # the target itself: agrees often
    ids = drafter.model.output_token_ids
    if size == "auto":
        [kept] = [c for kind, c in remembered_choices().items() if kind.startswith("draft head")]
        sizes = {"8192", "16384", "32768"}
        assert set(kept["seconds"]) == sizes | {"full"} and set(kept["coverage"]) == sizes
        assert (ids is None) == (kept["size"] is None)
    else:
        assert ids is not None and 256 <= len(ids) <= 256 + len(target.tokenizer.all_special_ids)
        assert set(target.eos_token_ids) <= set(ids.tolist()) and torch.equal(ids, ids.sort().values)
    engine = SpeculativeEngine(target, drafter)
    results = [engine.generate(p, GenerationConfig(max_new_tokens=32, k=3)) for p in PROMPTS]
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.accepted_tokens for r in results) > 0
    scheduler = Scheduler(target, drafter.model, "draft-model", k=3, limits=SchedulerLimits(4, 8, 256))
    handles = [scheduler.submit(target.encode(p), GenerationConfig(max_new_tokens=32)) for p in PROMPTS]
    while scheduler.run_once():
        pass
    assert [[t for e in h.iter_events() for t in e.token_ids] for h in handles] == plain


def test_the_composite_drafter_takes_a_small_head_too(cache, tiny_dir):
    target = load_model(tiny_dir, "float32")
    composite = make_drafter("composite", target, str(tiny_dir), "float32", "none", vocab=300)
    assert composite.drafters[1].model.lm_head.out_features < target.model.vocab_size


@pytest.mark.parametrize("small_head_ms, chosen", [(8.0, 16384), (9.5, None)])
def test_auto_keeps_a_smaller_head_only_where_it_pays_by_the_margin(cache, tiny_dir, monkeypatch, small_head_ms,
                                                                     chosen):
    """Weighed costs (coverage 1 here): full 10 ms; 16,384 tokens 8 ms pays (more than 10% less), 9.5 ms does not."""
    def fake_costs(models, rows):
        return {name: {1: (small_head_ms if name == "16384" else 10.0) / 1000} for name in models}

    monkeypatch.setattr(draft_vocab, "forward_costs", fake_costs)
    monkeypatch.setattr(draft_vocab, "coverage", lambda *args: 1.0)
    target, draft = load_model(tiny_dir, "float32"), load_model(tiny_dir, "float32")
    assert draft_vocab.trim_head(draft, target, "auto")["size"] == chosen
    assert (draft.model.output_token_ids is None) == (chosen is None)
