"""Drafters without a same-tokenizer model: prompt lookup, suffix index, cross-tokenizer, composite."""

from __future__ import annotations

import pytest
import torch

from verispec.drafters import (
    CompositeDrafter,
    CrossTokenizerDrafter,
    DraftModelDrafter,
    PromptLookupDrafter,
    SuffixIndexDrafter,
    make_drafter,
)
from verispec.drafters.prompt_lookup import find_continuation
from verispec.drafters.sequence_drafters import SequenceDrafters
from verispec.drafters.suffix_index import SuffixTrie, best_continuation
from verispec.engine import GenerationConfig, SpeculativeEngine
from verispec.models.loading import load_model
from verispec.sampling import SamplingParams

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    """Shares the test tokenizer's text but is loaded as a separate model with its own tokenizer object."""
    return load_model(tiny_llama_dir, "float32")


def test_find_continuation_prefers_longest_then_most_recent_match():
    tokens = torch.tensor([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3])
    assert find_continuation(tokens, 3, 1, 3) == [4, 5, 7]  # "2 3" last seen before "4 5 7"
    assert find_continuation(torch.tensor([5, 6, 7, 8]), 3, 1, 3) == []
    assert find_continuation(torch.tensor([1, 2, 1, 2]), 5, 2, 2) == [1, 2]  # stops at the end of the text


def test_prompt_lookup_proposes_point_masses():
    proposal = PromptLookupDrafter(min_ngram=2).propose([1, 2, 3, 4, 1, 2], 2, GREEDY, None)
    assert proposal.token_ids.tolist() == [[3, 4]] and proposal.probs is None
    empty = PromptLookupDrafter(min_ngram=2).propose([1, 2, 3, 4], 2, GREEDY, None)
    assert empty.num_tokens == 0
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(min_ngram=3, max_ngram=2)


def test_suffix_trie_counts_support():
    trie = SuffixTrie(depth=4)
    trie.add_sequence([1, 2, 3, 1, 2, 4, 1, 2, 4])
    active = trie.follow(trie.follow([trie.root], 1), 2)
    tokens, length = best_continuation(trie, active, 2, 1)
    assert length == 2 and tokens[0] == 4  # "1 2" was followed by 4 twice and by 3 once


def test_suffix_index_drafter_grows_incrementally():
    drafter = SuffixIndexDrafter(depth=8, min_match=2)
    drafter.begin([], 100)
    tokens = [7, 8, 9, 10, 11, 7, 8]
    assert drafter.propose(tokens, 3, GREEDY, None).token_ids.tolist() == [[9, 10, 11]]
    tokens += [9, 10, 11, 12, 7, 8]
    assert drafter.trie.tokens_indexed == 7
    assert drafter.propose(tokens, 2, GREEDY, None).token_ids.tolist() == [[9, 10]]
    assert drafter.trie.tokens_indexed == len(tokens)


def test_suffix_index_uses_a_corpus(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "a.txt").write_text("abcdefgh")
    (tmp_path / "lib" / "blob.bin").write_bytes(b"\xff\xfe\x00")
    drafter = SuffixIndexDrafter.with_corpus([tmp_path / "lib"], lambda text: [ord(c) for c in text], depth=6)
    drafter.begin([], 100)
    proposal = drafter.propose([ord(c) for c in "xxcde"], 3, GREEDY, None)
    assert proposal.token_ids.tolist() == [[ord("f"), ord("g"), ord("h")]]
    with pytest.raises(FileNotFoundError):
        SuffixIndexDrafter.with_corpus([tmp_path / "missing"], list)


def test_composite_falls_back_when_lookup_has_nothing(target, repeating_prompt):
    model_drafter = DraftModelDrafter(target.model, target.model.vocab_size)
    composite = CompositeDrafter([PromptLookupDrafter(), model_drafter])
    ids = target.encode("The quick brown")
    composite.begin(ids, 64)
    assert composite.next_source(ids) == "draft-model"
    assert composite.propose(ids, 3, GREEDY, None).source == "draft-model"
    repeated = target.encode(repeating_prompt)
    composite.begin(repeated, 64)
    assert composite.next_source(repeated) == "prompt-lookup"
    assert composite.propose(repeated, 3, GREEDY, None).source == "prompt-lookup"
    built = make_drafter("composite", target, str(target.directory), "float32")
    assert [type(d).__name__ for d in built.drafters] == ["SuffixIndexDrafter", "DraftModelDrafter"]


def test_a_composite_of_drafters_that_cannot_tell_leaves_the_source_to_the_controller(target):
    class OwnLookup:  # a user's drafter: only the Drafter protocol's two methods
        def begin(self, prompt_ids, max_length):
            pass

        def propose(self, tokens, k, params, generator):
            return PromptLookupDrafter().propose(tokens, k, params, generator)

    composite = CompositeDrafter([OwnLookup(), DraftModelDrafter(target.model, target.model.vocab_size)])
    assert composite.next_source([1, 2, 3]) is None
    engine = SpeculativeEngine(target, composite)
    plain = SpeculativeEngine(target).generate("def add(a, b):", GenerationConfig(max_new_tokens=20, k=0))
    assert engine.generate("def add(a, b):", GenerationConfig(max_new_tokens=20)).token_ids == plain.token_ids


def test_can_propose_says_what_propose_will_find():
    tokens = [7, 8, 9, 10, 11, 7, 8]
    for drafter in (SuffixIndexDrafter(depth=8, min_match=2), PromptLookupDrafter(min_ngram=2)):
        drafter.begin([], 100)
        for context in (tokens[:5], tokens, tokens + [12], tokens + [9, 10, 11, 12]):
            assert drafter.can_propose(context) == (drafter.propose(context, 3, GREEDY, None).num_tokens > 0)
    assert SuffixIndexDrafter(depth=8, min_match=3).can_propose([1, 2, 3, 1, 2]) is False  # 2 < min_match


