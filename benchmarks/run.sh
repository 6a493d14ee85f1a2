#!/usr/bin/env bash
# The exact commands behind the committed results in benchmarks/. Run alone on an idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv/bin/verispec
COMMON="--dtype bfloat16 --threads 2 --max-new-tokens 128"
# Issue 2: HumanEval, Qwen 1.5B target + 0.5B draft, greedy, k=5.
$V bench --workload humaneval --limit 20 --modes plain,spec --k 5 $COMMON --out benchmarks/humaneval
# Input-grounded edits: the same pair on code-edit.
$V bench --workload code-edit --limit 8 --modes plain,spec --k 5 $COMMON --out benchmarks/code-edit
# k sweep and Hugging Face peers (generate with and without assistant_model) on fewer prompts.
$V bench --workload humaneval --limit 6 --modes plain,spec,hf-plain,hf-assisted --k 3,5,7 --hf-k 4 $COMMON --out benchmarks/humaneval-sweep
