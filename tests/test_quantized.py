"""The w8a8 and w4a8 target formats: accurate, and batch-invariant bit for bit (what makes greedy speculation exact)."""

from __future__ import annotations

import time

import pytest
import torch

from verispec.drafters.draft_vocab import dense_head
from verispec.models import linear as linear_module
from verispec.models import w4a8
from verispec.models.linear import (
    W8A8_INEXACT, Linear, auto_candidates, choose_format, measure_formats, w4a8_long_pass_kinds, w8a8_available,
)
from verispec.models.loading import load_model

# w8a8 runs where oneDNN's int8 sums are exact (VNNI or AMX: the AVX-512 AMD EPYCs and Intel Xeons); w4a8
# wherever its kernel builds (AVX-512 VNNI, or AVX2: an AMD EPYC Zen 2 too). Each test names what it needs.
needs_w8a8 = pytest.mark.skipif(not w8a8_available(), reason=f"w8a8: {W8A8_INEXACT} (or no oneDNN)")
needs_w4a8 = pytest.mark.skipif(w4a8.unavailable_reason() is not None, reason=f"w4a8: {w4a8.unavailable_reason()}")
pytestmark = needs_w4a8
FAST_FORMATS = [pytest.param("w8a8", marks=needs_w8a8), "w4a8"]


def fresh_logits(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(ids) + 4)
    return model.forward(torch.tensor([ids]), cache)[0]  # (T, V)


def one_at_a_time(model, prefix: list[int], new: list[int]) -> torch.Tensor:
    """Logits of each of `new` fed one token per forward after `prefix`: plain decoding's calls. (T, V)"""
    cache = model.new_cache(1, len(prefix) + len(new) + 4)
    model.forward(torch.tensor([prefix]), cache)
    cache.commit(len(prefix))
    rows = []
    for token in new:
        rows.append(model.forward(torch.tensor([[token]]), cache)[0, 0])
        cache.commit(1)
    return torch.stack(rows)


