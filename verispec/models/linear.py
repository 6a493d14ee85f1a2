"""Linear layers in the weight formats a model can run in, and how `auto` picks one by measuring.

Formats (the `--quantize` choices; a target's "auto" picks among them by timing whole forwards of the model,
see verispec.models.target_format; `choose_format` resolves the rest):
  none  dense weights in the compute dtype (F.linear).
  w8a8  int8 weights (one scale per output row) times int8 activations (one scale per input row),
        integer accumulation in oneDNN with prepacked weights (only where its sums are exact: CPUs with
        VNNI or AMX, see onednn_int8_exact). Its cost hardly grows with the number
        of rows up to 16, so a verify pass over k + 1 tokens costs what one token costs. Integer
        sums are exact and each row has its own scale, so a row's result does not depend on the
        other rows in the call: the format is batch-invariant, bit for bit.
  w4a8  int8 weights that are 4-bit codes times an integer plus an integer, per 32 inputs, times int8 activations:
        passes of up to 8 rows read the 4-bit codes with verispec's AVX-512 VNNI (or AVX2) kernel
        (verispec.models.w4a8, built on first use), about half w8a8's bytes; longer passes run
        oneDNN on an int8 copy, or the kernel too where it is as fast (W4A8_LONG_PASSES). Same
        integers either way: batch-invariant like w8a8.
  int8  weight-only int8 (`_weight_int8pack_mm`): fast for one row, slower than dense past 4 rows.
  int4  weight-only int4, groups of 32 inputs (`_weight_int4pack_mm_for_cpu`): idem.
The weight-only formats keep a dense copy for prefill (many rows), so they serve drafters best.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verispec.models import w4a8
from verispec.models.machine import remembered_choice

FORMATS = ("none", "w4a8", "w8a8", "int8", "int4")
QUANTIZE_CHOICES = ("auto", *FORMATS)  # what `--quantize` takes
INT4_GROUP_SIZE = 32  # inputs sharing one int4 scale and zero
QUANTIZED_MAX_ROWS = 4  # above this many rows (prefill), dense beats the weight-only kernels
W8A8_ACTIVATIONS = ("s8", "u8")  # signed int8 (AMX) or unsigned with zero point 128 (VNNI); chosen by measuring
# How w4a8 runs passes longer than w4a8.KERNEL_MAX_ROWS (prefill): oneDNN on an int8 copy of the weights
# with either activation kind, or the 4-bit kernel itself, keeping no int8 copy (about 60% of the memory).
W4A8_LONG_PASSES = (*W8A8_ACTIVATIONS, "kernel")


def w8a8_available() -> bool:
    """Whether oneDNN's int8 linear runs here (x86 CPU builds of torch) and gives exact integer sums."""
    return onednn_int8_runs() and onednn_int8_exact()


def onednn_int8_runs() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


W8A8_INEXACT = (
    "oneDNN's int8 matmul is not exact on this CPU (without VNNI or AMX its 16-bit pair sums saturate)"
)


@functools.cache
def onednn_int8_exact() -> bool:
    """Whether oneDNN's int8 matmul gives the exact integer sums here, for both activation kinds.

    On CPUs without VNNI or AMX (AVX2 only) oneDNN multiplies with vpmaddubsw, whose
    16-bit sums of two products saturate: 127 * 127 twice is already past 32767, so full-range
    weights come out wrong, not merely rounded. Such results would be neither accurate nor the same
    as the w4a8 kernel's, so w8a8 is not offered there. Probed once per process on that worst case.
    """
    if not onednn_int8_runs():
        return False
    weight = torch.full((16, 64), 127, dtype=torch.int8)
    weight[::2] = -127  # (16, 64): both signs at full range
    x = torch.full((2, 64), 127, dtype=torch.int8)
    x[1, ::3] = -127  # (2, 64)
    exact = (x.long() @ weight.long().T).float()  # (2, 16)
    try:
        packed = torch.ops.onednn.qlinear_prepack(weight, None)
        scales, zero_points = torch.ones(16), torch.zeros(16, dtype=torch.int64)
        for q in (x, (x.int() + 128).to(torch.uint8)):  # s8, u8
            if not torch.equal(onednn_int8_matmul(q, packed, scales, zero_points), exact):
                return False
    except (RuntimeError, NotImplementedError):
        return False
    return True


