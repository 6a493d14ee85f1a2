"""What a step's parts cost on this machine, as verispec.replay reads them (benchmarks/results/<kind>/
controller-costs.json): target forwards by rows and width, a draft position of the draft model, the draft head and
the suffix index by rows, a draft model's and the head's catch-up per token, a step's overhead and a prompt's prefill
per token.

    .venv/bin/python benchmarks/scripts/controller_costs.py --out benchmarks/results/xeon/controller-costs-6-207.json

The models are the defaults' (`auto` formats, as chosen and remembered here; the shipped head). Forwards are timed
in interleaved rounds after CONTEXT tokens per row, medians kept; about five minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from verispec import GenerationConfig, SpeculativeEngine, load_model
from verispec.bench.machine import git_commit, machine_kind, machine_line
from verispec.drafters import HEAD_DRAFT, load_draft_model, make_drafter
from verispec.drafters.draft_head import HeadForwarding, load_head
from verispec.models.forward_cost import CATCH_UP_TOKENS, cost_token_ids
from verispec.sampling import SamplingParams

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
ROWS, WIDTHS, DRAFT_ROWS = (1, 4, 16), (1, 2, 3, 4, 5, 8, 9), (1, 4, 16)  # widths: k = 0-4, 7, 8 (and the seeds')
CONTEXT = 256


def timed(model, shapes: list[tuple[int, int]], rounds: int, label: str) -> dict[tuple[int, int], float]:
    """Median seconds of one forward of (rows, width) new tokens after CONTEXT tokens in each row, never committed."""
    caches = {}
    for rows in sorted({r for r, _ in shapes}):
        cache = model.new_cache(rows, CONTEXT + max(WIDTHS) + 1)
        model.forward(cost_token_ids(CONTEXT, model.vocab_size, 1000).expand(rows, -1), cache, last_only=True)
        cache.commit(CONTEXT)
        caches[rows] = cache
    seconds = {shape: [] for shape in shapes}
    for _ in tqdm(range(rounds + 1), desc=label):  # one warm-up round, not kept
        for rows, width in shapes:
            ids = cost_token_ids(width, model.vocab_size, 7).expand(rows, -1)
            started = time.perf_counter()
            model.forward(ids, caches[rows])
            seconds[(rows, width)].append(time.perf_counter() - started)
    return {shape: statistics.median(values[1:]) for shape, values in seconds.items()}


def catch_up_seconds(model, rounds: int) -> float:
    """Seconds per token of one row's catch-up: a forward over CATCH_UP_TOKENS tokens after CONTEXT, never committed."""
    cache = model.new_cache(1, CONTEXT + CATCH_UP_TOKENS)
    model.forward(cost_token_ids(CONTEXT, model.vocab_size, 1000), cache, last_only=True)
    cache.commit(CONTEXT)
    ids = cost_token_ids(CATCH_UP_TOKENS, model.vocab_size, 7)
    seconds = []
    for _ in range(rounds + 1):
        started = time.perf_counter()
        model.forward(ids, cache, last_only=True)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:]) / CATCH_UP_TOKENS


def suffix_seconds(target, rounds: int) -> float:
    """One suffix-index proposal of 8 tokens over a 512-token context that recurs (what a lookup costs a row)."""
    drafter = make_drafter("suffix-index", target)
    text, greedy = (list(range(100, 356)) * 2)[:512], SamplingParams()
    drafter.propose(text, 8, greedy, None)
    seconds = []
    for i in range(rounds * 10):
        text.append(100 + len(text) % 256)  # the text grows by a token a step, as a sequence does
        started = time.perf_counter()
        drafter.propose(text, 8, greedy, None)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def step_overhead(target, forward_one: float) -> float:
    """A plain step's seconds beyond its one-token forward: 64 tokens decoded plainly, per step, less the forward."""
    engine = SpeculativeEngine(target)
    result = engine.generate("def fibonacci(n):", GenerationConfig(max_new_tokens=64, k=0))
    stats = result.stats
    per_step = (stats.total_seconds - stats.prefill_seconds) / max(stats.target_forwards, 1)
    return max(per_step - forward_one, 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(TARGET, quantize="auto", progress=True)
    forward = timed(target.model, [(r, w) for r in ROWS for w in WIDTHS], args.rounds, "target forwards")
    draft = load_draft_model(DRAFT, target, progress=True)
    drafts = {"draft-model": timed(draft.model, [(r, 1) for r in DRAFT_ROWS], args.rounds, "draft model")}
    head = HeadForwarding(load_head(HEAD_DRAFT, target), target.model.vocab_size)
    drafts["draft-head"] = timed(head, [(r, 1) for r in DRAFT_ROWS], args.rounds, "draft head")
    catch_up = {"draft-model": catch_up_seconds(draft.model, args.rounds), "draft-head": catch_up_seconds(head, args.rounds)}
    lookup = suffix_seconds(target, args.rounds)
    cache = target.model.new_cache(1, 513)
    started = time.perf_counter()
    target.model.forward(cost_token_ids(512, target.model.vocab_size, 1000), cache, last_only=True)
    prefill_per_token = (time.perf_counter() - started) / 512
    record = {
        "kind": machine_kind(),
        "machine": machine_line(),
        "target_format": target.format.label if target.format is not None else str(target.model.dtype),
        "draft_format": getattr(draft.model, "weight_format", None),
        "forward": {str(r): {str(w): round(forward[(r, w)], 6) for w in WIDTHS} for r in ROWS},
        "draft": {
            **{source: {str(r): round(s, 6) for (r, _), s in costs.items()} for source, costs in drafts.items()},
            "suffix-index": {"1": round(lookup, 7), "16": round(16 * lookup, 7)},
        },
        "catch_up_per_token": {source: round(seconds, 7) for source, seconds in catch_up.items()},
        "step_overhead": round(step_overhead(target, forward[(1, 1)]), 6),
        "prefill_per_token": round(prefill_per_token, 7),
        "sources": [f"measured by benchmarks/scripts/controller_costs.py at {git_commit()}"],
        "derived": (f"forwards: medians of {args.rounds} interleaved rounds after {CONTEXT} tokens per row; a draft "
                    "position: a one-token forward of that many rows; suffix-index: one 8-token proposal over a "
                    "512-token recurring context per row, 16 rows = 16 proposals; catch_up_per_token: one row's "
                    f"{CATCH_UP_TOKENS}-token forward after {CONTEXT} / {CATCH_UP_TOKENS}; step_overhead: a plain 64-token "
                    "decode's seconds per step less the one-token forward; prefill: one 512-token forward / 512"),
        "lacks": "measured directly (one run)",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
