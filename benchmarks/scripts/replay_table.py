"""The controller replayed on every recorded machine kind and workload (verispec.replay): the defaults' tokens per
second over plain decoding at 1, 4 and 16 clients, for the composite over the shipped head and over the 0.5B draft
model, beside the best k fixed in hindsight at one client. Times nothing; a Markdown table on stdout.

    .venv/bin/python benchmarks/scripts/replay_table.py > /tmp/replay.md
"""

from __future__ import annotations

from pathlib import Path

from verispec.replay import K_MAX, Costs, load_traces, speedup

RESULTS = Path(__file__).resolve().parents[1] / "results"
ORDERS = {"head": ("suffix-index", "draft-head"), "0.5B": ("suffix-index", "draft-model")}
CLIENTS = {1: 16, 4: 16, 16: 32}  # clients -> requests replayed (as tests/test_replay_kinds.py)


def main() -> None:
    print("| kind | workload | drafter | defaults: 1 / 4 / 16 clients | best fixed k, 1 client |")
    print("|---|---|---|---|---|")
    for workload in sorted((RESULTS / "acceptance-traces").glob("*.json")):
        traces = load_traces(workload)
        for record in sorted(RESULTS.glob("*/controller-costs*.json")):
            costs = Costs.from_json(record)
            for name, order in ORDERS.items():
                auto = [speedup(costs, traces, clients, order, "auto", requests)
                        for clients, requests in CLIENTS.items()]
                best, k = max((speedup(costs, traces, 1, order, k, CLIENTS[1]), k) for k in range(1, K_MAX + 1))
                kind = f"{record.parent.name}/{record.stem}"
                print(f"| {kind} | {workload.stem} | {name} | {' / '.join(f'{x:.2f}x' for x in auto)} | "
                      f"{best:.2f}x (k = {k}) |")


if __name__ == "__main__":
    main()