def onednn_int8_matmul(
    q: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor
) -> torch.Tensor:
    """q (N, in) int8, or uint8 holding int8 + 128, times prepacked int8 weights (out, in) -> (N, out)
    float32: the integer sums times scales (out,); zero_points (out,) are the weights' (zeros)."""
    return torch.ops.onednn.qlinear_pointwise(
        q, 1.0, 128 if q.dtype == torch.uint8 else 0, packed, scales, zero_points, None, 1.0, 0, torch.float32,
        "none", [None], "",
    )


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: x ~= q * scale. x: (N, K) -> q (N, K) float holding integers, scale (N, 1)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0  # (N, 1)
    return torch.round(x / scale).clamp(-127, 127), scale


class Linear:
    """y = x W^T + b with W (out, in) held in one of FORMATS; starts dense in the compute dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # (out, in): dense, int8, or int4-packed, depending on the format
        self.bias = bias  # (out,) or None
        self.format = "none"
        self.out_features, self.in_features = weight.shape
        self.scales: torch.Tensor | None = None  # int8: (out,); int4: (in/G, out, 2) scales and zeros; w8a8: (out,) f32
        self.dense: torch.Tensor | None = weight  # (out, in) kept by weight-only formats for many-row inputs
        self.activations = "s8"  # w8a8: how activations are stored (W8A8_ACTIVATIONS); w4a8: W4A8_LONG_PASSES
        self._zero_points: torch.Tensor | None = None  # w8a8: (out,) zeros, oneDNN's per-channel weight zero points
        self.packed: torch.Tensor | None = None  # w4a8: (out/16, in/32, 288) 4-bit codes, group multipliers and offsets

    def quantize(self, weight_format: str, activations: str = "s8") -> None:
        if weight_format == "w4a8":
            self._quantize_w4a8(activations)
        elif weight_format == "w8a8":
            self._quantize_w8a8(activations)
        elif weight_format == "int8":
            self._quantize_int8()
        elif weight_format == "int4":
            self._quantize_int4()
        elif weight_format != "none":
            raise ValueError(f"weight format {weight_format!r} is not one of {', '.join(FORMATS)}")

    def _int8_rows(self, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
        """int8 weights (out, in) and float32 scales (out,), one per output row; in chunks of rows so
        that the float32 temporaries of a large matrix (the 150k-row lm_head) stay small."""
        q = torch.empty(self.weight.shape, dtype=torch.int8)
        scales = torch.empty(self.out_features)
        for start in range(0, self.out_features, chunk):
            w = self.weight[start : start + chunk].float()  # (chunk, in)
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (chunk,)
            q[start : start + chunk] = torch.round(w / scale[:, None]).clamp(-127, 127)
            scales[start : start + chunk] = scale
        return q, scales

    def _quantize_w8a8(self, activations: str) -> None:
        q, scales = self._int8_rows()
        self._use_int8(q, scales, activations)
        self.format = "w8a8"

    def _quantize_w4a8(self, activations: str) -> None:
        if activations not in W4A8_LONG_PASSES:
            raise ValueError(f"w4a8 long passes {activations!r} are not one of {', '.join(W4A8_LONG_PASSES)}")
        weight, bias = self.weight, self.bias
        if not w4a8.supports_shape(self.out_features, self.in_features):
            if onednn_int8_exact() or self.in_features % w4a8.GROUP_SIZE:
                # The 4-bit kernel's blocks do not tile it; int8 is as exact (u8 runs on every int8 kernel).
                self._quantize_w8a8("u8" if activations == "kernel" else activations)
                return
            # oneDNN's sums are not exact here: zero outputs pad the kernel's last block of columns (each
            # output row is quantized alone, so the others are unchanged) and are cut from every result.
            missing = -self.out_features % w4a8.COLUMNS
            weight = torch.cat([weight, weight.new_zeros(missing, self.in_features)])
            bias = None if bias is None else torch.cat([bias, bias.new_zeros(missing)])
        w4a8.load_kernel()
        # packed: what passes of few rows read; with "kernel" every pass reads the 4-bit codes: no int8 copy
        int8, scales, self.packed = w4a8.quantize(weight, keep_int8=activations != "kernel")
        self.bias = bias
        if activations == "kernel":
            self.weight, self.scales, self.dense, self.activations = None, scales, None, activations
            self.bias = None if self.bias is None else self.bias.float()
        else:
            self._use_int8(int8, scales, activations)
        self.format = "w4a8"

    def _use_int8(self, q: torch.Tensor, scales: torch.Tensor, activations: str) -> None:
        """Run int8 weights q (out, in) with scales (out,) through oneDNN (w8a8, and w4a8's multi-row passes)."""
        if activations not in W8A8_ACTIVATIONS:
            raise ValueError(f"w8a8 activations {activations!r} are not one of {', '.join(W8A8_ACTIVATIONS)}")
        self.weight = torch.ops.onednn.qlinear_prepack(q, None)  # opaque, laid out for this CPU's kernels
        self.scales = scales  # (out,) float32
        self._zero_points = torch.zeros(self.out_features, dtype=torch.int64)
        self.bias = None if self.bias is None else self.bias.float()
        self.dense = None  # the int8 matmul is also the fastest for prefill: no dense copy kept
        self.activations = activations

    def _quantize_int8(self) -> None:
        q, scales = self._int8_rows()
        self.weight, self.scales = q.contiguous(), scales.to(torch.bfloat16)
        self.format = "int8"

    def _quantize_int4(self, group_size: int = INT4_GROUP_SIZE) -> None:
        if self.out_features % 16 or self.in_features % group_size:
            return  # the int4 kernel's tiling cannot hold this shape: it stays dense
        w = self.weight.float()
        groups = w.view(self.out_features, self.in_features // group_size, group_size)  # (out, in/G, G)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-8)
        q = torch.round((groups - low) / scale).clamp(0, 15).view(self.out_features, self.in_features)
        zero = low + 8 * scale  # the kernel computes (q - 8) * scale + zero
        self.scales = torch.cat([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
        self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 8)
        self.format = "int4"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, in)
        if self.format == "w4a8":
            return self._w4a8(flat).reshape(*x.shape[:-1], -1)  # (..., out)
        if self.format == "w8a8":
            y = self._w8a8(flat).to(x.dtype)
        elif self.format == "none" or flat.shape[0] > QUANTIZED_MAX_ROWS:
            return F.linear(x, self.dense, self.bias)
        elif self.format == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight, INT4_GROUP_SIZE, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales.to(x.dtype))
        y = y.reshape(*x.shape[:-1], -1)  # (..., out)
        return y if self.bias is None or self.format == "w8a8" else y + self.bias

    def _w8a8(self, flat: torch.Tensor) -> torch.Tensor:
        """(N, in) -> (N, out) float32; every step is per row, so row n's result ignores the others."""
        q, row_scales = quantize_rows(flat)  # (N, in), (N, 1)
        q = q.to(torch.int8) if self.activations == "s8" else (q + 128).to(torch.uint8)
        y = self._onednn_int8(q) * row_scales
        return y if self.bias is None else y + self.bias

    def _w4a8(self, flat: torch.Tensor) -> torch.Tensor:
        """(N, in) -> (N, out) in flat's dtype. Up to w4a8.KERNEL_MAX_ROWS rows run the 4-bit kernel, more
        run oneDNN on the int8 weights; both quantize activations and finish (row scales, bias, dtype)
        in the same C++, so a row gets the same bits either way."""
        if flat.shape[0] <= w4a8.KERNEL_MAX_ROWS or self.activations == "kernel":
            y = torch.ops.verispec.w4a8_linear(flat, self.packed, self.scales, self.bias)  # (N, out, padded)
        else:
            q, row_scales = torch.ops.verispec.w4a8_quantize_rows(flat, self.activations == "u8")  # (N, in), (N, 1)
            y = torch.ops.verispec.w4a8_finish(self._onednn_int8(q), row_scales, self.bias, flat.dtype)
        return y if y.shape[1] == self.out_features else y[:, : self.out_features]  # (N, out)

    def _onednn_int8(self, q: torch.Tensor) -> torch.Tensor:
        """q (N, in) int8, or uint8 holding int8 + 128 -> (N, out) float32: exact integer sums times the weight scales."""
        single = q.shape[0] == 1
        if single:  # oneDNN's one-row kernel is slower than its two-row one; rows never mix
            q = q.expand(2, -1)  # (2, in)
        y = onednn_int8_matmul(q, self.weight, self.scales, self._zero_points)  # (N, out)
        return y[:1] if single else y


@dataclass(frozen=True)
class FormatChoice:
    weight_format: str  # one of FORMATS
    activations: str = "s8"  # w8a8 only
    seconds: dict[str, float] | None = None  # what was measured: candidate -> seconds at 1 and 8 rows

    @property
    def label(self) -> str:
        if self.weight_format in ("w8a8", "w4a8"):
            return f"{self.weight_format}-{self.activations}"
        return self.weight_format


BATCH_INVARIANT_FORMATS = ("w4a8", "w8a8")  # each row's result ignores the other rows of a call


HOPELESS = 10.0  # a candidate whose one-row call takes this many times the best one's is not timed further


def time_call(function, repeats: int = 7) -> float:
    """Median seconds of `repeats` calls of function(), after one warm-up call."""
    function()  # warm-up: first calls allocate and pick kernels
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def measure_formats(
    candidates: tuple[str, ...], dtype: torch.dtype, in_features: int = 1536, out_features: int = 4096,
    rows: tuple[int, ...] = (1, 8), copies: int = 1, screen_rows: int = 1,
) -> dict[str, float]:
    """Median seconds of `copies` random in -> out linears called in turn, summed over `rows` (one
    token; a verify pass), per candidate.

    Several copies make the weights come from memory rather than cache, as a whole forward's do:
    what separates formats of different sizes. Every candidate is first called once on `screen_rows`
    rows; one that takes HOPELESS times the fastest of them all is not timed further (that call, scaled to
    the rows, stands for it), whatever its place in `candidates`: a reference path timed in full would cost
    far more than the rest of the load. Candidates are FORMATS or "w8a8-s8" / "w8a8-u8"; one that fails to
    run on this CPU is left out.
    """
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(out_features, in_features, generator=generator) * 0.02).to(dtype) for _ in range(copies)]
    inputs = [torch.randn(n, in_features, generator=generator).to(dtype) for n in rows]
    screen = torch.randn(screen_rows, in_features, generator=generator).to(dtype)
    screened, linears_of = {}, {}  # screened: one warm call of every candidate on `screen`
    for candidate in candidates:
        weight_format, _, activations = candidate.partition("-")
        linears = [Linear(weight.clone()) for weight in weights]
        try:
            for linear in linears:
                linear.quantize(weight_format, activations or "s8")
            [linear(screen[:1]) for linear in linears]  # warm-up, at one row: cheap on every path
            started = time.perf_counter()
            [linear(screen) for linear in linears]
        except (RuntimeError, NotImplementedError):  # this CPU or build lacks the kernel
            continue
        screened[candidate], linears_of[candidate] = time.perf_counter() - started, linears
    seconds = {}
    for candidate, linears in linears_of.items():
        if screened[candidate] > HOPELESS * min(screened.values()):
            # A reference path (oneDNN's signed int8 without AMX: far slower per call): its cost is
            # estimated from the screening call rather than timed at every row count.
            seconds[candidate] = screened[candidate] * sum(rows) / screen_rows
            continue
        seconds[candidate] = sum(time_call(lambda x=x, ls=linears: [linear(x) for linear in ls]) for x in inputs)
    return seconds


