"""Plain decoding against the defaults (the suffix index, then the shipped head) through the server's scheduler at a
fixed number of clients, one target loaded once and the two taking turns round after round (ABBA order), so that a
shared machine's drift hits both alike: per-round tokens per second, their ratios and medians, and what the steps
did (their records: rows decoding, prompt chunks).

    .venv/bin/python benchmarks/scripts/interleaved_ab.py --clients 16 --workload long-documents --rounds 4

With --p-min P the two are the defaults and the defaults with `--draft-p-min P` (benchmarks/results/zen4/draft-p-min).
With --torch-head-attention they are the defaults whose head attends in torch's masked attention (as before
verispec's attention kernel took the head's, benchmarks/results/zen4/head-attention) and the defaults. With --top-p P
every request samples (temperature 0.7, top-p P, its own seed) and the two are top-p over the whole vocabulary sorted
(as before sampling.TOP_P_CANDIDATES) and top-p as it runs now, both plain or both the defaults (--top-p-with); they
keep the same tokens, so plain's outputs must be equal (the defaults' k follows timing, and sampled outputs with it).

A closed loop, as `verispec bench-serve` runs: `clients` requests go in at once and each one that finishes is
followed by the next, until every prompt ran `repeat` times; greedy, 128 new tokens; chunked prefill, as `verispec
serve` does; synchronous, no HTTP. A fresh scheduler each round: the controller learns from nothing, as a fresh
server does. Every defaults output is checked against plain's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from verispec import GenerationConfig, sampling
from verispec.bench.workloads import load_workload, render_prompt
from verispec.core import StepRecord
from verispec.drafters import HEAD_DRAFT, draft_head, load_head
from verispec.models.loading import load_model
from verispec.sampling import SamplingParams
from verispec.serving.scheduler import Scheduler, SchedulerLimits

TARGET = "qwen2.5-coder-1.5b-instruct"
WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"


class Arm(NamedTuple):
    """One of the two decodings compared."""

    name: str
    drafting: bool  # the defaults (composite drafter, the head), else plain decoding
    p_min: float = 0.0  # --draft-p-min
    head_kernel: bool = True  # the head attends in verispec's kernel where it runs
    top_p_candidates: int = sampling.TOP_P_CANDIDATES  # top-p ranks this many first (10**9: the whole sort)


def closed_loop(
    target, head, prompts: list[list[int]], clients: int, defaults: bool, p_min: float = 0.0, top_p: float | None = None
) -> tuple[float, list, str]:
    """(tokens per second, each request's tokens, what the steps did) of one run: greedy, or with top_p sampled."""
    scheduler = Scheduler(
        target, draft_model=head if defaults else None, drafter="composite" if defaults else "none", k="auto",
        limits=SchedulerLimits(max_batch_size=clients, max_context=2048), chunked_prefill=True, synchronous=True,
        draft_p_min=p_min,
    )
    steps: list[StepRecord] = []
    scheduler.step_observers.append(steps.append)
    waiting = list(prompts)
    sampled = SamplingParams(temperature=0.7, top_p=top_p) if top_p is not None else SamplingParams()

    def submit() -> None:  # the next prompt, with its own seed: the same draws in every run
        config = GenerationConfig(max_new_tokens=128, sampling=sampled, seed=len(handles))
        handles.append(scheduler.submit(waiting.pop(0), config))

    handles = []
    for _ in range(min(clients, len(waiting))):
        submit()
    started = time.perf_counter()
    while True:
        busy = scheduler.run_once()
        while waiting and scheduler.num_active + scheduler.num_waiting < clients:
            submit()
        if not busy and not waiting and not scheduler.num_active + scheduler.num_waiting:  # all submitted ran
            break
    seconds = time.perf_counter() - started
    outputs = [[token for event in handle.iter_events() for token in event.token_ids] for handle in handles]
    chunks = [step.chunk_tokens for step in steps if step.chunk_tokens]
    rows = statistics.mean(len(step.rows) for step in steps) if steps else 0.0
    # Steps that drafted nowhere and carried no prompt, at the full batch: what they cost beyond their forward.
    plain_steps = [step for step in steps if not step.chunk_tokens and len(step.rows) == clients
                   and not any(row.drafted for row in step.rows)]
    beyond = (f"; {len(plain_steps)} full non-drafting steps: forward p50 "
              f"{statistics.median(s.forward_seconds for s in plain_steps) * 1e3:.1f} ms, beyond it p50 "
              f"{statistics.median(s.seconds - s.forward_seconds for s in plain_steps) * 1e3:.2f} ms"
              if plain_steps else "")
    drafting_steps = [step for step in steps if any(row.drafted for row in step.rows)]
    drafted = [row for step in drafting_steps for row in step.rows if row.drafted]
    by_head = sum(row.source == "draft-head" for row in drafted)
    drafts = (f"; drafting rows: {statistics.mean(r.drafted for r in drafted):.2f} drafted, "
              f"{statistics.mean(r.accepted for r in drafted):.2f} accepted ({by_head} by the head); drafting steps: "
              f"draft p50 {statistics.median(sum(s.draft_seconds.values()) for s in drafting_steps) * 1e3:.1f} ms, "
              f"forward p50 {statistics.median(s.forward_seconds for s in drafting_steps) * 1e3:.1f} ms"
              if drafted else "")
    what = (f"{len(steps)} steps ({len(drafting_steps)} drafting), {rows:.1f} rows on average, {len(chunks)} "
            f"prompt chunks (median {statistics.median(chunks) if chunks else 0} tokens){beyond}{drafts}")
    return sum(map(len, outputs)) / seconds, outputs, what


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, required=True)
    parser.add_argument("--workload", default="humaneval",
                        help="humaneval, chat, or a JSONL file's stem in benchmarks/workloads")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--limit", type=int, default=None, help="prompts of the workload (default: all)")
    parser.add_argument("--repeat", type=int, default=2, help="requests per prompt (a served run's 32 of 16)")
    parser.add_argument("--p-min", type=float, default=None,
                        help="compare the defaults with the defaults at this --draft-p-min, not plain with the defaults")
    parser.add_argument("--torch-head-attention", action="store_true",
                        help="compare the defaults whose head attends in torch with the defaults")
    parser.add_argument("--top-p", type=float, default=None,
                        help="sampled at this top-p: compare top-p over the whole sorted vocabulary with top-p now")
    parser.add_argument("--top-p-with", choices=("plain", "defaults"), default="defaults",
                        help="with --top-p: the decoding both arms run")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_model(TARGET, "auto", False, "auto")
    head = load_head(HEAD_DRAFT, target)
    source = args.workload if args.workload in ("humaneval", "chat") else str(WORKLOADS / f"{args.workload}.jsonl")
    items = load_workload(source, args.limit)
    prompts = [target.encode(render_prompt(target.tokenizer, item)) for item in items] * args.repeat
    # The baseline, then the one measured against it.
    arms = [Arm("plain", False), Arm("defaults", True)]
    if args.p_min is not None:
        arms = [Arm("defaults", True), Arm(f"defaults at p-min {args.p_min}", True, p_min=args.p_min)]
    if args.torch_head_attention:
        arms = [Arm("defaults, head attention in torch", True, head_kernel=False), Arm("defaults", True)]
    if args.top_p is not None:
        drafting = args.top_p_with == "defaults"
        arms = [Arm(f"{args.top_p_with}, top-p by a whole sort", drafting, top_p_candidates=10**9),
                Arm(f"{args.top_p_with}, top-p now", drafting)]
    compared_as_sampled_defaults = args.top_p is not None and args.top_p_with == "defaults"
    kernel_runs = draft_head.attention_kernel_runs
    figures: dict[str, list[float]] = {name: [] for name, *_ in arms}
    first_outputs = None
    for round_ in range(args.rounds):
        for name, drafting, p_min, head_kernel, top_p_candidates in (arms if round_ % 2 == 0 else arms[::-1]):
            draft_head.attention_kernel_runs = kernel_runs if head_kernel else lambda head_dim, dtype: False
            sampling.TOP_P_CANDIDATES = top_p_candidates
            rate, outputs, what = closed_loop(target, head, prompts, args.clients, drafting, p_min, args.top_p)
            figures[name].append(rate)
            print(f"round {round_} {name}: {rate:.2f} tok/s; {what}", flush=True)
            first_outputs = first_outputs or outputs
            if outputs != first_outputs and not compared_as_sampled_defaults:
                raise SystemExit(f"round {round_}: {name}'s outputs differ from the other's (greedy: both plain's; "
                                 "sampled: the same draws from the same distributions)")
    (base, *_), (other, *_) = arms
    ratios = [b / a for a, b in zip(figures[base], figures[other])]
    print(f"{args.workload}, {args.clients} clients: {base} {statistics.median(figures[base]):.2f} tok/s, {other} "
          f"{statistics.median(figures[other]):.2f}; ratios {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f}; outputs "
          f"{'not compared (sampled, k chosen by timing)' if compared_as_sampled_defaults else 'equal'}")


if __name__ == "__main__":
    main()
