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

serve() {  # the HTTP server at 1, 4 and 16 concurrent streaming clients, with and without speculation.
    local pids=()
    trap 'kill "${pids[@]}" 2>/dev/null || true' RETURN
    $V serve --drafter none --port 8101 --dtype bfloat16 --threads 2 --max-batch-size 16 --max-context 2048 & pids+=($!)
    $V serve --drafter draft-model --port 8102 --dtype bfloat16 --threads 2 --max-batch-size 16 --max-context 2048 & pids+=($!)
    for port in 8101 8102; do
        until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 2; done
    done
    $V bench-serve --server plain=http://127.0.0.1:8101/v1 --server spec=http://127.0.0.1:8102/v1 \
        --workload humaneval --limit 32 --concurrency 1,4,16 --requests-per-client 2 --max-tokens 128 --out benchmarks/serve
    # What each server counted, incl. verispec_steps_total{batch_size,k}: the k the controller chose per batch size.
    curl -sf http://127.0.0.1:8101/metrics > benchmarks/serve/metrics-plain.txt
    curl -sf http://127.0.0.1:8102/metrics > benchmarks/serve/metrics-spec.txt
}

sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(humaneval code_edit sweep adversarial chat proposal serve)
for section in "${sections[@]}"; do
    "${section//-/_}"
done
