"""`verispec doctor`: what this machine is, what each weight format costs on it, and what speculation should gain.

What a user who sees a slowdown, or files a bug, runs first. Everything is returned as one JSON-able dict
(`diagnose`); the command line prints it.

Terms:
  candidate  a weight format `auto` may pick here (target: auto_candidates; draft: draft_candidates), plus
             dense; each is loaded and its whole forward timed (verispec.models.forward_cost).
  choice     what `--quantize auto` and `--draft-quantize auto` load here now, and the timings behind it,
             remembered per machine in the cache's format-choices.json.
  expectation  speculative decoding's speedup over plain decoding under a simple cost model, with the
             chosen formats' measured costs, for a few acceptance rates alpha (see expected_speedup).
"""

from __future__ import annotations

import gc
from itertools import pairwise
from typing import Callable, Iterable, Mapping

import torch

from verispec.bench.machine import git_commit, machine_description, machine_kind
from verispec.controller_settings import ControllerSettings
from verispec.cost_model import interpolate
from verispec.drafters import draft_candidates, quantize_draft
from verispec.drafters.draft_head import HEAD_DRAFT, HeadForwarding, head_file, is_head_spec, load_head
from verispec.drafters.pairing import draft_or_default
from verispec.models import w4a8
from verispec.models.catalog import DEFAULT_TARGET
from verispec.models.forward_cost import DEFAULT_CONTEXT, DEFAULT_ROUNDS, DEFAULT_ROWS, WARMUP_ROUNDS, forward_costs
from verispec.models.linear import (
    FORMATS, W4A8_LONG_PASS_ROWS, W8A8_INEXACT, FormatChoice, auto_candidates, onednn_int8_runs,
    w8a8_available,
)
from verispec.models.loading import (
    LoadedModel, build_kernel, load_model, resolve_dtype, resolve_model, resolve_target_format,
)
from verispec.models.target_format import PROBE_ROWS, PROBE_SHARE
from verispec.models.machine import FORMAT_CHOICES_FILE, cache_root, consulted_kinds, cpu_flags, remembered_choices

ISA_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx")  # "amx": any of amx_tile/int8/bf16
ACCEPTANCE_RATES = (0.5, 0.7, 0.9)  # a draft that often misses, a typical pair on code, a near copy
MAX_DRAFT = ControllerSettings().k_max  # the longest draft `--k auto` considers
TARGET_ROWS = (1, 2, 4, 8)  # timed for every model: a verify pass of k + 1 rows is interpolated from them
# Speculation pays where it beats plain decoding by the margin `--k auto` asks of it before it drafts.
PAYS = 1.0 + ControllerSettings().min_gain
PLAIN_IS_BETTER = "plain decoding is the better default here"
TARGET_PROBE = (f"whole forwards summed over {' + '.join(map(str, PROBE_ROWS))} rows, estimated from the model's "
                f"first {PROBE_SHARE:.0%} of layers and its output head")  # how target_format times the candidates
WEIGHT_ONLY = ("int8", "int4")  # bfloat16 activations only (Transformer._check_format)
NO_ONEDNN_INT8 = "this torch build has no oneDNN int8 linear (not an x86-64 CPU build)"

DISTURBED = 0.8  # a forward over more tokens timed below this fraction of one over fewer: the timing was disturbed

Progress = Callable[[str, int, int], None]  # (what is being done, steps done, steps in all)


