"""Would token trees over the draft head's guesses pay on each recorded machine kind? (issue 48 item 3)

The head's acceptance along chains and static trees is machine-independent: `../results/xeon/draft-head-trees`
counted it (tokens per target forward for chains of 1-6 and the best trees of 2-15 nodes, each tree fitted on
half the prompts and counted on the other half). What a step costs is the machine's: each kind's recorded
`controller-costs*.json` (`verispec.replay.Costs`). This prices every shape on every kind, no model and no timing:

    step = one head position per depth, over the nodes with children there (a batch of that many rows)
         + one target forward over the tree's nodes and the token before them (never below a narrower one's)
         + the kind's step overhead
    x plain = tokens per forward x (one-token forward + step overhead) / step

    .venv/bin/python benchmarks/scripts/tree_pricing.py   # the table in ../results/xeon/draft-head-trees/README.md
"""

from __future__ import annotations

import json
from pathlib import Path

from verispec.replay import Costs

RESULTS = Path(__file__).resolve().parents[1] / "results"
SHAPES = RESULTS / "xeon" / "draft-head-trees" / "results.json"
HEAD = "draft-head"


def step_seconds(costs: Costs, tree: list[list[int]]) -> float:
    """One speculative step over a static tree of rank paths (a chain of k: [[0], [0, 0], ...])."""
    parents_by_depth: dict[int, set[tuple[int, ...]]] = {}
    for node in map(tuple, tree):
        parents_by_depth.setdefault(len(node) - 1, set()).add(node[:-1])
    drafting = sum(costs.draft_seconds(HEAD, len(parents)) for parents in parents_by_depth.values())
    return drafting + verify_seconds(costs, len(tree) + 1) + costs.step_overhead


def verify_seconds(costs: Costs, width: int) -> float:
    """One row's forward over `width` tokens, never less than over fewer: a recorded width that timed faster than a
    narrower one (noise of a ms or two where the pass is flat) must not make a wider tree look cheaper."""
    return max(costs.forward_seconds(1, w) for w in range(1, width + 1))


def priced(costs: Costs, shapes: dict) -> dict[str, dict[str, float]]:
    """workload -> shape -> x plain on this kind's costs."""
    plain = costs.forward_seconds(1, 1) + costs.step_overhead
    return {
        workload: {
            shape: measured["tokens_per_forward"] * plain / step_seconds(costs, measured["tree"])
            for shape, measured in by_shape["shapes"].items()
        }
        for workload, by_shape in shapes["workloads"].items()
    }


def best(speedups: dict[str, float], prefix: str) -> tuple[str, float]:
    """The fastest shape whose name starts with prefix ("chain" or "tree"); a tree that is a chain counts as one."""
    named = {shape: x for shape, x in speedups.items() if shape.startswith(prefix)}
    shape = max(named, key=named.get)
    return shape, named[shape]


def kinds() -> list[Path]:
    return sorted(RESULTS.glob("*/controller-costs*.json"))


def main() -> None:
    shapes = json.loads(SHAPES.read_text())
    workloads = list(shapes["workloads"])
    print("# Would token trees over the draft head's guesses pay? Priced on every recorded machine kind (issue 48)\n")
    print("Written by `benchmarks/scripts/tree_pricing.py` (its docstring says how each step is priced). Each cell:")
    print("the best chain, then the best tree, as speedups over plain decoding priced from forwards and the head alone")
    print("(upper bounds, as in draft-head-trees). A tree of 2-4 nodes on code is the chain itself.\n")
    print("| kind (costs file) | 8 tokens / 1 | " + " | ".join(workloads) + " |")
    print("|---|---|" + "---|" * len(workloads))
    for path in kinds():
        costs = Costs.from_json(path)
        flatness = costs.forward_seconds(1, 8) / costs.forward_seconds(1, 1)
        cells = []
        for workload, speedups in priced(costs, shapes).items():
            (chain, x_chain), (tree, x_tree) = best(speedups, "chain"), best(speedups, "tree")
            mark = "**" if x_tree > x_chain * 1.02 else ""
            cells.append(f"{chain} {x_chain:.2f}x, {mark}{tree} {x_tree:.2f}x{mark}")
        print(f"| {path.parent.name}/{path.stem} | {flatness:.2f}x | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
