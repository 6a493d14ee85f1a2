"""Plain decoding against the defaults (the suffix index, then the shipped head) through the server's scheduler at a
fixed number of rows, one target loaded once and the two taking turns round after round (ABBA order), so that a
shared machine's drift hits both alike: per-round tokens per second, their ratios and medians.

    .venv/bin/python benchmarks/scripts/interleaved_ab.py --rows 4 --workload chat --rounds 4

The requests go in at once (the first `rows` decode, the rest queue and are admitted as rows free up), greedy,
128 new tokens; synchronous, no HTTP. A fresh scheduler each round: the controller learns from nothing, as a fresh
server does.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from verispec import GenerationConfig
from verispec.bench.workloads import load_workload, render_prompt
from verispec.drafters import HEAD_DRAFT, load_head
from verispec.models.loading import load_model
from verispec.serving.scheduler import Scheduler, SchedulerLimits

TARGET = "qwen2.5-coder-1.5b-instruct"
WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"


def tokens_per_second(target, head, prompts: list[list[int]], rows: int, defaults: bool) -> float:
    scheduler = Scheduler(
        target, head if defaults else None, "composite" if defaults else "none", "auto", 8,
        SchedulerLimits(max_batch_size=rows, max_context=2048), None, target.model.batch_invariant, False, None,
    )
    scheduler.synchronous = True
    handles = [scheduler.submit(prompt, GenerationConfig(max_new_tokens=128)) for prompt in prompts]
    started = time.perf_counter()
    while scheduler.run_once():
        pass
    seconds = time.perf_counter() - started
    return sum(len(event.token_ids) for handle in handles for event in handle.iter_events()) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--workload", default="humaneval",
                        help="humaneval, chat, or a JSONL file's stem in benchmarks/workloads")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=None, help="default: twice the rows, at least 8")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_model(TARGET, "auto", False, "auto")
    head = load_head(HEAD_DRAFT, target)
    source = args.workload if args.workload in ("humaneval", "chat") else str(WORKLOADS / f"{args.workload}.jsonl")
    items = load_workload(source)[: args.requests or max(2 * args.rows, 8)]
    prompts = [target.encode(render_prompt(target.tokenizer, item)) for item in items]
    figures = {False: [], True: []}
    for round_ in range(args.rounds):
        for defaults in ((False, True) if round_ % 2 == 0 else (True, False)):
            figures[defaults].append(tokens_per_second(target, head, prompts, args.rows, defaults))
            name = "defaults" if defaults else "plain"
            print(f"round {round_} {name}: {figures[defaults][-1]:.2f} tok/s", flush=True)
    ratios = [d / p for d, p in zip(figures[True], figures[False])]
    print(f"{args.workload}, {args.rows} rows: plain {statistics.median(figures[False]):.2f} tok/s, defaults "
          f"{statistics.median(figures[True]):.2f}; ratios {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
