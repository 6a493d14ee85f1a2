"""What one draft position of the shipped head costs (one new token per row after `context` cached ones) with its
attention in verispec's kernel and in torch's masked attention, the two taking turns round after round:

    .venv/bin/python benchmarks/scripts/head_position.py --rows 1,4,16 --contexts 256,700,1500

A markdown table of medians (ms) on stdout; the target in its chosen format, as `verispec serve` loads it. Where the
kernel does not run here (no AVX-512), both columns are torch's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec.drafters import HEAD_DRAFT, draft_head, load_head
from verispec.models.loading import load_model

TARGET = "qwen2.5-coder-1.5b-instruct"


def torch_attention(head_dim: int, dtype: torch.dtype) -> bool:
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--contexts", default="256,700,1500")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_model(TARGET, "auto", False, "auto")
    forwarding = draft_head.HeadForwarding(load_head(HEAD_DRAFT, target), target.model.vocab_size)
    arms = {"torch": torch_attention, "kernel": draft_head.attention_kernel_runs}
    print("| rows | cached tokens | torch attention (ms) | verispec's kernel (ms) | torch / kernel |")
    print("|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        for context in map(int, args.contexts.split(",")):
            cache = forwarding.new_cache(rows, context + 8)
            cache.commit(context)  # zero keys cost what real ones do to attend over
            ids = torch.randint(0, 1000, (rows, 1))
            samples: dict[str, list[float]] = {name: [] for name in arms}
            for round_ in range(args.rounds + 1):
                for name in (list(arms) if round_ % 2 == 0 else list(arms)[::-1]):
                    draft_head.attention_kernel_runs = arms[name]
                    started = time.perf_counter()
                    forwarding.forward(ids, cache, last_only=True)
                    if round_:  # the first round warms up
                        samples[name].append(time.perf_counter() - started)
            draft_head.attention_kernel_runs = arms["kernel"]
            slow, fast = (statistics.median(samples[name]) * 1e3 for name in arms)
            print(f"| {rows} | {context} | {slow:.2f} | {fast:.2f} | {slow / fast:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
