#!/usr/bin/env bash
# The exact commands behind the committed results in benchmarks/. Run alone on an idle machine
# (about 75 minutes on 2 cores for all); `make bench` runs this file. Arguments pick sections:
#   bash benchmarks/run.sh                 # all
#   bash benchmarks/run.sh sweep chat      # some
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv/bin/verispec
COMMON="--dtype bfloat16 --threads 2 --max-new-tokens 128"

humaneval() {  # Qwen 1.5B target + 0.5B draft (int4), greedy, k=5; the composite drafter beside it.
    $V bench --workload humaneval --limit 20 --modes plain,spec,composite --k 5 $COMMON --out benchmarks/humaneval
}
code_edit() {  # input-grounded edits: every drafter, including SmolLM2-135M drafting across tokenizers.
    $V bench --workload code-edit --limit 10 --modes plain,spec,lookup,suffix,composite,cross --k 5 $COMMON --out benchmarks/code-edit
}
sweep() {  # fixed k against auto, and the Hugging Face peers (assistant_model: default and 4 constant tokens).
    $V bench --workload humaneval --limit 6 --modes plain,spec,hf-plain,hf-assisted --k 3,5,7,auto --hf-k 4 $COMMON --out benchmarks/humaneval-sweep
}
adversarial() {  # a drafter whose guesses are unrelated to the target: auto must fall back to plain.
    $V bench --workload humaneval --limit 6 --modes plain,unrelated --k 4,auto $COMMON --out benchmarks/adversarial
}
chat() {  # support, shopping and technical questions through the chat template.
    $V bench --workload chat --limit 5 --modes plain,spec,composite,cross --k auto $COMMON --out benchmarks/chat
}
proposal() {  # proposal cost against context length: prompt lookup rescans, the suffix index does not.
    .venv/bin/python benchmarks/proposal_time.py > benchmarks/proposal_time.md
}

sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(humaneval code_edit sweep adversarial chat proposal)
for section in "${sections[@]}"; do
    "${section//-/_}"
done
