#!/usr/bin/env bash
# The exact commands behind the committed results in benchmarks/. Run alone on an idle machine
# (about an hour on 2 cores); `make bench` runs this file.
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv/bin/verispec
COMMON="--dtype bfloat16 --threads 2 --max-new-tokens 128"
# HumanEval: Qwen 1.5B target + 0.5B draft (int4), greedy, k=5; the composite drafter beside it.
$V bench --workload humaneval --limit 20 --modes plain,spec,composite --k 5 $COMMON --out benchmarks/humaneval
# Input-grounded edits: every drafter, including SmolLM2-135M drafting across tokenizers.
$V bench --workload code-edit --limit 10 --modes plain,spec,lookup,suffix,composite,cross --k 5 $COMMON --out benchmarks/code-edit
# k sweep and the Hugging Face peers (generate without / with assistant_model: default and 4 constant tokens).
$V bench --workload humaneval --limit 5 --modes plain,spec,hf-plain,hf-assisted --k 3,5,7 --hf-k 4 $COMMON --out benchmarks/humaneval-sweep
# Chat: support, shopping and technical questions through the chat template.
$V bench --workload chat --limit 5 --modes plain,spec,composite,cross --k 5 $COMMON --out benchmarks/chat
# Proposal cost against context length: prompt lookup rescans, the suffix index does not.
.venv/bin/python benchmarks/proposal_time.py > benchmarks/proposal_time.md