def test_sequence_drafters_propose_each_row_for_its_own_k_and_move_with_their_rows():
    """Per-request drafters behind the batched protocol: each row proposes what its own drafter alone would, for its
    own k; a row's drafter (and what it learnt of its text) moves with the row; one drafter's failure is its row's."""

    class Failing(PromptLookupDrafter):
        def propose(self, tokens, k, params, generator):
            raise RuntimeError("broken drafter")

    made = iter([PromptLookupDrafter(min_ngram=2), PromptLookupDrafter(min_ngram=2), Failing(min_ngram=2)])
    rows = SequenceDrafters(lambda: next(made))
    first, second = [1, 2, 3, 4, 1, 2], [7, 8, 9, 7, 8]
    rows.add(0, first, 32)
    rows.add(1, second, 32)
    rows.add(2, [5, 6], 32)
    params, generators = [GREEDY] * 3, [None] * 3
    proposals = rows.propose([first, second, [5, 6]], [1, 3, 2], params, generators)
    alone = PromptLookupDrafter(min_ngram=2)
    assert proposals[0].token_ids.tolist() == alone.propose(first, 1, GREEDY, None).token_ids.tolist() == [[3]]
    assert proposals[1].token_ids.tolist() == alone.propose(second, 3, GREEDY, None).token_ids.tolist() == [[9, 7, 8]]
    assert proposals[2].num_tokens == 0 and str(rows.faults[2]) == "broken drafter" and set(rows.faults) == {2}
    assert set(rows.seconds) == {"prompt-lookup", ""}  # "": the failed row's time, by no source (the caller names it)
    assert rows.propose([first, second, [5, 6]], [0, 2, 0], params, generators)[0].num_tokens == 0  # k 0: none
    rows.move(1, 0)  # row 0 left: row 1's sequence (and its drafter) now lives in row 0
    assert rows.propose([second], [2], params[:1], generators[:1])[0].token_ids.tolist() == [[9, 7]]
    assert rows.next_source(0, second) == "prompt-lookup" and rows.source == "prompt-lookup"


def test_a_lazy_prefill_is_catching_up_not_drafting(target):
    """A draft model fed a whole prompt at its first proposal reports that pass as catching up."""
    ids = target.encode("The quick brown fox jumps over the lazy dog, again and again")
    assert len(ids) > 9
    lazy = DraftModelDrafter(target.model, target.model.vocab_size, lazy_prefill=True)
    lazy.begin(ids, 64)
    first = lazy.propose(ids, 2, GREEDY, None)
    assert first.catch_up_seconds > 0
    assert lazy.propose(ids + first.token_ids[0].tolist(), 2, GREEDY, None).catch_up_seconds == 0.0  # short tail
    eager = DraftModelDrafter(target.model, target.model.vocab_size)
    eager.begin(ids, 64)
    assert eager.propose(ids, 2, GREEDY, None).catch_up_seconds == 0.0  # the prompt was fed by begin


def greedy_config(k=4):
    return GenerationConfig(max_new_tokens=40, k=k, eos_token_ids=())


@pytest.mark.parametrize("kind", ["prompt-lookup", "suffix-index", "composite", "cross-tokenizer"])
def test_every_drafter_is_lossless_greedy(target, tiny_llama_dir, repeating_prompt, kind):
    drafter = make_drafter(kind, target, str(tiny_llama_dir) if kind in ("composite", "cross-tokenizer") else None, "float32")
    spec = SpeculativeEngine(target, drafter)
    plain = SpeculativeEngine(target)
    drafted = 0
    for prompt in (repeating_prompt, "class Point:\n    def __init__(self, x, y):\n"):
        expected = plain.generate(prompt, greedy_config(k=0))
        result = spec.generate(prompt, greedy_config())
        assert result.token_ids == expected.token_ids
        drafted += result.stats.drafted_tokens
    assert drafted > 0  # the repetitive prompt gives even lookup something to propose


def test_cross_tokenizer_maps_text_across_vocabularies(target, llama):
    drafter = CrossTokenizerDrafter(llama, target)
    ids = target.encode("def add(a, b):\n    return")
    drafter.begin(ids, 64)
    proposal = drafter.propose(ids, 4, GREEDY, None)
    assert proposal.probs is None and proposal.forwards >= 1
    draft_text = llama.tokenizer.decode(drafter.cached_ids, skip_special_tokens=True)
    assert draft_text.startswith("def add(a, b):")  # the draft read the target's text in its own vocabulary
    assert all(0 <= t < target.model.vocab_size for t in proposal.token_ids[0].tolist())


def test_make_drafter_errors(target):
    with pytest.raises(ValueError, match="not one of"):
        make_drafter("telepathy", target)
    with pytest.raises(ValueError, match="needs a draft model"):
        make_drafter("cross-tokenizer", target, None)
    assert make_drafter("none", target) is None


def test_the_default_drafter_is_composite_and_no_draft_model_means_plain():
    from verispec.drafters import drafter_for

    assert drafter_for(None, "qwen2.5-coder-0.5b-instruct") == "composite"
    assert drafter_for(None, "none") == drafter_for(None, None) == "none"  # `--draft none`: plain decoding
    assert drafter_for("draft-model", "None") == "none"
    assert drafter_for("suffix-index", "none") == "suffix-index"  # needs no draft model
    assert drafter_for("composite", "none") == "composite"  # named: refused later with what to pass
