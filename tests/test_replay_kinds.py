"""The defaults never slower than plain on any recorded machine kind, by replaying each kind's recorded step costs
(benchmarks/results/<kind>/controller-costs*.json) over each workload's recorded acceptance (benchmarks/results/
acceptance-traces/) through the real controller (verispec.replay). These tests time nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import benchmark_script
from verispec.replay import K_MAX, Costs, load_traces, speedup

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
KINDS = sorted(RESULTS.glob("*/controller-costs*.json"))
WORKLOADS = sorted((RESULTS / "acceptance-traces").glob("*.json"))
DEFAULTS = ("suffix-index", "draft-head")  # the composite's order: the suffix index where it matches, else the head
DRAFT_MODEL = ("suffix-index", "draft-model")  # a catalog target without a head drafts with the 0.5B model
REQUESTS = {1: 16, 4: 16, 16: 32}  # requests replayed at each number of clients


def label(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def test_every_machine_kind_and_workload_is_recorded():
    kinds = {path.parent.name for path in KINDS}
    assert {"xeon", "zen1", "zen2", "zen3", "zen4", "zen5"} <= kinds, kinds
    assert {path.stem for path in WORKLOADS} >= {"humaneval", "chat", "long-documents"}


@pytest.fixture(scope="module", params=WORKLOADS, ids=label)
def traces(request):
    return load_traces(request.param)


@pytest.mark.parametrize("order", [DEFAULTS, DRAFT_MODEL], ids=["head", "draft-model"])
@pytest.mark.parametrize("kind", KINDS, ids=label)
def test_the_defaults_are_never_slower_than_plain(kind, traces, order):
    costs = Costs.from_json(kind)
    for clients, requests in REQUESTS.items():
        ratio = speedup(costs, traces, clients, order, "auto", requests)
        assert ratio >= 0.98, f"{clients} clients: {ratio:.3f}x plain"


@pytest.mark.parametrize("order", [DEFAULTS, DRAFT_MODEL], ids=["head", "draft-model"])
@pytest.mark.parametrize("kind", KINDS, ids=label)
def test_one_client_keeps_nearly_all_of_the_best_fixed_ks_gain(kind, traces, order):
    """At one client the controller, which knows nothing of the workload in advance, keeps at least 95% of what the
    best k fixed in hindsight gains over plain decoding (where some fixed k gains at all)."""
    costs = Costs.from_json(kind)
    best = max(speedup(costs, traces, 1, order, k, REQUESTS[1]) for k in range(1, K_MAX + 1))
    auto = speedup(costs, traces, 1, order, "auto", REQUESTS[1])
    assert auto - 1 >= 0.95 * (best - 1), f"auto {auto:.3f}x plain, best fixed k {best:.3f}x"


@pytest.mark.parametrize("kind", KINDS, ids=label)
def test_no_kind_pays_for_token_trees_over_the_heads_guesses(kind):
    """The engine verifies chains only (issue 48 item 3): on every recorded kind's costs, the head's best static tree
    (benchmarks/results/xeon/draft-head-trees) is within 10% of its best chain on every workload. A kind whose verify
    pass is flat enough for trees to pay more fails here: then trees are worth building for it."""
    import json

    pricing = benchmark_script("tree_pricing")
    shapes = json.loads(pricing.SHAPES.read_text())
    for workload, speedups in pricing.priced(Costs.from_json(kind), shapes).items():
        (chain, x_chain), (tree, x_tree) = pricing.best(speedups, "chain"), pricing.best(speedups, "tree")
        assert x_tree <= 1.10 * x_chain, f"{workload}: {tree} {x_tree:.2f}x plain against {chain} {x_chain:.2f}x"