AUTO_CANDIDATES = ("w4a8", "w8a8-s8", "w8a8-u8", "none")  # what a target's `auto` times; see choose_format
# auto's probe: four 1536 -> 8960 linears (the 1.5B's MLP up-projection), 110 MB in bfloat16.
AUTO_PROBE = {"in_features": 1536, "out_features": 8960, "copies": 4}


def auto_candidates() -> tuple[str, ...]:
    """The AUTO_CANDIDATES that run here: w8a8 where oneDNN's sums are exact, w4a8 where its kernel builds."""

    def runs_here(candidate: str) -> bool:
        if candidate.startswith("w8a8"):
            return w8a8_available()
        return candidate != "w4a8" or w4a8.unavailable_reason() is None

    return tuple(filter(runs_here, AUTO_CANDIDATES))


def w4a8_long_pass_kinds() -> tuple[str, ...]:
    """The W4A8_LONG_PASSES that run here: oneDNN's only where its sums are exact."""
    return W4A8_LONG_PASSES if w8a8_available() else ("kernel",)


def auto_keeps_dense(dtype: torch.dtype, dtype_asked: bool) -> bool:
    """`auto` keeps a float32 or float16 that was asked for dense: asking for them asks for their exact arithmetic."""
    return dtype != torch.bfloat16 and dtype_asked


