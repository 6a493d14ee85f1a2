"""Record what the format chooser reads on this machine: benchmarks/results/<kind>/format-costs-<family>-<model>.json.

The chooser's tests replay every such file (tests/test_format_chooser.py): each kind's costs as data, so that the
choosers stay right on kinds a session does not have. This runs the chooser's own screens and whole forwards for the
packaged target (its probe) and draft, with the whole-forward drops off and a long budget, so that every candidate
that survives its screen is timed at every width; what the screen drops stays untimed, as it is when choosing.

    python benchmarks/scripts/format_costs.py            # about two minutes on a Xeon; prints the file it wrote
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from verispec.bench.machine import git_commit, machine_kind, machine_line
from verispec.drafters.draft_format import _draft_subject, draft_candidates
from verispec.models import format_chooser, target_format
from verispec.models.config import ModelConfig
from verispec.models.linear import auto_candidates
from verispec.models.loading import SafetensorsWeights, load_model, resolve_model
from verispec.models.machine import cpu_model

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
RESULTS = Path(__file__).resolve().parent.parent / "results"


def record(subject: format_chooser.Subject, candidates: tuple[str, ...]) -> dict:
    """The chooser's measurements of one model, every screen survivor timed at every width."""
    format_chooser.WHOLE_DROP = format_chooser.HOPELESS = math.inf  # time the survivors in full
    measured = format_chooser.measure(subject, candidates, budget=600.0)
    return {"candidates": list(measured["screen"]), "screen": measured["screen"], "whole": measured["whole"],
            "fastest": measured["format"], "too_slow": measured["too_slow"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _, directory, _ = resolve_model(TARGET, progress=True)
    config = ModelConfig.from_dir(directory)

    def read_probe() -> dict:
        weights = SafetensorsWeights(directory)
        return {name: weights.pop(name) for name in target_format.probe_tensor_names(weights.names(), config)}

    target = record(target_format.probe_subject(config, read_probe, torch.bfloat16), auto_candidates())
    draft = load_model(DRAFT, "bfloat16", progress=True)
    draft.model.invariant_attention = False
    everything = draft_candidates("auto", torch.bfloat16) + ("none",)
    draft_costs = record(_draft_subject(draft.model, {}), everything)
    family_model = cpu_model().rsplit("(", 1)[-1].rstrip(")").replace("/", "-")
    out = RESULTS / machine_kind() / f"format-costs-{family_model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "kind": machine_kind(),
        "machine": machine_line(),
        "sources": [f"measured by benchmarks/scripts/format_costs.py --threads {args.threads} on {git_commit()}, "
                    f"{time.strftime('%Y-%m-%d')}: the chooser's own screens and whole forwards (target: its probe's "
                    f"estimates), every screen survivor timed at every width"],
        "derived": "nothing: every figure was measured here",
        "models": {"target": target, "draft": draft_costs},
    }, indent=2) + "\n")
    print(out, file=sys.stderr)


if __name__ == "__main__":
    main()