def diagnose(
    target: str = DEFAULT_TARGET,
    draft: str | None = None,
    formats: Iterable[str] | None = None,
    rows: tuple[int, ...] = DEFAULT_ROWS,
    rounds: int = DEFAULT_ROUNDS,
    context: int = DEFAULT_CONTEXT,
    progress: Progress | None = None,
) -> dict:
    """The machine, the formats that run on it, the choices `auto` makes, measured forward costs and the expectation.

    draft: a draft model, or a draft head ("head": the one `make head` built; or a head file), whose matmuls run in
    the target's format, so it has no format to choose; default: what `verispec serve` drafts with (the target's
    head where one is built, else its catalog draft model, else the default target's).
    formats: weight formats to time (default: every candidate); the chosen ones are always timed, since the
    expectation needs them. rows: new tokens per timed forward, besides TARGET_ROWS (which the expectation
    needs). The target formats are timed together, then the drafts together with the chosen target, so the
    draft/target cost ratio comes from one set of rounds and only one target stays loaded beside the drafts.
    progress(what, done, total) is called as loads and timing rounds finish.
    """
    dtype = resolve_dtype("auto")
    draft = draft_or_default(target, draft)
    resolve_model(target)  # a model that is missing fails now, not after the timing (the draft's is read below)
    head = head_file(draft, target) if is_head_spec(draft) else None  # a missing head fails now too
    build_kernel("auto", progress=False)  # where w4a8 can run, build it now: whether it did decides the candidates
    target_choice = resolve_target_format(target)  # auto times whole forwards of the target (once per machine)
    if head is None:
        chosen_draft = load_model(draft, "auto")  # auto times whole forwards of the draft (once per machine)
        draft_choice = quantize_draft(chosen_draft, "auto", dtype_asked=False)
        draft_formats = _to_time(draft_choice, _draft_weight_formats(dtype), formats)
    else:
        draft_formats = (HEAD_DRAFT,)
    target_formats = _to_time(target_choice, _weight_formats(auto_candidates()), formats)
    timed_rows = tuple(sorted(set(rows) | set(TARGET_ROWS)))
    steps = _Steps(progress, len(target_formats) + len(draft_formats) + 2 * (WARMUP_ROUNDS + rounds))

    targets = _load_targets(target, target_formats, target_choice, steps)
    steps.describe("timing the target formats")
    target_costs = forward_costs(targets, timed_rows, context, rounds, on_round=steps.on_round)
    reference = targets[target_choice.label]
    del targets  # only the chosen target stays loaded beside the drafts
    gc.collect()

    if head is None:
        drafts = _load_drafts(draft, draft_formats, draft_choice, chosen_draft, steps)
        same_vocabulary = reference.tokenizer.get_vocab() == next(iter(drafts.values())).tokenizer.get_vocab()
        draft_label = draft_choice.label
        draft_summary = _choice_summary(draft, draft_choice, "whole one-row forwards of the draft in each format")
    else:
        steps.describe(f"loading the draft head {head}")
        drafts = {HEAD_DRAFT: HeadForwarding(load_head(str(head), reference), reference.model.vocab_size)}
        steps.advance()
        same_vocabulary, draft_label = True, HEAD_DRAFT
        draft_summary = {"model": f"draft head {head}", "format": f"the target's ({target_choice.label})",
                         "why": "a draft head runs its matmuls in the target's weight format", "seconds": {}}
    steps.describe("timing the drafts beside the chosen target")
    beside = forward_costs({"target": reference} | {f"draft {label}": m for label, m in drafts.items()},
                           timed_rows, context, rounds, on_round=steps.on_round)

    return {
        "machine": machine_facts(dtype),
        "formats": format_availability(dtype),
        "choices": {
            "dtype": _dtype_choice(dtype),
            "target": _choice_summary(target, target_choice, TARGET_PROBE),
            "draft": draft_summary,
            "remembered_file": str(cache_root() / FORMAT_CHOICES_FILE),
            "remembered": remembered_on_this_machine(),
        },
        "costs": {
            "context": context,
            "rounds": rounds,
            "rows": list(timed_rows),
            "target": target_costs,
            "draft": {label: beside[f"draft {label}"] for label in drafts},
            "target_beside_drafts": {target_choice.label: beside["target"]},
            "warnings": timing_warnings(
                {f"target {label}": seconds for label, seconds in target_costs.items()}
                | {f"draft {label}": beside[f"draft {label}"] for label in drafts}
                | {f"target {target_choice.label} (beside the drafts)": beside["target"]}
            ),
        },
        "expectation": {
            "target_format": target_choice.label,
            "draft_format": draft_label,
            "same_vocabulary": same_vocabulary,
            **expected_speedup(beside["target"], beside[f"draft {draft_label}"][1]),
        },
    }


def machine_facts(dtype: torch.dtype) -> dict:
    """CPU model, family/model, kind, cores, memory, the ISA features the kernels care about, software versions."""
    flags = cpu_flags()
    isa = {feature: feature in flags for feature in ISA_FEATURES if feature != "amx"}
    isa["amx"] = any(flag.startswith("amx") for flag in flags)
    return {
        **machine_description(), "kind": machine_kind(), "isa": isa, "verispec_commit": git_commit(),
        "dtype": _dtype_name(dtype),
    }


def format_availability(dtype: torch.dtype) -> dict[str, dict]:
    """Per weight format: whether it runs here in `dtype`, why not, and whether `auto` times it (target, draft)."""
    target_timed = _weight_formats(auto_candidates())
    draft_timed = _draft_weight_formats(dtype)
    table = {}
    for weight_format in FORMATS:
        why_not = _why_not(weight_format, dtype)
        table[weight_format] = {
            "runs": why_not is None, "why_not": why_not,
            "target_candidate": weight_format in target_timed, "draft_candidate": weight_format in draft_timed,
        }
    return table


def remembered_on_this_machine() -> list[dict]:
    """The choices format-choices.json keeps for this CPU, core count and torch: kind, chosen format, seconds,
    and whether this process loaded by it (in force)."""
    in_force = consulted_kinds()
    return [
        {"kind": kind, "choice": _remembered_label(kind, kept), "seconds": kept.get("seconds") or _step_costs(kept),
         "in_force": kind in in_force}
        for kind, kept in sorted(remembered_choices().items())
    ]


