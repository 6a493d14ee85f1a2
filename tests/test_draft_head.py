"""The draft head (draft_head, batch_head): its drafting math is the trained module's, the step hands it the right
hidden states, and the output stays the target's: greedy token for token, sampled by the exact law."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import FAST_FORMAT
from laws import accept_all, exact_two_token_law, law_matches, two_token_frequencies
from verispec.drafters import draft_head, make_drafter
from verispec.drafters.batch_head import BatchedDraftHead
from verispec.drafters.draft_head import DraftHead, HeadLayer, attend_cached, load_head, output_rows, save_head
from verispec.engine import GenerationConfig, SpeculativeEngine
from verispec.models.attention import kernels_available
from verispec.models.transformer import PREFILL_CHUNK
from verispec.sampling import SamplingParams
from verispec.core import step as step_module
from verispec.serving.scheduler import Scheduler, SchedulerLimits

PROMPTS = ["def add(a, b):", "for i in range(10):\n", "The quick brown fox jumps over", "class Point:"]


def trainable_head(target, seed: int, echo: bool = False, vocab: torch.Tensor | None = None,
                   fused: bool = False) -> DraftHead:
    """A random head over the tiny target. echo: one that predicts the feature it is given (its layer adds
    nothing), so its draft is the target's own choice at the position it reads: the token already committed.
    fused: one that reads the hidden states after the first and the last layer (EAGLE-3's fused features)."""
    torch.manual_seed(seed)
    model = target.model
    vocab = torch.arange(model.vocab_size) if vocab is None else vocab
    rows = output_rows(target, torch.arange(model.vocab_size)).float()
    layers = (1, model.config.num_layers) if fused else ()
    head = DraftHead(model.embed.float(), model.final_norm.float(), rows, vocab, model.config.num_heads, 96,
                     model.config.rope_theta, layers)
    width = model.embed.shape[1]
    with torch.no_grad():
        for linear in (head.qkv, head.out, head.gate_up, head.down):
            linear.weight.normal_(0, 0.3)
        if fused and not echo:
            head.fuse.weight.normal_(0, 0.3)
        if echo:
            head.fc.weight[:, width:].zero_()
            head.out.weight.zero_()
            head.down.weight.zero_()
            if fused:  # the last layer's state passed on
                head.fuse.weight[:, :-width].zero_()
    return head


def head_file(target, tmp_path, **kwargs) -> str:
    path = tmp_path / "head.safetensors"
    save_head(trainable_head(target, **kwargs), path, target.name, {"test": True})
    return str(path)


def plain_tokens(target, prompts=PROMPTS, tokens: int = 24) -> list[list[int]]:
    engine = SpeculativeEngine(target)
    return [engine.generate(p, GenerationConfig(max_new_tokens=tokens, k=0)).token_ids for p in prompts]


@pytest.mark.skipif(not kernels_available(), reason="the attention kernel needs AVX-512 and a C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_heads_attention_kernel_attends_as_masked_torch_attention(dtype):
    """attend_cached through verispec's kernel: each row's new positions over its own cached slots (rows of different
    lengths, slots past them holding stale values) as torch's masked attention gives them."""
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(3, 4, 40, 32, generator=generator).to(dtype) for _ in range(2))  # (B, H, S, D)
    q = torch.randn(3, 4, 3, 32, generator=generator).to(dtype)  # (B, H, T, D)
    slots = torch.tensor([[5, 6, 7], [30, 31, 32], [0, 1, 2]])  # (B, T): each row's new positions
    span = int(slots.max()) + 1
    visible = torch.arange(span)[None, None, :] <= slots[:, :, None]  # (B, T, S)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), keys[:, :, :span].float(), values[:, :, :span].float(), attn_mask=visible[:, None])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(attend_cached(q, keys, values, slots).float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("kernel", [
    pytest.param(True, id="kernel", marks=pytest.mark.skipif(
        not kernels_available(), reason="the attention kernel needs AVX-512 and a C++ compiler")),
    pytest.param(False, id="torch"),
])
@pytest.mark.parametrize("fused", [False, True])
def test_drafting_computes_what_the_trained_module_computes(target, tmp_path, fused, kernel, monkeypatch):
    """HeadLayer.step over teacher-forced hidden states (the last layer's, or several layers' side by side), in
    any split of the positions, gives DraftHead.forward's predicted features, with verispec's attention kernel
    or torch's; and its scores are the module's over the head's vocabulary."""
    monkeypatch.setattr(draft_head, "attention_kernel_runs", lambda head_dim, dtype: kernel)
    vocab = torch.arange(0, target.model.vocab_size, 3)
    module = trainable_head(target, seed=1, vocab=vocab, fused=fused)
    path = tmp_path / "head.safetensors"
    save_head(module, path, target.name)
    layer = load_head(str(path), target)
    assert torch.equal(layer.vocab, vocab) and layer.feature_layers == module.feature_layers
    features = torch.randn(1, 12, layer.feature_width)  # (1, T, C or F C) raw hidden states
    next_ids = torch.randint(0, target.model.vocab_size, (1, 12))
    with torch.no_grad():
        expected = module(module.target_features(features), next_ids)  # (1, T, C)
    keys, values = layer.new_cache(1, 16)
    lengths = torch.zeros(1, dtype=torch.long)
    parts = []
    for start, stop in ((0, 5), (5, 6), (6, 12)):  # a prompt, one step's position, the rest
        positions = torch.arange(start, stop)[None]
        parts.append(layer.step(features[:, start:stop], next_ids[:, start:stop], positions, keys, values,
                                lengths, normalized=False))
        lengths += stop - start
    torch.testing.assert_close(torch.cat(parts, 1), expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(layer.logits(expected[0]), module.logits(expected[0]), atol=1e-4, rtol=1e-4)


def proposals_seen(monkeypatch) -> list[tuple[list[int], list[int], int, int]]:
    """Record every (committed tokens, drafts, first position, committed entries) the batched head proposes."""
    seen = []
    original = BatchedDraftHead.propose

    def propose(self, tokens, k, *args, **kwargs):
        proposals = original(self, tokens, k, *args, **kwargs)
        seen.extend(
            (list(t), p.token_ids[0].tolist(), self.first[b], int(self.lengths[b]))
            for b, (t, p) in enumerate(zip(tokens, proposals)) if p.num_tokens
        )
        return proposals

    monkeypatch.setattr(BatchedDraftHead, "propose", propose)
    return seen


@pytest.fixture(scope="module")
def fast_target(tiny_dir):
    """The tiny model in a batch-invariant format: the server carries its prompts in the decoding steps' forwards."""
    from verispec.models.loading import load_model

    return load_model(tiny_dir, "bfloat16", quantize=FAST_FORMAT)


@pytest.mark.parametrize("kind", ["float32", "fast"])
def test_the_step_hands_the_head_each_committed_positions_hidden_state(request, tmp_path, monkeypatch, kind):
    """An echo head drafts the target's choice at the newest position whose hidden state it holds. Handed the right
    ones (the newest committed token's is not known yet: the token before it), its first draft is the newest
    committed token itself, at every step of greedy decoding, in the library and in a batch of the server's (whose
    prompts ride in the decoding steps' forwards, fast): and every position from the prompt's first on is in."""
    target = request.getfixturevalue("target" if kind == "float32" else "fast_target")
    seen = proposals_seen(monkeypatch)
    drafter = make_drafter("draft-model", target, head_file(target, tmp_path, seed=2, echo=True))
    engine = SpeculativeEngine(target, drafter)
    for prompt in PROMPTS:
        engine.generate(prompt, GenerationConfig(max_new_tokens=16, k=2))
    library = list(seen)
    seen.clear()
    scheduler = Scheduler(target, drafter.model, "draft-model", k=2, limits=SchedulerLimits(4, 8, 128),
                          chunked_prefill=True)
    handles = [scheduler.submit(target.encode(p), GenerationConfig(max_new_tokens=16)) for p in PROMPTS]
    while scheduler.run_once():
        pass
    for handle in handles:
        list(handle.iter_events())
    prompts = [target.encode(p) for p in PROMPTS]

    def decoded(tokens: list[int]) -> bool:  # the newest token was the target's greedy choice, not the prompt's
        return any(tokens[: len(p)] == p and len(tokens) > len(p) for p in prompts)

    assert scheduler.packs_prefill == (kind == "fast")
    for proposals in (library, seen):
        assert all(first == 0 and entries == len(tokens) - 1 for tokens, _, first, entries in proposals)
        generated = [(tokens, drafts) for tokens, drafts, _, _ in proposals if decoded(tokens)]
        assert len(generated) > 20
        echoed = sum(drafts[0] == tokens[-1] for tokens, drafts in generated)
        assert echoed >= 0.9 * len(generated), f"{echoed} of {len(generated)} first drafts echo the newest token"


@pytest.mark.parametrize("k, fused", [(3, False), ("auto", False), (3, True), ("auto", True)])
def test_greedy_output_is_plain_decodings_in_the_library_and_the_server(target, tmp_path, k, fused):
    plain = plain_tokens(target)
    drafter = make_drafter("draft-model", target, head_file(target, tmp_path, seed=3, fused=fused))
    engine = SpeculativeEngine(target, drafter)
    results = [engine.generate(p, GenerationConfig(max_new_tokens=24, k=k)) for p in PROMPTS]
    assert [r.token_ids for r in results] == plain
    assert k == "auto" or sum(r.stats.drafted_tokens for r in results) > 0
    for chunked in (False, True):
        scheduler = Scheduler(target, drafter.model, "draft-model", k=k, limits=SchedulerLimits(3, 8, 128),
                              chunked_prefill=chunked)
        handles = [scheduler.submit(target.encode(p), GenerationConfig(max_new_tokens=24)) for p in PROMPTS]
        while scheduler.run_once():
            pass
        assert [[t for e in h.iter_events() for t in e.token_ids] for h in handles] == plain


def test_the_composite_drafter_runs_a_head_behind_its_lookup(target, tmp_path, repeating_prompt):
    drafter = make_drafter("composite", target, head_file(target, tmp_path, seed=4, echo=True))
    engine = SpeculativeEngine(target, drafter)
    prompts = [repeating_prompt, *PROMPTS]
    results = [engine.generate(p, GenerationConfig(max_new_tokens=24, k=3)) for p in prompts]
    assert [r.token_ids for r in results] == plain_tokens(target, prompts)
    sources = set().union(*(r.stats.steps_by_drafter for r in results))
    assert {"draft-head", "suffix-index"} <= sources


@pytest.mark.parametrize("fused", [False, True])
def test_sampled_output_follows_the_target_law(target, tmp_path, repeating_prompt, fused):
    sampling = SamplingParams(temperature=1.0, top_k=20)
    prompt_ids = target.encode(repeating_prompt)
    law = exact_two_token_law(target, prompt_ids, sampling)
    drafter = make_drafter("draft-model", target, head_file(target, tmp_path, seed=5, echo=True, fused=fused))
    engine = SpeculativeEngine(target, drafter)
    assert engine.generate(prompt_ids, GenerationConfig(max_new_tokens=4, k=3)).stats.drafted_tokens > 0
    runs = 1500
    assert law_matches(two_token_frequencies(engine, prompt_ids, sampling, runs), law, runs)


def test_negative_control_accept_all_fails_the_same_check(target, tmp_path, repeating_prompt, monkeypatch):
    monkeypatch.setattr(step_module, "verify", accept_all)
    sampling = SamplingParams(temperature=1.0, top_k=20)
    prompt_ids = target.encode(repeating_prompt)
    law = exact_two_token_law(target, prompt_ids, sampling)
    drafter = make_drafter("draft-model", target, head_file(target, tmp_path, seed=5, echo=True))
    engine = SpeculativeEngine(target, drafter)
    runs = 1500
    assert not law_matches(two_token_frequencies(engine, prompt_ids, sampling, runs), law, runs)


def test_a_missing_or_foreign_head_is_refused_with_what_to_do(target, other_tiny_dir, own_cache, tmp_path):
    from verispec.models.loading import load_model

    with pytest.raises(FileNotFoundError, match="make head"):
        make_drafter("draft-model", target, "head")
    other = load_model(other_tiny_dir, "float32")
    path = tmp_path / "other.safetensors"
    save_head(trainable_head(other, seed=6), path, "some-other-target")
    with pytest.raises(ValueError, match="trained for some-other-target"):
        make_drafter("draft-model", target, str(path))
    with pytest.raises(ValueError, match="runs as draft-model or composite"):
        make_drafter("cross-tokenizer", target, str(path))
    with pytest.raises(TypeError, match="through SpeculativeEngine"):
        make_drafter("draft-model", target, head_file(target, tmp_path, seed=6)).begin([1, 2, 3], 16)


def test_a_batch_hands_rows_their_own_states_as_rows_move(target, tmp_path):
    """Rows that finish leave the batch and the others move down (their head caches with them): the output of each
    stays plain decoding's, with max_tokens apart so that rows leave at different steps."""
    prompts = PROMPTS * 2
    lengths = [6, 30, 12, 24, 9, 18, 27, 15]
    engine = SpeculativeEngine(target)
    plain = [engine.generate(p, GenerationConfig(max_new_tokens=n, k=0)).token_ids for p, n in zip(prompts, lengths)]
    head = load_head(head_file(target, tmp_path, seed=7, echo=True), target)
    scheduler = Scheduler(target, head, "draft-model", k=3, limits=SchedulerLimits(4, 8, 128), chunked_prefill=True)
    handles = [scheduler.submit(target.encode(p), GenerationConfig(max_new_tokens=n)) for p, n in zip(prompts, lengths)]
    while scheduler.run_once():
        pass
    assert [[t for e in h.iter_events() for t in e.token_ids] for h in handles] == plain
    assert isinstance(scheduler.draft, BatchedDraftHead) and isinstance(scheduler.draft.model, HeadLayer)


def test_a_plain_step_hands_the_head_its_states_without_a_tensor_op(target, tmp_path):
    """observe runs for every row of every step, drafting or not: each tensor op there hands the GIL to a served
    event loop and waits to get it back (1.8 ms of a 16-row chat step on a Xeon, where nothing drafted). Steady-state
    observing is bookkeeping only: no op reaches the dispatcher."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountedOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    head = load_head(head_file(target, tmp_path, seed=9), target)
    draft = BatchedDraftHead(head, target.model.vocab_size, max_batch_size=2, capacity=64)
    states = torch.randn(12, head.width, dtype=head.dtype)  # (T, C) the target's hidden states of 12 positions
    draft.add(1, list(range(9)), 64)
    draft.observe(1, 0, states[:8])  # a prompt's
    steps = [(position, states[position : position + 1]) for position in range(8, 12)]  # then one a plain step
    with CountedOps() as counted:
        for position, features in steps:
            draft.observe(1, position, features)
    assert counted.ops == []
    assert draft.behind(1, list(range(13))) == 12 and draft.first[1] == 0


def test_a_rows_head_cache_holds_what_teacher_forcing_the_whole_text_gives(target, tmp_path, monkeypatch):
    """Drafts from an oracle (plain decoding's own continuation: every draft accepted, several tokens a step), the
    head's committed entries after decoding are those of one teacher-forced pass over the text: each position's
    hidden state paired with the token after it, whatever step committed it."""
    from verispec.drafters.batch_draft import ChainDrafter

    prompt = target.encode(PROMPTS[0])
    [continuation] = plain_tokens(target, [PROMPTS[0]], 30)
    text = prompt + continuation

    def oracle(self, logits, tokens, drafted, *args):
        return text[len(tokens) + len(drafted)], 1.0  # (the token, the draft's confidence in it)

    monkeypatch.setattr(ChainDrafter, "_draw", oracle)
    head = load_head(head_file(target, tmp_path, seed=8), target)
    engine = SpeculativeEngine(target, make_drafter("draft-model", target, str(tmp_path / "head.safetensors")))
    stream = engine.stream(prompt, GenerationConfig(max_new_tokens=30, k=3))
    result = list(stream) and stream.result
    assert result.token_ids == continuation and result.stats.mean_tokens_per_target_forward > 3
    draft = stream.scheduler.draft
    entries = int(draft.lengths[0])
    assert draft.first[0] == 0 and entries >= len(text) - 5  # all but the last step's positions
    hidden = []
    target.model.forward(torch.tensor([text[:-1]]), target.model.new_cache(1, len(text)), hidden_out=hidden)
    keys, values = head.new_cache(1, len(text))
    positions = torch.arange(len(text) - 1)[None]
    head.step(hidden[0], torch.tensor([text[1:]]), positions, keys, values, torch.zeros(1, dtype=torch.long), False)
    torch.testing.assert_close(draft.keys[0, :, :entries], keys[0, :, :entries], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(draft.values[0, :, :entries], values[0, :, :entries], atol=1e-4, rtol=1e-4)


def test_a_prompt_found_in_the_prefix_cache_brings_its_hidden_states_to_the_head(target, tmp_path, monkeypatch):
    """A prompt whose first blocks come from the prefix cache is never computed again: the cache keeps the target's
    hidden states beside the keys, so the head still sees it from its first position; the output stays plain."""
    prompt = PROMPTS[1] * 12  # more than a prefix-cache block
    [plain] = plain_tokens(target, [prompt], 16)
    seen = proposals_seen(monkeypatch)
    head = load_head(head_file(target, tmp_path, seed=9), target)
    scheduler = Scheduler(target, head, "draft-model", k=2, limits=SchedulerLimits(2, 8, 512, 1 << 24))
    outputs = []
    for _ in range(2):
        handle = scheduler.submit(target.encode(prompt), GenerationConfig(max_new_tokens=16))
        while scheduler.run_once():
            pass
        outputs.append([t for e in handle.iter_events() for t in e.token_ids])
        assert all(first == 0 and entries == len(tokens) - 1 for tokens, _, first, entries in seen) and seen
        seen.clear()
    assert outputs == [plain, plain]
    assert scheduler.prefix_cache.stats.hit_tokens >= PREFILL_CHUNK
    assert all(block.hidden is not None for block in scheduler.prefix_cache._blocks.values())


def test_the_command_line_drafts_with_a_head_file_and_says_how_to_build_a_missing_one(capsys, tiny_dir, target,
                                                                                       tmp_path, own_cache):
    import json

    from verispec.cli import main

    common = ["generate", "--json", "--target", str(tiny_dir), "--dtype", "float32", "--prompt", "def add(a, b):",
              "--max-new-tokens", "24"]
    assert main([*common, "--draft", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*common, "--draft", head_file(target, tmp_path, seed=10), "--k", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["drafted_tokens"] > 0
    assert main([*common, "--draft", "head"]) == 2
    error = capsys.readouterr().err
    assert "make head" in error and "Traceback" not in error


def test_doctor_times_the_head_it_would_draft_with_beside_the_target(capsys, tiny_dir, target, tmp_path, own_cache,
                                                                    monkeypatch):
    """`verispec doctor` times a head as it times a draft model (whole forwards beside the chosen target) and prices
    the expectation with it; with no --draft it times what serving would draft with (here: the built head)."""
    import json

    from verispec.cli import main
    from verispec.drafters import pairing
    from verispec.drafters.draft_head import head_path

    common = ["doctor", "--target", str(tiny_dir), "--json", "--rounds", "1", "--context", "8"]
    path = head_file(target, tmp_path, seed=12)
    assert main([*common, "--draft", path]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["expectation"]["draft_format"] == "head" and report["expectation"]["verdict"]
    assert list(report["costs"]["draft"]) == ["head"]
    assert set(report["costs"]["draft"]["head"]) == {"1", "2", "4", "8"}
    assert min(report["costs"]["draft"]["head"].values()) > 0
    assert report["choices"]["draft"]["model"] == f"draft head {path}"
    assert main([*common, "--draft", "head"]) == 2  # none built for this target
    error = capsys.readouterr().err
    assert "make head" in error and "Traceback" not in error
    monkeypatch.setattr(pairing, "default_draft", lambda name: "head")  # as for a catalog target with a head built
    head_path(str(tiny_dir)).parent.mkdir(parents=True)
    head_path(str(tiny_dir)).write_bytes(Path(path).read_bytes())
    assert main(common) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["choices"]["draft"]["model"] == f"draft head {head_path(str(tiny_dir))}"


def test_the_bench_says_a_head_drafts(target, tmp_path):
    from verispec.bench.command import drafter_label

    path = head_file(target, tmp_path, seed=11)
    assert drafter_label(make_drafter("composite", target, path)) == (
        f"suffix index, then draft head ({target.model.vocab_size} tokens)"
    )


def test_a_shipped_head_drafts_by_default_is_replaced_when_shipped_again_and_refused_when_damaged(
        target, tmp_path, own_cache, monkeypatch):
    """verispec ships a head per catalog target (verispec/data/heads, sha256 in heads.json): `--draft head` and a
    catalog target's default find it, a head `make head` built here goes first, shipping again replaces the file,
    and a file whose bytes changed is refused with what to do."""
    from verispec.drafters import HEAD_DRAFT, draft_head, pairing
    from verispec.models.catalog import DEFAULT_TARGET

    monkeypatch.setattr(draft_head, "SHIPPED_HEADS", tmp_path / "shipped")
    (tmp_path / "shipped").mkdir()
    assert draft_head.head_path(target.name) == draft_head.built_head_path(target.name)  # nothing shipped
    assert pairing.default_draft(DEFAULT_TARGET) != HEAD_DRAFT
    first = tmp_path / "shipped" / "first.safetensors"
    save_head(trainable_head(target, seed=13), first, target.name)
    draft_head.ship_head(first, target.name, {"test": True})
    assert draft_head.head_path(target.name) == first
    engine = SpeculativeEngine(target, make_drafter("draft-model", target, HEAD_DRAFT))
    results = [engine.generate(p, GenerationConfig(max_new_tokens=24, k=2)) for p in PROMPTS]
    assert [r.token_ids for r in results] == plain_tokens(target) and sum(r.stats.drafted_tokens for r in results)
    second = tmp_path / "shipped" / "second.safetensors"
    save_head(trainable_head(target, seed=14), second, target.name)
    draft_head.ship_head(second, target.name, {"test": True})
    assert draft_head.head_path(target.name) == second and not first.exists()  # replaced, not added beside it
    damaged = bytearray(second.read_bytes())
    damaged[-1] ^= 1
    second.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="does not match its sha256"):
        make_drafter("draft-model", target, HEAD_DRAFT)
    built = draft_head.built_head_path(target.name)
    built.parent.mkdir(parents=True)
    save_head(trainable_head(target, seed=15), built, target.name)
    assert draft_head.head_path(target.name) == built  # a head `make head` built here goes first
    make_drafter("draft-model", target, HEAD_DRAFT)  # (not checked against the shipped sha256)
    draft_head.ship_head(second, DEFAULT_TARGET, {"test": True})  # a catalog target with a shipped head ...
    assert pairing.default_draft(DEFAULT_TARGET) == HEAD_DRAFT  # ... drafts with it by default


def test_an_int8_head_file_is_a_quarter_of_the_bytes_and_drafts_as_its_rounded_weights(target, tmp_path):
    """A head stored as int8 per row (save_head weights="int8", how verispec ships one) loads back to each weight
    within half a step of its row's scale, takes about a quarter of float32's bytes, and drafts losslessly."""
    from verispec.drafters.draft_head import from_int8_rows, int8_rows, loaded_tensors, stored_tensors

    weight = torch.randn(64, 48) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different sizes
    quantized, scale = int8_rows(weight)
    assert quantized.dtype == torch.int8 and scale.shape == (64,)
    assert bool(((from_int8_rows(quantized, scale) - weight).abs() <= scale[:, None] / 2 + 1e-7).all())
    module = trainable_head(target, seed=16)
    wide, narrow = tmp_path / "float.safetensors", tmp_path / "int8.safetensors"
    save_head(module, wide, target.name)
    save_head(module, narrow, target.name, weights="int8")
    assert narrow.stat().st_size < 0.3 * wide.stat().st_size
    stored = stored_tensors(module, "int8")
    assert stored["gate_up"].dtype == torch.int8 and stored["attn_norm"].dtype == torch.float32
    restored = loaded_tensors(stored)
    assert set(restored) == set(module.trained_tensors())
    torch.testing.assert_close(restored["down"], module.down.weight.detach(), atol=float(stored["down.scale"].max()),
                               rtol=0)
    with pytest.raises(ValueError, match="head weights 'int4'"):
        stored_tensors(module, "int4")
    engine = SpeculativeEngine(target, make_drafter("draft-model", target, str(narrow)))
    results = [engine.generate(p, GenerationConfig(max_new_tokens=24, k=2)) for p in PROMPTS]
    assert [r.token_ids for r in results] == plain_tokens(target) and sum(r.stats.drafted_tokens for r in results)
