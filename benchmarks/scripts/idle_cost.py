"""What a step costs where speculation does not pay: --rows prompts of a workload at once through the server's
scheduler, plain (drafter none) against the defaults' drafter (composite: the suffix index, then the draft head) at
k = 0 (drafting nothing: the drafter's own upkeep) and at k auto (what a server does). Rounds interleaved, the first
dropped, medians; one JSON line per config on stdout. --detail: then one more line, what k auto's controller believed
at the end (each source's acceptance by position and draft cost, the verify forwards, the expected rate of each k at
this batch size) beside what its last round's requests saw (drafted and accepted by position, k and drafter by step).

    .venv/bin/python benchmarks/scripts/idle_cost.py --workload chat --rows 4 [--detail]
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


def run(scheduler, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int, int, list]:
    """(seconds, steps, tokens, each request's final stats) of the prompts decoded together, greedy."""
    handles = [scheduler.submit(p, GenerationConfig(max_new_tokens=max_new_tokens)) for p in prompts]
    started, steps = time.perf_counter(), 0
    while scheduler.run_once():
        steps += 1
    seconds = time.perf_counter() - started
    events = [list(h.iter_events()) for h in handles]
    tokens = sum(len(event.token_ids or []) for request in events for event in request)
    return seconds, steps, tokens, [request[-1].stats for request in events]


def believed(controller, rows: int) -> dict:
    """What the controller's cost model holds now, and the expected tokens per second of each k at `rows` rows."""
    sources = {}
    for name, averages in controller.sources.items():
        rates = [controller.expected_rate(k, averages, rows) for k in range(controller.settings.k_max + 1)]
        sources[name] = {"acceptance": [round(a, 3) for a in averages.acceptance()],
                         "draft_ms_by_rows": {b: round(s * 1e3, 2) for b, s in sorted(averages.draft_cost.items())},
                         "overhead_ms": round(controller.overhead(name, rows) * 1e3, 2),
                         "expected_rate_by_k": [None if r is None else round(r, 2) for r in rates]}
    return {"verify_ms_by_tokens": {n: round(s * 1e3, 2) for n, s in sorted(controller.verify_cost.items())},
            "plain_overhead_ms": round(controller.overhead(None, rows) * 1e3, 2), "sources": sources,
            "chosen_k": dict(sorted(controller.chosen.items()))}


def seen(stats: list) -> dict:
    """The requests' speculation, summed: drafted and accepted by position, steps by k and by drafter."""
    summed: dict = {"drafted_by_position": [], "accepted_by_position": [], "k_histogram": {}, "steps_by_drafter": {}}
    for s in stats:
        for name in ("drafted_by_position", "accepted_by_position"):
            for i, n in enumerate(getattr(s, name)):
                summed[name] += [0] * (i + 1 - len(summed[name]))
                summed[name][i] += n
        for name in ("k_histogram", "steps_by_drafter"):
            for key, n in getattr(s, name).items():
                summed[name][key] = summed[name].get(key, 0) + n
    summed["target_forwards"] = sum(s.target_forwards for s in stats)
    summed["tokens_per_forward"] = round(sum(s.new_tokens for s in stats) / max(1, summed["target_forwards"]), 3)
    return summed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=4, help="the first is dropped (warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft", default="head", help="the draft head: the shipped one, or a head file")
    parser.add_argument("--detail", action="store_true", help="also what k auto's controller believed and saw")
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
    runs: dict[str, list[tuple[float, int, int, list]]] = {name: [] for name in schedulers}
    for round_ in range(args.rounds):
        for name, scheduler in schedulers.items():
            measured = run(scheduler, prompts, args.max_new_tokens)
            if round_:
                runs[name].append(measured)
    plain = statistics.median(measured[0] for measured in runs["plain"])
    for name, measured in runs.items():
        seconds = statistics.median(m[0] for m in measured)
        steps, tokens = measured[-1][1], measured[-1][2]
        print(json.dumps({"config": name, "seconds": round(seconds, 3), "x_plain": round(plain / seconds, 3),
                          "steps": steps, "tokens": tokens, "ms_per_step": round(1e3 * seconds / steps, 1),
                          "workload": args.workload, "rows": args.rows, "draft": args.draft,
                          "machine": machine_line()}))
    if args.detail:
        auto = "defaults' drafter, k auto"
        print(json.dumps({"config": auto, "believed": believed(schedulers[auto].controller, args.rows),
                          "last_round": seen(runs[auto][-1][3])}))


if __name__ == "__main__":
    main()