def choose_format(requested: str, dtype: torch.dtype, dtype_asked: bool = True) -> FormatChoice:
    """Resolve `--quantize` for a target without loading it: "auto" times w4a8, w8a8 (both activation kinds) and
    dense on linears alone. load_model's "auto" times whole forwards of the model instead (target_format) and
    comes here only where dense is kept; "w8a8" picks its activation kind here.

    auto keeps dense weights for float32/float16 compute that was asked for (dtype_asked: asking for
    those asks for their exact arithmetic); float32 that `--dtype auto` chose, on a CPU without
    bfloat16 dot products, is timed like bfloat16. Every candidate matches the dense target's HumanEval
    pass@1 within the benchmark's noise (benchmarks/results/xeon/quantized/), so speed
    decides, measured on linears that do not fit in cache, as a model's do not. The weight-only
    formats are not candidates: past 4 rows (every verify pass) they are slower than dense. w4a8 is
    left out where its kernel cannot run.
    """
    if requested not in QUANTIZE_CHOICES:
        raise ValueError(f"--quantize {requested!r} is not one of auto, {', '.join(FORMATS)}")
    if requested in ("none", "int8", "int4"):
        return FormatChoice(requested)
    if requested == "auto" and auto_keeps_dense(dtype, dtype_asked):
        return FormatChoice("none")
    if requested == "w8a8" and not onednn_int8_runs():
        raise ValueError("--quantize w8a8 needs oneDNN (an x86-64 CPU build of torch); use --quantize none")
    if requested == "w8a8" and not onednn_int8_exact():
        raise ValueError(f"--quantize w8a8: {W8A8_INEXACT}; use --quantize w4a8 or none")
    if requested == "w4a8":
        w4a8.load_kernel()  # raises KernelUnavailable with the reason and what to use instead
        return w4a8_choice(dtype)
    candidates = auto_candidates()
    if requested == "w8a8":
        candidates = tuple(c for c in candidates if c.startswith("w8a8"))
    seconds = measure_formats(candidates, dtype, **AUTO_PROBE)
    if requested == "w8a8" and not seconds:
        raise ValueError("--quantize w8a8: oneDNN's int8 kernels do not run on this CPU; use --quantize none")
    return candidate_choice(min(seconds, key=seconds.get), dtype, seconds)


