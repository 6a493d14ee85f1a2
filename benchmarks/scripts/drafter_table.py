"""Issue 31's drafter table for the machine at hand: each drafter's cost (a fraction of the target's one-token
forward, timed side by side), its acceptance by draft position and tokens per target forward on HumanEval, chat and
code edits.

Greedy decoding through the library engine with a fixed chain of --k drafts a step (the controller left out, so
every position is measured), the workloads' first --limit prompts, 128 new tokens; every output is checked against
plain decoding's. alpha_i is the chance that draft position i is accepted given the ones before it were.

    .venv/bin/python benchmarks/scripts/drafter_table.py --out benchmarks/results/<kind>/drafters
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from verispec import GenerationConfig, SpeculativeEngine, load_model
from verispec.bench.machine import git_commit, machine_line
from verispec.bench.workloads import load_workload, render_prompt
from verispec.drafters import make_drafter
from verispec.drafters.draft_head import HeadForwarding, HeadLayer
from verispec.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from verispec.models.forward_cost import forward_costs

DRAFTERS = {  # label: (make_drafter kind, draft, draft vocabulary)
    "draft model 0.5B": ("draft-model", DEFAULT_DRAFT, "full"),
    "draft model 0.5B, 32,768-token head": ("draft-model", DEFAULT_DRAFT, 32768),
    "draft head (make head)": ("draft-model", "head", "full"),
    "suffix index": ("suffix-index", None, "full"),
}
WORKLOADS = ("humaneval", "chat", "code-edit")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def prompts(target, workload: str, limit: int) -> list[str]:
    return [render_prompt(target.tokenizer, item) for item in load_workload(workload)[:limit]]


def acceptance(steps: list[tuple[int, int]], k: int) -> list[float]:
    """alpha_i over steps (drafted, accepted): of the steps that drafted position i and accepted every one before
    it, the share that accepted it too."""
    alphas = []
    for i in range(k):
        reached = [accepted for drafted, accepted in steps if drafted > i and accepted >= i]
        alphas.append(sum(accepted > i for accepted in reached) / len(reached) if reached else float("nan"))
    return alphas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--drafters", nargs="+", choices=list(DRAFTERS), default=list(DRAFTERS),
                        help="these rows only (default: every one)")
    parser.add_argument("--head", action="append", default=[], metavar="LABEL=FILE",
                        help="a row more: the draft head in this file (e.g. one trained beside the shipped one)")
    args = parser.parse_args()
    rows = {label: DRAFTERS[label] for label in args.drafters}
    for entry in args.head:
        label, _, path = entry.rpartition("=")
        if not label or not path.endswith(".safetensors") or not Path(path).is_file():
            parser.error(f"--head {entry!r}: give LABEL=FILE, FILE an existing head file (.safetensors)")
        rows[label] = ("draft-model", path, "full")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(DEFAULT_TARGET, quantize="auto")
    plain_engine = SpeculativeEngine(target)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, k=args.k)
    texts = {w: prompts(target, w, args.limit) for w in WORKLOADS}
    plain = {w: [plain_engine.generate(p, GenerationConfig(max_new_tokens=args.max_new_tokens, k=0)).token_ids
                 for p in texts[w]] for w in WORKLOADS}
    log("plain decoding done")
    results = {"target": DEFAULT_TARGET, "target_format": target.format.label, "k": args.k, "limit": args.limit,
               "drafters": {}}
    for label, (kind, draft, vocab) in rows.items():
        drafter = make_drafter(kind, target, draft, vocab=vocab)
        model = getattr(drafter, "model", None)
        cost = None
        if model is not None:
            timed = HeadForwarding(model, target.model.vocab_size) if isinstance(model, HeadLayer) else model
            seconds = forward_costs({"target": target.model, "draft": timed}, rows=(1,), rounds=9)
            cost = {"draft_ms": 1e3 * seconds["draft"][1], "target_ms": 1e3 * seconds["target"][1],
                    "fraction": seconds["draft"][1] / seconds["target"][1]}
        engine = SpeculativeEngine(target, drafter)
        by_workload = {}
        for workload in WORKLOADS:
            steps: list[tuple[int, int]] = []  # every step's (drafted, accepted): one request, one row
            tokens = 0
            for prompt, expected in zip(texts[workload], plain[workload]):
                result = engine.generate(prompt, config)
                if result.token_ids != expected:
                    raise SystemExit(f"{label} on {workload}: the output differs from plain decoding")
                tokens += len(result.token_ids)
                steps += [(step.rows[0].drafted, step.rows[0].accepted) for step in result.steps]
            by_workload[workload] = {
                "alpha_by_position": acceptance(steps, args.k), "tokens_per_forward": tokens / len(steps),
                "tokens": tokens, "steps": len(steps), "drafting_steps": sum(d > 0 for d, _ in steps),
            }
            log(f"{label} {workload}: alpha {[round(a, 2) for a in by_workload[workload]['alpha_by_position']]}, "
                f"{tokens / len(steps):.2f} tokens / forward")
        results["drafters"][label] = {"cost": cost, "workloads": by_workload}
    results |= {"machine": machine_line(), "commit": git_commit(), "command": " ".join(sys.argv)}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = ["| drafter | cost (x target forward) | " + " | ".join(
        f"{w}: alpha 1..{args.k} | tokens / forward" for w in WORKLOADS) + " |",
        "|---" * (2 + 2 * len(WORKLOADS)) + "|"]
    for label, measured in results["drafters"].items():
        cost = measured["cost"]
        cells = [label, f"{cost['fraction']:.3f} ({cost['draft_ms']:.1f} ms)" if cost else "lookup, no model"]
        for workload in WORKLOADS:
            m = measured["workloads"][workload]
            cells += [" / ".join(f"{a:.2f}" for a in m["alpha_by_position"]), f"{m['tokens_per_forward']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
