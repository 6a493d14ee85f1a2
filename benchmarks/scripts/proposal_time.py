"""Proposal time against context length: prompt lookup (rescans) vs the suffix index (incremental).

Run: .venv/bin/python benchmarks/scripts/proposal_time.py > benchmarks/results/KIND/proposal-time/README.md
"""

from __future__ import annotations

import statistics
import time

import torch

from verispec.drafters import PromptLookupDrafter, SuffixIndexDrafter
from verispec.sampling import SamplingParams

STEPS = 200


def time_per_proposal(drafter, context: list[int], stream: list[int]) -> float:
    """Median seconds per propose() while the text grows by one token per step."""
    drafter.begin(context, len(context) + STEPS + 16)
    tokens = list(context)
    drafter.propose(tokens, 5, SamplingParams(), None)  # index the context (not timed: it happens at prefill)
    times = []
    for token in stream:
        tokens.append(token)
        started = time.perf_counter()
        drafter.propose(tokens, 5, SamplingParams(), None)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(2)
    generator = torch.Generator().manual_seed(0)
    print("| context tokens | prompt lookup (ms / proposal) | suffix index (ms / proposal) |")
    print("|---|---|---|")
    for length in (1_000, 4_000, 16_000, 64_000):
        # Text with repeats (a 50-token motif every 500 tokens), like code with recurring lines.
        text = torch.randint(0, 5000, (length + STEPS,), generator=generator)
        motif = text[:50].clone()
        for start in range(500, length + STEPS - 50, 500):
            text[start:start + 50] = motif
        context, stream = text[:length].tolist(), text[length:].tolist()
        lookup = time_per_proposal(PromptLookupDrafter(), context, stream)
        suffix = time_per_proposal(SuffixIndexDrafter(), context, stream)
        print(f"| {length:,} | {lookup * 1000:.3f} | {suffix * 1000:.3f} |")


if __name__ == "__main__":
    main()