def _step_costs(kept: dict) -> dict[str, float]:
    """A remembered step_costs entry's timings (verify passes by tokens, a draft position), else nothing."""
    seconds = {f"verify {tokens}": s for tokens, s in (kept.get("verify") or {}).items()}
    return seconds | ({"draft": kept["draft"]} if kept.get("draft") else {})


def timing_warnings(costs: Mapping[str, Mapping[int, float]]) -> list[str]:
    """Where a forward over more tokens timed clearly faster than one over fewer, which it does not on a quiet
    machine: something else was using the cores (on a machine whose every core torch uses, another process
    slows its threads' barriers many times over), and those timings are not to be trusted."""
    warnings = []
    for name, by_rows in costs.items():
        for fewer, more in pairwise(sorted(by_rows)):
            if by_rows[more] < DISTURBED * by_rows[fewer]:
                warnings.append(
                    f"{name}: {more} tokens timed faster than {fewer} ({1000 * by_rows[more]:.1f} vs "
                    f"{1000 * by_rows[fewer]:.1f} ms); something else was likely using the cores: run again when idle"
                )
                break
    return warnings


def speculative_speedup(alpha: float, k: int, target_seconds: Mapping[int, float], draft_seconds: float) -> float:
    """Tokens per second of speculation with k drafts over plain decoding's.

    A step drafts k tokens (k one-row draft forwards) and verifies them in one target forward of k + 1 rows;
    with each draft accepted with chance alpha given the ones before were, it yields
    E = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha) tokens. Plain decoding yields one token per
    one-row target forward. target_seconds: forward cost by row count, interpolated between measured ones.
    """
    tokens = float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    step = interpolate(dict(target_seconds), k + 1) + k * draft_seconds
    return tokens * target_seconds[1] / step


def expected_speedup(
    target_seconds: Mapping[int, float],
    draft_seconds: float,
    acceptance_rates: tuple[float, ...] = ACCEPTANCE_RATES,
    max_draft: int = MAX_DRAFT,
) -> dict:
    """For each acceptance rate, the draft length k in 1..max_draft with the best speculative_speedup, and a verdict.

    target_seconds must hold the one-row cost (plain decoding's); draft_seconds is one one-row draft forward.
    """
    by_acceptance = []
    for alpha in acceptance_rates:
        speedups = {k: speculative_speedup(alpha, k, target_seconds, draft_seconds) for k in range(1, max_draft + 1)}
        best = max(speedups, key=speedups.get)
        by_acceptance.append({"acceptance": alpha, "best_k": best, "speedup": speedups[best],
                              "pays": speedups[best] >= PAYS})
    low = min(row["speedup"] for row in by_acceptance)
    high = max(row["speedup"] for row in by_acceptance)
    paying = [row["acceptance"] for row in by_acceptance if row["pays"]]
    rates = f"acceptance {acceptance_rates[0]:g} to {acceptance_rates[-1]:g}"
    if len(paying) == len(by_acceptance):
        verdict = f"speculation is expected to pay: {low:.2f}x to {high:.2f}x plain decoding's speed for {rates}"
    elif paying:
        verdict = (f"speculation is expected to pay only where drafts are accepted at least {min(paying):g} of the "
                   f"time (up to {high:.2f}x); below that, plain decoding is faster")
    else:
        verdict = (f"speculation is not expected to pay (at most {high:.2f}x plain decoding's speed for {rates}): "
                   f"{PLAIN_IS_BETTER}")
    return {"by_acceptance": by_acceptance, "range": [low, high], "pays": bool(paying), "verdict": verdict}


def _load_targets(
    name: str, weight_formats: tuple[str, ...], choice: FormatChoice, steps: _Steps
) -> dict[str, LoadedModel]:
    """The target in each weight format, by label; the chosen one loaded with "auto", as the commands load it."""
    targets = {}
    for weight_format in weight_formats:
        steps.describe(f"loading {name} ({weight_format})")
        loaded = load_model(name, "auto", quantize="auto" if weight_format == choice.weight_format else weight_format)
        targets[loaded.format.choice.label] = loaded
        steps.advance()
    return targets


def _load_drafts(
    name: str, weight_formats: tuple[str, ...], choice: FormatChoice, chosen: LoadedModel, steps: _Steps
) -> dict[str, LoadedModel]:
    """The draft in each weight format, by label, quantized as load_draft_model does (`chosen`: what auto chose)."""
    drafts = {}
    for weight_format in weight_formats:
        steps.describe(f"loading {name} ({weight_format})")
        if weight_format == choice.weight_format:
            drafts[choice.label] = chosen
        else:
            loaded = load_model(name, "auto")
            drafts[quantize_draft(loaded, weight_format, dtype_asked=False).label] = loaded
        steps.advance()
    return drafts