def candidate_choice(candidate: str, dtype: torch.dtype, seconds: dict[str, float] | None = None) -> FormatChoice:
    """A candidate's name as the format it loads in, carrying what was timed: "w8a8-u8" -> FormatChoice("w8a8",
    "u8", seconds); "w4a8" takes the long-pass kind its prefill timing chose, that timing joining `seconds`."""
    weight_format, _, activations = candidate.partition("-")
    if weight_format == "w4a8":
        return w4a8_choice(dtype, seconds)
    return FormatChoice(weight_format, activations or "s8", seconds)


W4A8_LONG_PASS_ROWS = 128  # a prompt chunk: how the long-pass candidates are timed
KERNEL_MEMORY_PREFERENCE = 1.1  # the 4-bit kernel for long passes, unless oneDNN is more than 10% faster


def w4a8_choice(dtype: torch.dtype, seconds: dict[str, float] | None = None) -> FormatChoice:
    """w4a8 with the fastest way to run long passes (prefill), timed there once per machine.

    oneDNN on an int8 copy with signed or unsigned activations (its signed path is a slow reference
    one on CPUs without AMX, orders of magnitude behind the unsigned one there), or the 4-bit kernel for
    every pass, which keeps no int8 copy and wins ties: it needs ~60% of the memory. Every choice
    computes the same integers, so the outputs are the same. Where oneDNN's sums are not exact
    (onednn_int8_exact), the kernel runs every pass.
    """

    def measure() -> dict:
        candidates = tuple(f"w4a8-{kind}" for kind in reversed(w4a8_long_pass_kinds()))  # the likely fastest first
        timed = measure_formats(  # screened on the shortest pass oneDNN runs
            candidates, dtype, rows=(W4A8_LONG_PASS_ROWS,), copies=2, screen_rows=w4a8.KERNEL_MAX_ROWS + 1
        )
        weighed = {c: t / (KERNEL_MEMORY_PREFERENCE if c == "w4a8-kernel" else 1.0) for c, t in timed.items()}
        return {"activations": min(weighed, key=weighed.get).partition("-")[2], "seconds": timed}

    kind = f"w4a8 long passes {str(dtype).removeprefix('torch.')} among {','.join(w4a8_long_pass_kinds())}"
    kept = remembered_choice(kind, measure)
    return FormatChoice("w4a8", kept["activations"], {**(seconds or {}), **kept["seconds"]})
