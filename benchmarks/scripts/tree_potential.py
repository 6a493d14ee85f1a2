"""What token trees could add, measured before building them (issue 31 item 3): greedy, from real outputs.

    .venv/bin/python benchmarks/scripts/tree_potential.py --workloads humaneval,chat --limit 8 \\
        --out benchmarks/results/MACHINE/tree-potential

For each prompt the target decodes greedily (its own text, as a user gets it); the draft model then reads prompt
and text in one forward, which gives at every generated position the rank of the target's token among the draft's
guesses after the true prefix. In greedy decoding that is all acceptance depends on: a chain of k drafts passes
position i while the target's token is the draft's first guess there; a tree whose nodes at depth i have b_i
children passes while it is among the draft's b_i first guesses (the child that matched continues from the true
prefix, as teacher forcing does). So the tokens per target forward of any tree shape follow from the ranks,
exactly, and with the measured costs of both models' forwards over n new tokens (a tree's nodes at one depth go
through the draft in one forward; the verify pass takes all nodes), the expected speed of each shape against plain
decoding. Shapes are written b_1 x b_2 x ..., e.g. 2x1x1: two guesses at the first position, each continued by a
chain of two.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.bench.machine import git_commit, machine_description, machine_line
from verispec.bench.workloads import load_workload, render_prompt
from verispec.cost_model import interpolate
from verispec.engine import GenerationConfig, SpeculativeEngine
from verispec.models.forward_cost import forward_costs
from verispec.models.loading import load_model

SHAPES = [
    (1,), (1, 1), (1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1, 1), (1,) * 6,  # chains, k = 1 .. 6
    (2,), (2, 1), (2, 1, 1), (2, 1, 1, 1), (3, 1, 1), (4, 1, 1), (2, 2), (2, 2, 1), (2, 2, 1, 1), (3, 2, 1), (2, 2, 2),
]
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def nodes_by_depth(shape: tuple[int, ...]) -> list[int]:
    """Draft tokens at each depth of a tree whose nodes at depth i have shape[i] children."""
    return [math.prod(shape[: i + 1]) for i in range(len(shape))]


def tokens_per_step(ranks: list[int], shape: tuple[int, ...]) -> float:
    """Mean tokens a step commits (accepted drafts + the target's own) walking a text whose draft ranks are `ranks`."""
    position, steps = 0, 0
    while position < len(ranks):
        accepted = 0
        while (accepted < len(shape) and position + accepted < len(ranks)
               and ranks[position + accepted] < shape[accepted]):
            accepted += 1
        position += accepted + 1
        steps += 1
    return len(ranks) / steps


def step_seconds(shape: tuple[int, ...], draft: dict[int, float], target: dict[int, float]) -> float:
    """A step's cost: one draft forward per depth (over the nodes it proposes from) and one verify pass."""
    widths = [1] + nodes_by_depth(shape)[:-1]  # the draft reads the root, then each depth's nodes
    return sum(interpolate(draft, w) for w in widths) + interpolate(target, 1 + sum(nodes_by_depth(shape)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--format", default="w4a8", help="both models' weight format")
    parser.add_argument("--workloads", default="humaneval,chat")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-results/tree-potential"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = load_model(args.target, "bfloat16", progress=True, quantize=args.format)
    draft = load_model(args.draft, "bfloat16", progress=True, quantize=args.format)
    costs = forward_costs({"target": target, "draft": draft}, rows=ROWS, rounds=9)
    plain = SpeculativeEngine(target)
    results = {}
    for workload in args.workloads.split(","):
        ranks_by_prompt = []
        for prompt in tqdm(load_workload(workload, args.limit), desc=workload):
            prompt_ids = target.encode(render_prompt(target.tokenizer, prompt))
            output = plain.generate(prompt_ids, GenerationConfig(max_new_tokens=args.max_new_tokens)).token_ids
            ids = torch.tensor([prompt_ids + output])  # (1, T)
            cache = draft.model.new_cache(1, ids.shape[1])
            logits = draft.model.forward(ids, cache)[0, len(prompt_ids) - 1 : -1]  # (new, V): guesses for each output
            actual = torch.tensor(output)  # (new,)
            ranks = (logits > logits.gather(1, actual[:, None])).sum(1)  # (new,) guesses scored above the target's
            ranks_by_prompt.append(ranks.tolist())
        plain_step = costs["target"][1]
        rows = []
        for shape in SHAPES:
            per_prompt = [tokens_per_step(ranks, shape) for ranks in ranks_by_prompt]
            tokens = statistics.mean(per_prompt)
            seconds = step_seconds(shape, costs["draft"], costs["target"])
            rows.append({
                "shape": "x".join(map(str, shape)), "nodes": sum(nodes_by_depth(shape)), "tokens_per_forward": tokens,
                "step_ms": seconds * 1e3, "speedup": tokens * plain_step / seconds,
            })
        all_ranks = [r for ranks in ranks_by_prompt for r in ranks]
        results[workload] = {
            "prompts": len(ranks_by_prompt), "tokens": len(all_ranks),
            "rank_share": {str(r): sum(1 for x in all_ranks if x == r) / len(all_ranks) for r in range(4)},
            "shapes": rows,
        }
    report = {
        "commit": git_commit(), "date": datetime.date.today().isoformat(), "machine": machine_line(),
        "machine_details": machine_description(),
        "command": "benchmarks/scripts/tree_potential.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "forward_ms": {name: {str(n): round(s * 1e3, 3) for n, s in c.items()} for name, c in costs.items()},
        "workloads": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "run.json").write_text(json.dumps(report, indent=2) + "\n")
    for workload, result in results.items():
        shares = ", ".join(f"rank {r}: {s:.0%}" for r, s in result["rank_share"].items())
        print(f"\n{workload}: {result['prompts']} prompts, {result['tokens']} tokens; "
              f"the target's token was the draft's {shares}")
        print(f"{'shape':>10} {'nodes':>5} {'tok/fwd':>8} {'step ms':>8} {'x plain':>8}")
        for row in result["shapes"]:
            print(f"{row['shape']:>10} {row['nodes']:>5} {row['tokens_per_forward']:8.2f} {row['step_ms']:8.1f} "
                  f"{row['speedup']:8.2f}")


if __name__ == "__main__":
    main()
