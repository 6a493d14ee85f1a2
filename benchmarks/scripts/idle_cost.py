"""What a step costs where speculation does not pay: --rows prompts of a workload at once through the server's
scheduler, plain (drafter none) against the defaults' drafter (composite: the suffix index, then the draft head) at
k = 0 (drafting nothing: the drafter's own upkeep) and at k auto (what a server does). Rounds interleaved, the first
dropped, medians; one JSON line per config on stdout.

    .venv/bin/python benchmarks/scripts/idle_cost.py --workload chat --rows 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from verispec.bench.machine import machine_line
from verispec.bench.workloads import load_workload, render_prompt
from verispec.core.requests import SchedulerLimits
from verispec.engine import GenerationConfig
from verispec.models.catalog import DEFAULT_TARGET
from verispec.serving.scheduler import build_scheduler


def run(scheduler, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int, int]:
    """(seconds, steps, tokens) of the prompts decoded together, greedy."""
    handles = [scheduler.submit(p, GenerationConfig(max_new_tokens=max_new_tokens)) for p in prompts]
    started, steps = time.perf_counter(), 0
    while scheduler.run_once():
        steps += 1
    seconds = time.perf_counter() - started
    return seconds, steps, sum(len(event.token_ids or []) for h in handles for event in h.iter_events())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=4, help="the first is dropped (warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft", default="head", help="the draft head: the shipped one, or a head file")
    args = parser.parse_args()
    if args.rows < 1 or args.rounds < 2:
        parser.error("--rows must be >= 1 and --rounds >= 2 (the first round is dropped)")
    torch.set_num_threads(args.threads)
    limits = SchedulerLimits(max(16, args.rows), 64, 2048)
    schedulers = {
        "plain": build_scheduler(DEFAULT_TARGET, None, "none", k=0, limits=limits),
        "defaults' drafter, k = 0": build_scheduler(DEFAULT_TARGET, args.draft, "composite", k=0, limits=limits),
        "defaults' drafter, k auto": build_scheduler(DEFAULT_TARGET, args.draft, "composite", k="auto",
                                                      limits=limits),
    }
    target = schedulers["plain"].target
    prompts = [target.encode(render_prompt(target.tokenizer, item))
               for item in load_workload(args.workload)[: args.rows]]
    runs: dict[str, list[tuple[float, int, int]]] = {name: [] for name in schedulers}
    for round_ in range(args.rounds):
        for name, scheduler in schedulers.items():
            measured = run(scheduler, prompts, args.max_new_tokens)
            if round_:
                runs[name].append(measured)
    plain = statistics.median(seconds for seconds, _, _ in runs["plain"])
    for name, measured in runs.items():
        seconds = statistics.median(s for s, _, _ in measured)
        steps, tokens = measured[-1][1], measured[-1][2]
        print(json.dumps({"config": name, "seconds": round(seconds, 3), "x_plain": round(plain / seconds, 3),
                          "steps": steps, "tokens": tokens, "ms_per_step": round(1e3 * seconds / steps, 1),
                          "workload": args.workload, "rows": args.rows, "draft": args.draft,
                          "machine": machine_line()}))


if __name__ == "__main__":
    main()