@pytest.mark.parametrize(
    "weight_format, activations",
    [
        *(pytest.param(f, a, marks=needs_w8a8) for f in ("w8a8", "w4a8") for a in ("s8", "u8")),  # oneDNN's passes
        ("w4a8", "kernel"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_rows_do_not_depend_on_the_other_rows(weight_format, activations, dtype):
    """w4a8's kernel (up to 8 rows, finish fused in) and oneDNN's multi-row matmul give a row the same bits."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 256, generator=generator)
    x = torch.randn(16, 256, generator=generator).to(dtype)
    linear = Linear(weight.to(dtype), torch.randn(96, generator=generator).to(dtype))
    linear.quantize(weight_format, activations)
    assert linear.format == weight_format
    full = linear(x)  # (16, 96)
    assert full.dtype == dtype
    for n in (1, 2, 3, 5, 8, 9, 15):
        assert torch.equal(linear(x[:n]), full[:n])
        assert torch.equal(linear(x[n - 1 : n]), full[n - 1 : n])
    reference = x.float() @ weight.to(dtype).float().T + linear.bias.float()
    error = (full.float() - reference).norm() / reference.norm()
    assert error < {"w8a8": 0.02, "w4a8": 0.12}[weight_format], f"{weight_format} relative error {error:.4f}"


def test_w4a8_kernel_gives_the_exact_integer_sums_of_the_int8_weights():
    """The 4-bit codes, multipliers and offsets hold exactly the int8 weights oneDNN runs, and the kernel's
    output is float(sum of their int8 products) * scale: checked against int64 sums."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 128, generator=generator) * torch.rand(64, 1, generator=generator)
    weight[3, 5] = 40.0  # an outlier: its row's other groups get small multipliers
    int8, scale, packed = w4a8.quantize(weight.to(torch.bfloat16))
    assert packed.shape == (4, 4, 288)
    xq = torch.randint(-127, 128, (11, 128), generator=generator, dtype=torch.int8)
    exact = (xq.long() @ int8.long().T).float() * scale  # (11, 64): integer sums are exact in int64
    for rows in range(1, 12):  # every pass size of the kernel, and a pass of 8 followed by a shorter one
        assert torch.equal(w4a8.matmul(xq[:rows], packed, scale), exact[:rows]), f"{rows} rows"
    error = (int8.float() * scale[:, None] - weight).norm() / weight.norm()
    assert error < 0.12, f"4-bit relative error {error:.4f}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [256, 100])  # rows of a multiple of 16 inputs, and not
def test_w4a8_activation_codes_are_the_formula(dtype, k):
    """Codes = clamp(round half to even(x / (amax / 127)), -127, 127), bit for bit, ties and NaN included."""
    w4a8.load_kernel()
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(5, k, generator=generator) * torch.tensor([1.0, 30.0, 1e-3, 5.0, 1.0])[:, None]
    ties = torch.arange(k, dtype=torch.float32) % 41 - 20.5  # n + 1/2: with amax 127 the scale is exactly 1
    x[3] = ties
    x[3, 7] = 127.0
    x[4, 11] = float("nan")  # a NaN is no row's largest |x|, and its code is -127
    x = x.to(dtype)
    for unsigned in (False, True):
        q, scale = torch.ops.verispec.w4a8_quantize_rows(x, unsigned)
        xf = x.float()
        amax = torch.nan_to_num(xf, nan=0.0).abs().amax(dim=1, keepdim=True)
        want_scale = amax.clamp(min=1e-12) / 127.0
        codes = torch.nan_to_num(torch.round(xf / want_scale), nan=-127.0).clamp(-127, 127)
        assert torch.equal(scale, want_scale)
        assert scale[3].item() == 1.0
        assert torch.equal(q.int(), (codes + (128 if unsigned else 0)).int())


def test_w4a8_groups_use_all_16_codes_on_their_own_range():
    """Groups whose weights are all positive (or all negative) get an offset: their 16 codes cover
    [min, max], not [-max, max] as a symmetric grid would (half the codes unused, twice the error)."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.rand(32, 256, generator=generator)  # uniform in [0, 1): every group one-sided
    weight[:, 32:64] -= 1.0  # and some groups all negative
    int8, scale, packed = w4a8.quantize(weight.to(torch.bfloat16))
    codes = int8.view(32, 8, 32)
    # 32 draws over 16 codes hit ~14 of them; a symmetric grid could use at most 9 (0..8 of -8..7)
    assert min(len(group.unique()) for group in codes.flatten(0, 1)) >= 10
    error = (int8.float() * scale[:, None] - weight.to(torch.bfloat16).float()).norm() / weight.norm()
    assert error < 0.045, f"4-bit relative error {error:.4f} (a symmetric grid gives ~0.07)"
    xq = torch.randint(-127, 128, (5, 256), generator=generator, dtype=torch.int8)
    assert torch.equal(w4a8.matmul(xq, packed, scale), (xq.long() @ int8.long().T).float() * scale)


@pytest.mark.parametrize("weight_format", FAST_FORMATS)
def test_verify_pass_equals_plain_decoding_bitwise(tiny_dir, weight_format):
    """k + 1 tokens in one forward give each row exactly the logits of a one-token forward."""
    model = load_model(tiny_dir, "bfloat16", quantize=weight_format).model
    assert model.batch_invariant
    prefix, new = list(range(3, 40)), [50, 61, 72, 83, 94, 105, 116, 127]
    cache = model.new_cache(1, 64)
    model.forward(torch.tensor([prefix]), cache)
    cache.commit(len(prefix))
    verify = model.forward(torch.tensor([new]), cache)[0]  # (T, V)
    assert torch.equal(verify, one_at_a_time(model, prefix, new))


@pytest.mark.parametrize("weight_format", FAST_FORMATS)
def test_ragged_batch_rows_equal_single_rows(tiny_dir, weight_format):
    """A row of a batched verify (other rows longer, padded) equals that sequence verified alone."""
    model = load_model(tiny_dir, "bfloat16", quantize=weight_format).model
    prompts = [list(range(3, 20)), list(range(30, 61)), list(range(7, 12))]
    drafts = [[50, 51, 52, 53], [60, 61, 62, 63], [70, 71, 72, 73]]
    batch = model.new_cache(3, 64)
    singles = []
    for row, prompt in enumerate(prompts):
        view = batch.rows(row, row + 1)
        model.forward(torch.tensor([prompt]), view)
        view.commit(len(prompt))
        alone = model.new_cache(1, 64)
        model.forward(torch.tensor([prompt]), alone)
        alone.commit(len(prompt))
        singles.append(model.forward(torch.tensor([drafts[row]]), alone)[0])
    batched = model.forward(torch.tensor(drafts), batch)  # (3, T, V)
    for row in range(3):
        assert torch.equal(batched[row], singles[row])


@pytest.mark.parametrize("weight_format", FAST_FORMATS)
def test_tree_node_equals_its_path_decoded_plainly(tiny_dir, weight_format):
    model = load_model(tiny_dir, "bfloat16", quantize=weight_format).model
    prefix = list(range(3, 30))
    # A root with two children: 0 -> 1 and 0 -> 2; node 2 sees the root only.
    tree = torch.tensor([[[True, False, False], [True, True, False], [True, False, True]]])
    cache = model.new_cache(1, 64)
    model.forward(torch.tensor([prefix]), cache)
    cache.commit(len(prefix))
    positions = torch.tensor([[len(prefix), len(prefix) + 1, len(prefix) + 1]])
    logits = model.forward(torch.tensor([[40, 41, 42]]), cache, positions=positions, tree_mask=tree)[0]
    assert torch.equal(logits[2], one_at_a_time(model, prefix, [40, 42])[1])
    assert torch.equal(logits[1], one_at_a_time(model, prefix, [40, 41])[1])


@pytest.mark.parametrize("weight_format", FAST_FORMATS)
def test_stays_close_to_dense(tiny_dir, weight_format):
    dense = load_model(tiny_dir, "bfloat16").model
    fast = load_model(tiny_dir, "bfloat16", quantize=weight_format).model
    ids = list(range(10, 40))
    a, b = fresh_logits(dense, ids), fresh_logits(fast, ids)
    assert not torch.equal(a, b)  # it is a different model ...
    correlation = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
    # ... that ranks tokens like the dense one (4 bits on a random 64-wide model: loose; real models:
    # benchmarks/results/xeon/quantized)
    assert correlation > {"w8a8": 0.99, "w4a8": 0.85}[weight_format]


def test_auto_format_keeps_exact_dtypes_dense_and_measures_bfloat16():
    assert choose_format("auto", torch.float32).weight_format == "none"
    choice = choose_format("auto", torch.bfloat16)
    timed = set(auto_candidates())  # dense against the int8 kernels (where exact) and the 4-bit one
    assert {"none", "w4a8"} <= timed and (w8a8_available() == ("w8a8-u8" in timed))
    assert timed <= set(choice.seconds)
    best = "w4a8" if choice.weight_format == "w4a8" else choice.label
    assert choice.seconds[best] == min(choice.seconds[c] for c in timed)
    if choice.weight_format == "w4a8" and w8a8_available():  # long passes then timed on one: oneDNN or the kernel
        onednn = min(choice.seconds["w4a8-s8"], choice.seconds["w4a8-u8"])
        kernel = choice.seconds["w4a8-kernel"]
        want = "w4a8-kernel" if kernel <= 1.1 * onednn else min(("w4a8-s8", "w4a8-u8"), key=choice.seconds.get)
        assert choice.label == want
    elif choice.weight_format == "w4a8":  # oneDNN's sums are not exact here: the kernel runs every pass
        assert choice.label == "w4a8-kernel"
    with pytest.raises(ValueError, match="--quantize 'int3'"):
        choose_format("int3", torch.bfloat16)


def test_auto_times_the_formats_in_a_float32_that_dtype_auto_chose():
    """A CPU without bfloat16 dot products computes in float32 by default: auto still picks the fastest format
    there, and keeps float32 dense only when it was asked for."""
    assert choose_format("auto", torch.float32, dtype_asked=True).weight_format == "none"
    choice = choose_format("auto", torch.float32, dtype_asked=False)
    timed = set(auto_candidates())
    assert timed <= set(choice.seconds)
    best = "w4a8" if choice.weight_format == "w4a8" else choice.label
    assert choice.seconds[best] == min(choice.seconds[c] for c in timed)


def test_a_kernel_this_cpu_lacks_is_left_out_and_auto_falls_back_to_dense(monkeypatch):
    def no_kernel(self, q):
        raise RuntimeError("onednn: unimplemented")  # what a CPU without the int8 kernels answers

    monkeypatch.setattr(linear_module, "onednn_int8_exact", lambda: True)  # a CPU whose int8 kernels are missing
    monkeypatch.setattr(Linear, "_onednn_int8", no_kernel)  # w8a8, and w4a8's multi-row passes
    monkeypatch.setattr(Linear, "_quantize_w4a8", lambda self, activations: no_kernel(self, None))
    seconds = measure_formats(("none", "w8a8-s8", "w4a8"), torch.bfloat16, 64, 32, rows=(1,), copies=2)
    assert list(seconds) == ["none"] and seconds["none"] > 0
    assert choose_format("auto", torch.bfloat16).weight_format == "none"
    with pytest.raises(ValueError, match="do not run on this CPU"):
        choose_format("w8a8", torch.bfloat16)


def test_a_hopeless_candidate_is_never_timed_in_full_even_when_it_is_listed_first(monkeypatch):
    """A reference path listed first (oneDNN's signed int8 comes before unsigned in `--quantize w8a8` on a Zen 4,
    where it takes seconds a call) gets its warm-up and screening calls only: every candidate is screened before
    any is timed."""
    calls = {"int8": 0, "none": 0}
    call = Linear.__call__

    def counted(self, x):
        calls[self.format] += 1
        if self.format == "int8":
            time.sleep(0.02)  # a reference path: far slower than dense
        return call(self, x)

    monkeypatch.setattr(Linear, "__call__", counted)
    seconds = measure_formats(("int8", "none"), torch.bfloat16, 64, 32, rows=(1, 8), copies=1)
    assert set(seconds) == {"int8", "none"} and seconds["int8"] > linear_module.HOPELESS * seconds["none"] / 9
    assert calls["int8"] == 2 and calls["none"] > 2  # warm-up and screen only; dense timed at both widths


def test_w4a8_that_cannot_run_here_is_named_when_asked(monkeypatch):
    reason = "this CPU lacks avx512_vnni"

    def refuse():
        raise w4a8.KernelUnavailable(f"--quantize w4a8 cannot run: {reason}; use --quantize w8a8 or none")

    monkeypatch.setattr(w4a8, "unavailable_reason", lambda: reason)
    monkeypatch.setattr(w4a8, "load_kernel", refuse)
    with pytest.raises(w4a8.KernelUnavailable, match="lacks avx512_vnni; use --quantize w8a8"):
        choose_format("w4a8", torch.bfloat16)


def test_where_onednn_int8_is_not_exact_w8a8_is_refused_and_never_chosen(monkeypatch):
    """Without VNNI or AMX oneDNN's int8 sums saturate: w8a8 is no candidate, w4a8 runs all passes on its kernel."""
    monkeypatch.setattr(linear_module, "onednn_int8_exact", lambda: False)
    with pytest.raises(ValueError, match="not exact on this CPU .*use --quantize w4a8 or none"):
        choose_format("w8a8", torch.bfloat16)
    assert not w8a8_available()
    assert auto_candidates() == ("w4a8", "none")
    assert w4a8_long_pass_kinds() == ("kernel",)
    assert choose_format("auto", torch.bfloat16).weight_format in ("w4a8", "none")


def test_the_onednn_probe_agrees_with_an_int8_matmul_of_full_range_values():
    """onednn_int8_exact says what a full-range int8 linear through oneDNN gives here (exact, or not)."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randint(-127, 128, (32, 256), generator=generator, dtype=torch.int8)
    x = torch.randint(-127, 128, (4, 256), generator=generator, dtype=torch.int8)
    linear = Linear(torch.zeros(32, 256))
    linear._use_int8(weight, torch.ones(32), "u8")
    exact = torch.equal(linear._onednn_int8((x.int() + 128).to(torch.uint8)), (x.long() @ weight.long().T).float())
    assert linear_module.onednn_int8_exact() == exact


@pytest.mark.parametrize("weight_format", FAST_FORMATS)
def test_a_quantized_head_restricted_from_dense_rows_equals_one_restricted_before_quantizing(tiny_dir, weight_format):
    after = load_model(tiny_dir, "bfloat16", quantize=weight_format).model
    with pytest.raises(ValueError, match="pass dense_rows"):
        after.restrict_output_vocab(torch.tensor([1, 2]))
    keep = torch.cat([torch.arange(0, 60, 2), torch.tensor([201, 333])])  # 32 rows: the 4-bit kernel's blocks tile them
    after.restrict_output_vocab(keep, dense_head(after, tiny_dir)[keep])
    before = load_model(tiny_dir, "bfloat16").model
    before.restrict_output_vocab(keep)
    choice = load_model(tiny_dir, "bfloat16", quantize=weight_format).format.choice
    before.quantize(choice.weight_format, choice.activations)
    assert after.lm_head.format == before.lm_head.format != "none"
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(after.forward(ids, after.new_cache(1, 8)), before.forward(ids, before.new_cache(1, 8)))


@needs_w8a8
def test_w4a8_long_passes_through_the_kernel_equal_onednn_and_keep_no_int8_copy():
    """w4a8 "kernel" runs prefill-sized passes on the 4-bit codes: the same bits as oneDNN on the int8 copy."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 128, generator=generator).to(torch.bfloat16)
    bias = torch.randn(64, generator=generator).to(torch.bfloat16)
    x = torch.randn(40, 128, generator=generator).to(torch.bfloat16)  # longer than the kernel's 8 rows
    kernel, onednn = Linear(weight.clone(), bias.clone()), Linear(weight.clone(), bias.clone())
    kernel.quantize("w4a8", "kernel")
    onednn.quantize("w4a8", "u8")
    assert kernel.weight is None and onednn.weight is not None  # no int8 copy for oneDNN kept
    assert torch.equal(kernel(x), onednn(x))
    with pytest.raises(ValueError, match="w4a8 long passes 'fp8'"):
        Linear(weight.clone()).quantize("w4a8", "fp8")


def test_w4a8_weights_kept_on_disk_give_the_same_bits(tmp_path, monkeypatch):
    """A large weight's quantized form is written once and read back bit for bit; a file that lacks the int8
    copy asked for, or that cannot be read, is computed again; another weight gets a file of its own."""
    computed = []
    search = w4a8.search_grid

    def counting(weight):
        computed.append(weight.shape)
        return search(weight)

    original_path = w4a8.quantized_path
    monkeypatch.setattr(w4a8, "quantized_path", lambda weight: tmp_path / original_path(weight).name)
    monkeypatch.setattr(w4a8, "search_grid", counting)
    weight = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)  # 2^20 weights

    int8, scale, packed = w4a8.quantize(weight)
    assert computed == [weight.shape] and len(list(tmp_path.iterdir())) == 1
    kept = w4a8.quantize(weight)
    assert computed == [weight.shape]  # read, not searched
    assert all(torch.equal(a, b) for a, b in zip(kept, (int8, scale, packed)))

    other = weight.clone()
    other[0, 0] += 1.0
    w4a8.quantize(other, keep_int8=False)
    assert len(computed) == 2 and len(list(tmp_path.iterdir())) == 2
    assert w4a8.quantize(other, keep_int8=False)[0] is None and len(computed) == 2
    assert torch.equal(w4a8.quantize(other)[0], search(other)[0]) and len(computed) == 3  # int8 asked: searched

    (tmp_path / original_path(weight).name).write_bytes(b"not safetensors")
    assert all(torch.equal(a, b) for a, b in zip(w4a8.quantize(weight), (int8, scale, packed)))
    assert len(computed) == 4
    small = torch.randn(64, 128).to(torch.bfloat16)
    w4a8.quantize(small)
    assert len(list(tmp_path.iterdir())) == 2  # small weights are not worth a file
