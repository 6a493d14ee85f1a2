"""Run every mode on every prompt, interleaved, and turn the raw runs into summary figures."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from verispec.bench.modes import Run
from verispec.engine import GenerationConfig


@dataclass
class PromptRuns:
    prompt_id: str
    prompt_tokens: int
    runs: dict[str, Run]  # mode name -> run


def run_all(
    modes: list,
    prompts: list[dict],
    config: GenerationConfig,
    render: Callable[[dict], str],
    count_tokens: Callable[[str], int],
    on_run: Callable[[str, str], None] | None = None,
) -> list[PromptRuns]:
    """Each prompt through every mode; the mode order rotates per prompt so drift hits all alike.

    A prompt's "json_schema" goes into its config (modes that run free drop it).
    """
    results = []
    for index, prompt in enumerate(prompts):
        text = render(prompt)
        prompt_config = replace(config, json_schema=prompt.get("json_schema"))
        shift = index % len(modes)
        runs = {}
        for mode in modes[shift:] + modes[:shift]:
            runs[mode.name] = mode.run(text, prompt_config)
            if on_run is not None:
                on_run(prompt["id"], mode.name)
        results.append(PromptRuns(prompt["id"], count_tokens(text), {m.name: runs[m.name] for m in modes}))
    return results


def bootstrap_ci(values: list[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the geometric mean of per-prompt ratios."""
    logs = np.log(np.asarray(values, dtype=np.float64))
    if len(logs) < 2:
        return float(np.exp(logs.mean())), float(np.exp(logs.mean()))
    rng = np.random.default_rng(seed)
    means = rng.choice(logs, size=(rounds, len(logs)), replace=True).mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(np.exp(low)), float(np.exp(high))


def summarize_mode(results: list[PromptRuns], mode: str, baseline: str, greedy: bool) -> dict:
    runs = [r.runs[mode] for r in results]
    base = [r.runs[baseline] for r in results]
    ratios = [run.tokens_per_second / b.tokens_per_second for run, b in zip(runs, base)]
    latencies = [gap for run in runs for gap in run.inter_token_latencies]
    total_tokens = sum(len(run.token_ids) for run in runs)
    summary = {
        "mode": mode,
        "prompts": len(runs),
        "tokens_per_second": total_tokens / sum(run.seconds for run in runs),
        "tokens_per_second_median": statistics.median(run.tokens_per_second for run in runs),
        "decode_tokens_per_second_median": statistics.median(run.decode_tokens_per_second for run in runs),
        "ttft_median": statistics.median(run.ttft for run in runs),
        "latency_p50": float(np.percentile(latencies, 50)) if latencies else 0.0,
        "latency_p95": float(np.percentile(latencies, 95)) if latencies else 0.0,
        "speedup_geomean": float(np.exp(np.mean(np.log(ratios)))),
        "speedup_median": statistics.median(ratios),
        "speedup_ci95": bootstrap_ci(ratios),
        "identical_to_baseline": (
            sum(run.token_ids == b.token_ids for run, b in zip(runs, base)) / len(runs) if greedy else None
        ),
    }
    stats = [run.stats for run in runs if run.stats]
    if stats:
        drafted = sum(s["drafted_tokens"] for s in stats)
        accepted = sum(s["accepted_tokens"] for s in stats)
        forwards = sum(s["target_forwards"] for s in stats)
        width = max((len(s["drafted_by_position"]) for s in stats), default=0)
        by_position = []
        for i in range(width):
            d = sum(s["drafted_by_position"][i] for s in stats if i < len(s["drafted_by_position"]))
            a = sum(s["accepted_by_position"][i] for s in stats if i < len(s["accepted_by_position"]))
            by_position.append(a / d if d else 0.0)
        histogram: dict[int, int] = {}
        for s in stats:
            for k, steps in s["k_histogram"].items():
                histogram[int(k)] = histogram.get(int(k), 0) + steps
        estimates = [s["counterfactual_speedup"] for s in stats if s.get("counterfactual_speedup")]
        summary.update(
            k_histogram=dict(sorted(histogram.items())),
            counterfactual_speedup_median=statistics.median(estimates) if estimates else None,
            acceptance_rate=accepted / drafted if drafted else None,
            mean_tokens_per_target_forward=sum(s["new_tokens"] for s in stats) / forwards if forwards else None,
            acceptance_by_position=by_position,
            draft_seconds=sum(s["draft_seconds"] for s in stats),
            verify_seconds=sum(s["verify_seconds"] for s in stats),
        )
    return summary
