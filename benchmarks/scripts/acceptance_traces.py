"""Each workload's acceptance, as verispec.replay reads it (benchmarks/results/acceptance-traces/<workload>.json):
for the first prompts of each workload, each drafting source's accepted run at every position of the greedy
answer (verispec.replay.runs_from_steps), from one greedy run of the default target per source at k = 8.

    .venv/bin/python benchmarks/scripts/acceptance_traces.py --out benchmarks/results/acceptance-traces

Greedy acceptance depends on the models, not on the CPU (bfloat16 near-ties aside), so one recording serves every
machine kind's replay. Sources: the suffix index, the 0.5B draft model, the shipped draft head (the defaults'
composite proposes from the suffix index where it finds a match, else from its model).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from verispec import GenerationConfig, SpeculativeEngine, load_model
from verispec.bench.machine import git_commit, machine_line
from verispec.bench.workloads import load_workload, render_prompt
from verispec.drafters import HEAD_DRAFT, make_drafter
from verispec.replay import K_MAX, LOOKUP_SOURCES, runs_from_steps

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
WORKLOADS = {"humaneval": "humaneval", "chat": "chat",
             "long-documents": "benchmarks/workloads/long-documents.jsonl"}


def recorded_steps(engine: SpeculativeEngine, prompt: str, tokens: int) -> tuple[list[int], list[tuple[int, int]]]:
    """The greedy answer's token ids and each step's (drafted, accepted), at k = K_MAX."""
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=tokens, k=K_MAX))
    return result.token_ids, [(step.rows[0].drafted, step.rows[0].accepted) for step in result.steps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(WORKLOADS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(TARGET, quantize="auto", progress=True)
    drafters = {"suffix-index": make_drafter("suffix-index", target),
                "draft-model": make_drafter("draft-model", target, DRAFT),
                "draft-head": make_drafter("draft-model", target, HEAD_DRAFT)}
    args.out.mkdir(parents=True, exist_ok=True)
    for workload in args.workloads.split(","):
        source = WORKLOADS[workload]
        requests, differing = [], 0
        for item in tqdm(load_workload(source, args.limit), desc=workload):
            prompt = render_prompt(target.tokenizer, item)
            answers, runs = {}, {}
            for name, drafter in drafters.items():
                answers[name], steps = recorded_steps(SpeculativeEngine(target, drafter), prompt, args.max_new_tokens)
                runs[name] = runs_from_steps(steps, len(answers[name]), lookup=name in LOOKUP_SOURCES)
            reference = answers["suffix-index"]
            differing += sum(answer != reference for answer in answers.values())
            shortest = min(len(answer) for answer in answers.values())  # a bfloat16 near-tie may end one sooner
            requests.append({"id": item["id"], "prompt_tokens": len(target.encode(prompt)),
                             "runs": {name: r[:shortest] for name, r in runs.items()}})
        record = {"workload": workload, "target": TARGET, "draft": DRAFT, "head": "shipped",
                  "k": K_MAX, "max_new_tokens": args.max_new_tokens, "machine": machine_line(),
                  "commit": git_commit(), "answers_differing_from_the_suffix_index_run": differing,
                  "requests": requests}
        (args.out / f"{workload}.json").write_text(json.dumps(record, separators=(",", ":")) + "\n")
        print(f"{workload}: {len(requests)} requests, {differing} answers differing between sources")


if __name__ == "__main__":
    main()