class _Steps:
    """Counts the steps of a diagnosis (loads, timing rounds) for a progress callback."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress, self.total, self.done, self.what = progress, total, 0, ""

    def describe(self, what: str) -> None:
        self.what = what
        self._report()

    def advance(self) -> None:
        self.done += 1
        self._report()

    def on_round(self, _done: int, _total: int) -> None:
        self.advance()

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(self.what, self.done, self.total)


def _to_time(choice: FormatChoice, candidates: tuple[str, ...], asked: Iterable[str] | None) -> tuple[str, ...]:
    """The chosen weight format first, then the candidates (those asked for, where `asked` is given)."""
    if asked is not None:
        asked = tuple(asked)
        unknown = [f for f in asked if f not in FORMATS]
        if unknown:
            raise ValueError(f"format {unknown[0]!r} is not one of {', '.join(FORMATS)}")
        candidates = tuple(f for f in candidates if f in asked)
    return tuple(dict.fromkeys((choice.weight_format, *candidates)))


def _weight_formats(candidates: tuple[str, ...]) -> tuple[str, ...]:
    """("w4a8", "w8a8-s8", "w8a8-u8", "none") -> ("w4a8", "w8a8", "none"): loading picks the activations."""
    return tuple(dict.fromkeys(candidate.partition("-")[0] for candidate in candidates))


def _draft_weight_formats(dtype: torch.dtype) -> tuple[str, ...]:
    """What a draft's `auto` times here that can run in `dtype`, and dense."""
    timed = _weight_formats(draft_candidates("auto", dtype, dtype_asked=False))
    return tuple(f for f in timed if _why_not(f, dtype) is None) + ("none",)


def _why_not(weight_format: str, dtype: torch.dtype) -> str | None:
    if weight_format == "w4a8":
        return w4a8.unavailable_reason()
    if weight_format == "w8a8" and not w8a8_available():
        return W8A8_INEXACT if onednn_int8_runs() else NO_ONEDNN_INT8
    if weight_format in WEIGHT_ONLY and dtype != torch.bfloat16:
        return (f"weight-only: needs bfloat16 activations, and `--dtype auto` is {_dtype_name(dtype)} here "
                "(no bfloat16 dot products)")
    return None


def _dtype_choice(dtype: torch.dtype) -> dict:
    why = ("this CPU has bfloat16 dot products (AVX-512 BF16 or AMX)" if dtype == torch.bfloat16
           else "this CPU lacks bfloat16 dot products (AVX-512 BF16, AMX), where bfloat16 would be slower")
    return {"format": _dtype_name(dtype), "why": why}


def _choice_summary(model: str, choice: FormatChoice, timed_on: str) -> dict:
    """The format `auto` chose for a model and why: the timings behind it (w4a8 adds its prefill's)."""
    seconds = choice.seconds or {}
    long_passes = {name: s for name, s in seconds.items() if name.startswith("w4a8-")}  # see w4a8_choice
    candidates = {name: s for name, s in seconds.items() if name not in long_passes}
    why = f"the fastest of {milliseconds(candidates)} ({timed_on})" if candidates else "nothing else to time here"
    if long_passes and choice.weight_format == "w4a8":
        runner = "the 4-bit kernel" if choice.activations == "kernel" else f"oneDNN on int8 ({choice.activations})"
        why += (f"; its prefill passes run {runner}, the fastest of {milliseconds(long_passes)} at "
                f"{W4A8_LONG_PASS_ROWS} rows")
    return {"model": model, "format": choice.label, "why": why, "seconds": seconds}


def milliseconds(seconds: Mapping[str, float]) -> str:
    """{"w4a8": 0.00825, "none": 0.0601} -> "w4a8 8.25 ms, none 60.1 ms", fastest first."""
    return ", ".join(f"{name} {1000 * s:.3g} ms" for name, s in sorted(seconds.items(), key=lambda item: item[1]))


def _remembered_label(kind: str, kept: dict) -> str:
    """The format a remembered choice names: targets and drafts keep "format" (older drafts "best"), with the
    candidates found too slow to time; w4a8's long passes "activations" alone."""
    if "verify" in kept:  # step_costs: a step's parts timed before the first request, nothing chosen
        return "timed, no choice"
    if "best" in kept or "format" in kept:
        named = kept.get("format", kept.get("best"))
        if named is None:
            return "nothing ran"
        label = FormatChoice(named, kept.get("activations", "s8")).label
        return label + (f" ({', '.join(kept['too_slow'])} too slow)" if kept.get("too_slow") else "")
    if kind.startswith("w4a8") and "activations" in kept:
        return FormatChoice("w4a8", kept["activations"]).label
    return "?"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
