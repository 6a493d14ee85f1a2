#!/usr/bin/env bash
# The exact commands behind the committed results in benchmarks/results/. Run alone on an idle machine
# (about 75 minutes on 2 cores, and 90 more for peers); `make bench` runs this file. Arguments pick sections:
#   bash benchmarks/scripts/run.sh                 # all
#   bash benchmarks/scripts/run.sh sweep chat      # some
# Results go to benchmarks/results/KIND/FOLDER, KIND this machine's kind (zen2 ... zen5, xeon: see
# verispec.bench.machine.machine_kind; MACHINE_KIND=... overrides it), each folder with a run.json (commit, date,
# machine, command; index.py --fill adds the schema's other fields and rewrites benchmarks/INDEX.md). Then `make
# tables` rewrites benchmarks/results/KIND/TABLE.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
V=.venv/bin/verispec
COMMON="--dtype bfloat16 --threads 2 --max-new-tokens 128"
KIND=${MACHINE_KIND:-$(.venv/bin/python -c 'from verispec.bench.machine import machine_kind; print(machine_kind())')}
R=benchmarks/results/$KIND
P=benchmarks/scripts/peers  # the peers' scripts, and llama.cpp / vLLM as `make peers` set them up

stamp() {  # DIR COMMAND: DIR/run.json, where DIR's results came from
    mkdir -p "$1"
    .venv/bin/python - "$1" "$2" <<'PY'
import datetime, json, os, sys
from verispec.bench.machine import git_commit, machine_line
run = {"commit": git_commit(), "date": datetime.date.today().isoformat(), "machine": machine_line(),
       "command": sys.argv[2]}
with open(os.path.join(sys.argv[1], "run.json"), "w") as out:
    out.write(json.dumps(run, indent=1) + "\n")
PY
    .venv/bin/python benchmarks/scripts/index.py --fill  # the schema's other fields, from the results; INDEX.md
}

humaneval() {  # Qwen 1.5B target + 0.5B draft (int4), greedy, k=5; the composite drafter beside it.
    $V bench --workload humaneval --limit 20 --modes plain,spec,composite --k 5 $COMMON --out $R/humaneval
    stamp $R/humaneval "bash benchmarks/scripts/run.sh humaneval"
}
code_edit() {  # input-grounded edits: every drafter, including SmolLM2-135M drafting across tokenizers.
    $V bench --workload code-edit --limit 10 --modes plain,spec,lookup,suffix,composite,cross --k 5 $COMMON --out $R/code-edit
    stamp $R/code-edit "bash benchmarks/scripts/run.sh code_edit"
}
sweep() {  # fixed k against auto, and the Hugging Face peers (assistant_model: default and 4 constant tokens).
    $V bench --workload humaneval --limit 6 --modes plain,spec,hf-plain,hf-assisted --k 3,5,7,auto --hf-k 4 $COMMON --out $R/humaneval-sweep
    stamp $R/humaneval-sweep "bash benchmarks/scripts/run.sh sweep"
}
adversarial() {  # a drafter whose guesses are unrelated to the target: auto must fall back to plain.
    $V bench --workload humaneval --limit 6 --modes plain,unrelated --k 4,auto $COMMON --out $R/adversarial
    stamp $R/adversarial "bash benchmarks/scripts/run.sh adversarial"
}
chat() {  # support, shopping and technical questions through the chat template.
    $V bench --workload chat --limit 5 --modes plain,spec,composite,cross --k auto $COMMON --out $R/chat
    stamp $R/chat "bash benchmarks/scripts/run.sh chat"
}
proposal() {  # proposal cost against context length: prompt lookup rescans, the suffix index does not.
    mkdir -p $R/proposal-time
    .venv/bin/python benchmarks/scripts/proposal_time.py > $R/proposal-time/README.md
    stamp $R/proposal-time "bash benchmarks/scripts/run.sh proposal"
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
        --workload humaneval --limit 32 --concurrency 1,4,16 --requests-per-client 2 --max-tokens 128 --out $R/serve
    # What each server counted, incl. verispec_steps_total{batch_size,k}: the k the controller chose per batch size.
    curl -sf http://127.0.0.1:8101/metrics > $R/serve/metrics-plain.txt
    curl -sf http://127.0.0.1:8102/metrics > $R/serve/metrics-spec.txt
    stamp $R/serve "bash benchmarks/scripts/run.sh serve"
}

peers() {  # against what a user would run instead, served on this machine in one run: llama.cpp and vLLM.
    # Needs `make peers`; a peer that cannot run here is skipped with its reason in the report.
    local out=$R/peers
    local S="--dtype bfloat16 --threads 2 --max-batch-size 16 --max-context 2048"
    local target draft target_gguf
    { read -r _ target_gguf target && read -r _ _ draft; } < <($V models --paths \
        qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct)  # lines "NAME GGUF DIR"
    [ -d "${draft:-}" ] || { echo "peers: the packaged models are missing (run: make models)" >&2; return 1; }
    # The peers' own knobs first: llama.cpp's best draft length of 4/8/16 and its better n-gram
    # drafter; vLLM's thread binding (auto keeps a core for its busy scheduler; 0-1 computes on both).
    $V bench-serve \
        --server llama-draft-4=http://127.0.0.1:8211/v1 --start "llama-draft-4=$P/serve_llama_cpp.sh draft 8211 4" \
        --server llama-draft-8=http://127.0.0.1:8212/v1 --start "llama-draft-8=$P/serve_llama_cpp.sh draft 8212 8" \
        --server llama-draft-16=http://127.0.0.1:8213/v1 --start "llama-draft-16=$P/serve_llama_cpp.sh draft 8213 16" \
        --server llama-ngram-simple=http://127.0.0.1:8214/v1 --start "llama-ngram-simple=$P/serve_llama_cpp.sh ngram-simple 8214" \
        --server llama-ngram-mod=http://127.0.0.1:8215/v1 --start "llama-ngram-mod=$P/serve_llama_cpp.sh ngram-mod 8215" \
        --server vllm-bind-auto=http://127.0.0.1:8216/v1 \
        --start "vllm-bind-auto=VLLM_CPU_OMP_THREADS_BIND=auto $P/serve_vllm.sh plain 8216 $target" \
        --server vllm-bind-0-1=http://127.0.0.1:8217/v1 \
        --start "vllm-bind-0-1=VLLM_CPU_OMP_THREADS_BIND=0-1 $P/serve_vllm.sh plain 8217 $target" \
        --workload humaneval --limit 4 --concurrency 1 --requests 4 --max-tokens 128 --out $out/knobs || true
    local n_max ngram bind
    n_max=$(.venv/bin/python $P/best.py $out/knobs llama-draft- 8)
    ngram=$(.venv/bin/python $P/best.py $out/knobs llama- ngram-mod ngram)
    bind=$(.venv/bin/python $P/best.py $out/knobs vllm-bind- auto)
    export VLLM_CPU_OMP_THREADS_BIND=$bind
    for workload in humaneval code-edit; do
        $V bench-serve \
            --server verispec-plain=http://127.0.0.1:8201/v1 --start "verispec-plain=$V serve --drafter none --port 8201 $S" \
            --server verispec-draft=http://127.0.0.1:8202/v1 --start "verispec-draft=$V serve --drafter draft-model --port 8202 $S" \
            --server verispec-suffix=http://127.0.0.1:8203/v1 --start "verispec-suffix=$V serve --drafter suffix-index --port 8203 $S" \
            --server llama.cpp-plain=http://127.0.0.1:8204/v1 --start "llama.cpp-plain=$P/serve_llama_cpp.sh plain 8204" \
            --server llama.cpp-draft=http://127.0.0.1:8205/v1 --start "llama.cpp-draft=$P/serve_llama_cpp.sh draft 8205 $n_max" \
            --server llama.cpp-ngram=http://127.0.0.1:8206/v1 --start "llama.cpp-ngram=$P/serve_llama_cpp.sh $ngram 8206" \
            --server vllm-plain=http://127.0.0.1:8207/v1 --start "vllm-plain=$P/serve_vllm.sh plain 8207 $target" \
            --server vllm-draft=http://127.0.0.1:8208/v1 --start "vllm-draft=$P/serve_vllm.sh draft 8208 $target $draft" \
            --server vllm-ngram=http://127.0.0.1:8209/v1 --start "vllm-ngram=$P/serve_vllm.sh ngram 8209 $target" \
            --workload $workload --limit 8 --concurrency 1,4 --requests 4,8 --max-tokens 128 --out $out/$workload || true
    done
    # llama.cpp's own plain-decoding figures (tokens/s generating 128 tokens, and a 512-token prompt).
    if [ -x $P/.llama.cpp/bin/llama-bench ]; then
        $P/.llama.cpp/bin/llama-bench -m "$target_gguf" \
            -t 2 -p 512 -n 128 -r 3 -o md > $out/llama-bench.md
    fi
    stamp $out "bash benchmarks/scripts/run.sh peers"
}

fast() {  # the w8a8 target (serve's default --quantize auto here) against llama.cpp, in one run per workload.
    # Needs llama.cpp from `make peers`. First what one target forward costs, dense and w8a8, at 1-16 tokens.
    local out=$R/fast
    .venv/bin/python benchmarks/scripts/forward_cost.py --formats none,w8a8,w4a8 --out $out/forward-cost
    local S="--threads 2 --max-batch-size 16 --max-context 2048"
    for workload in humaneval code-edit; do
        $V bench-serve \
            --server verispec-plain=http://127.0.0.1:8301/v1 --start "verispec-plain=$V serve --drafter none --port 8301 $S" \
            --server verispec-draft=http://127.0.0.1:8302/v1 --start "verispec-draft=$V serve --drafter draft-model --port 8302 $S" \
            --server verispec-suffix=http://127.0.0.1:8303/v1 --start "verispec-suffix=$V serve --drafter suffix-index --port 8303 $S" \
            --server llama.cpp-plain=http://127.0.0.1:8304/v1 --start "llama.cpp-plain=SLOTS=16 $P/serve_llama_cpp.sh plain 8304" \
            --server llama.cpp-draft=http://127.0.0.1:8305/v1 --start "llama.cpp-draft=SLOTS=16 $P/serve_llama_cpp.sh draft 8305 4" \
            --workload $workload --limit 16 --concurrency 1,4,16 --requests 4,8,16 --max-tokens 128 \
            --out $out/$workload || true
    done
    local target_gguf
    read -r _ target_gguf _ < <($V models --paths qwen2.5-coder-1.5b-instruct)
    if [ -x $P/.llama.cpp/bin/llama-bench ]; then  # llama.cpp's own plain figures, same session
        $P/.llama.cpp/bin/llama-bench -m "$target_gguf" -t 2 -p 512 -n 128 -r 3 -o md > $out/llama-bench.md
    fi
    stamp $out "bash benchmarks/scripts/run.sh fast"
}

fast_w4a8() {  # the opt-in w4a8 target next to the default (w8a8) and llama.cpp, at 1 and 4 clients.
    # Needs llama.cpp from `make peers`. CONCURRENCY / REQUESTS override the levels (default 1,4 / 4,8).
    local out=$R/fast-w4a8
    .venv/bin/python benchmarks/scripts/forward_cost.py --formats none,w8a8,w4a8 --out $out/forward-cost
    local S="--threads 2 --max-batch-size 16 --max-context 2048"
    local L="--limit 16 --concurrency ${CONCURRENCY:-1,4} --requests ${REQUESTS:-4,8} --max-tokens 128"
    $V bench-serve \
        --server verispec-plain=http://127.0.0.1:8301/v1 --start "verispec-plain=$V serve --drafter none --port 8301 $S" \
        --server verispec-plain-w4a8=http://127.0.0.1:8306/v1 --start "verispec-plain-w4a8=$V serve --drafter none --quantize w4a8 --port 8306 $S" \
        --server verispec-draft=http://127.0.0.1:8302/v1 --start "verispec-draft=$V serve --drafter draft-model --port 8302 $S" \
        --server verispec-draft-w4a8=http://127.0.0.1:8307/v1 --start "verispec-draft-w4a8=$V serve --drafter draft-model --quantize w4a8 --port 8307 $S" \
        --server llama.cpp-plain=http://127.0.0.1:8304/v1 --start "llama.cpp-plain=SLOTS=16 $P/serve_llama_cpp.sh plain 8304" \
        --server llama.cpp-draft=http://127.0.0.1:8305/v1 --start "llama.cpp-draft=SLOTS=16 $P/serve_llama_cpp.sh draft 8305 4" \
        --workload humaneval $L --out $out/humaneval || true
    $V bench-serve \
        --server verispec-suffix=http://127.0.0.1:8303/v1 --start "verispec-suffix=$V serve --drafter suffix-index --port 8303 $S" \
        --server verispec-suffix-w4a8=http://127.0.0.1:8308/v1 --start "verispec-suffix-w4a8=$V serve --drafter suffix-index --quantize w4a8 --port 8308 $S" \
        --server llama.cpp-plain=http://127.0.0.1:8304/v1 --start "llama.cpp-plain=SLOTS=16 $P/serve_llama_cpp.sh plain 8304" \
        --workload code-edit $L --out $out/code-edit || true
    local target_gguf
    read -r _ target_gguf _ < <($V models --paths qwen2.5-coder-1.5b-instruct)
    if [ -x $P/.llama.cpp/bin/llama-bench ]; then  # llama.cpp's own plain figures, same session
        $P/.llama.cpp/bin/llama-bench -m "$target_gguf" -t 2 -p 512 -n 128 -r 3 -o md > $out/llama-bench.md
    fi
    stamp $out "CONCURRENCY=${CONCURRENCY:-1,4} REQUESTS=${REQUESTS:-4,8} bash benchmarks/scripts/run.sh fast_w4a8"
}

fast_kernels() {  # the default target (auto) against llama.cpp at 1, 4 and 16 clients, after the kernel work.
    # Needs llama.cpp from `make peers`. One target forward per format first (SKIP_FORWARD_COST=1 keeps the
    # last table), then served runs, then llama-bench. FAST_KERNELS_OUT names the folder (one per machine).
    local out=${FAST_KERNELS_OUT:-$R/fast-kernels}
    [ "${SKIP_FORWARD_COST:-0}" = 1 ] || .venv/bin/python benchmarks/scripts/forward_cost.py --formats none,w8a8,w4a8 --out $out/forward-cost
    local S="--threads 2 --max-batch-size 16 --max-context 2048"
    local L="--limit 16 --concurrency 1,4,16 --requests ${FAST_KERNELS_REQUESTS:-4,8,16} --max-tokens 128"
    $V bench-serve \
        --server verispec-plain=http://127.0.0.1:8501/v1 --start "verispec-plain=$V serve --drafter none --port 8501 $S" \
        --server verispec-draft=http://127.0.0.1:8502/v1 --start "verispec-draft=$V serve --drafter draft-model --port 8502 $S" \
        --server verispec-composite=http://127.0.0.1:8506/v1 --start "verispec-composite=$V serve --drafter composite --port 8506 $S" \
        --server llama.cpp-plain=http://127.0.0.1:8504/v1 --start "llama.cpp-plain=SLOTS=16 $P/serve_llama_cpp.sh plain 8504" \
        --server llama.cpp-draft=http://127.0.0.1:8505/v1 --start "llama.cpp-draft=SLOTS=16 $P/serve_llama_cpp.sh draft 8505 4" \
        --workload humaneval $L --out $out/humaneval || true
    $V bench-serve \
        --server verispec-plain=http://127.0.0.1:8501/v1 --start "verispec-plain=$V serve --drafter none --port 8501 $S" \
        --server verispec-suffix=http://127.0.0.1:8503/v1 --start "verispec-suffix=$V serve --drafter suffix-index --port 8503 $S" \
        --server verispec-composite=http://127.0.0.1:8506/v1 --start "verispec-composite=$V serve --drafter composite --port 8506 $S" \
        --server llama.cpp-plain=http://127.0.0.1:8504/v1 --start "llama.cpp-plain=SLOTS=16 $P/serve_llama_cpp.sh plain 8504" \
        --workload code-edit $L --out $out/code-edit || true
    local target_gguf
    read -r _ target_gguf _ < <($V models --paths qwen2.5-coder-1.5b-instruct)
    if [ -x $P/.llama.cpp/bin/llama-bench ]; then  # llama.cpp's own plain figures, same session
        $P/.llama.cpp/bin/llama-bench -m "$target_gguf" -t 2 -p 512 -n 128 -r 3 -o md > $out/llama-bench.md
    fi
    stamp $out "FAST_KERNELS_OUT=$out SKIP_FORWARD_COST=${SKIP_FORWARD_COST:-0} \
FAST_KERNELS_REQUESTS=${FAST_KERNELS_REQUESTS:-4,8,16} bash benchmarks/scripts/run.sh fast_kernels"
}

defaults() {  # the machine matrix (issue 29): own plain against `verispec serve`'s defaults, 1 / 4 / 16 clients.
    # From a clean format-choices.json unless KEEP_CHOICES=1; llama.cpp plain beside them where `make peers` built it.
    # DEFAULTS_OUT names the folder; DEFAULTS_CONCURRENCY the client levels; DEFAULTS_REQUESTS the requests per level;
    # DEFAULTS_WORKLOADS the workloads (names, or JSONL files under benchmarks/workloads/ by their stem);
    # DEFAULTS_PEERS=0 leaves llama.cpp out; DEFAULTS_HEAD_BEFORE=FILE adds the defaults with that head file in the
    # shipped head's place (the head shipped before: git show COMMIT:verispec/data/heads/<target>.safetensors > FILE).
    local out=${DEFAULTS_OUT:-$R/defaults}
    [ "${KEEP_CHOICES:-0}" = 1 ] || rm -f "${VERISPEC_CACHE:-$HOME/.cache/verispec}/format-choices.json"
    local S="--threads 2 --max-batch-size 16 --max-context 2048"
    local L="--concurrency ${DEFAULTS_CONCURRENCY:-1,4,16} --requests ${DEFAULTS_REQUESTS:-4,8,16} --max-tokens 128"
    local llama=()
    [ "${DEFAULTS_PEERS:-1}" = 1 ] && [ -x $P/.llama.cpp/bin/llama-server ] && llama=(--server llama.cpp-plain=http://127.0.0.1:8704/v1
        --start "llama.cpp-plain=SLOTS=16 $P/serve_llama_cpp.sh plain 8704")
    local before=()
    [ -n "${DEFAULTS_HEAD_BEFORE:-}" ] && before=(--server verispec-head-before=http://127.0.0.1:8703/v1
        --start "verispec-head-before=$V serve --draft $DEFAULTS_HEAD_BEFORE --port 8703 $S")
    for workload in ${DEFAULTS_WORKLOADS:-humaneval chat}; do
        local source=$workload
        [ -f benchmarks/workloads/$workload.jsonl ] && source=benchmarks/workloads/$workload.jsonl
        $V bench-serve \
            --server verispec-plain=http://127.0.0.1:8701/v1 --start "verispec-plain=$V serve --drafter none --port 8701 $S" \
            --server verispec-defaults=http://127.0.0.1:8702/v1 --start "verispec-defaults=$V serve --port 8702 $S" \
            "${before[@]}" "${llama[@]}" --workload $source --limit 16 $L --out $out/$workload || true
    done
    stamp $out "DEFAULTS_OUT=$out DEFAULTS_CONCURRENCY=${DEFAULTS_CONCURRENCY:-1,4,16} \
DEFAULTS_REQUESTS=${DEFAULTS_REQUESTS:-4,8,16} DEFAULTS_WORKLOADS='${DEFAULTS_WORKLOADS:-humaneval chat}' \
DEFAULTS_PEERS=${DEFAULTS_PEERS:-1} ${DEFAULTS_HEAD_BEFORE:+DEFAULTS_HEAD_BEFORE=$DEFAULTS_HEAD_BEFORE }\
KEEP_CHOICES=${KEEP_CHOICES:-0} bash benchmarks/scripts/run.sh defaults"
}

shipped_head() {  # issue 45: a fresh clone's defaults (the shipped head behind the suffix index) against the same
    # server decoding plainly, the 0.5B draft model in the head's place, and llama.cpp plain (`make peers`), 1 and 4
    # clients. Refuses to run where a head `make head` built here would go before the shipped one.
    local out=${SHIPPED_HEAD_OUT:-$R/shipped-head-served}
    .venv/bin/python -c 'import sys; from verispec.drafters.draft_head import head_path, shipped_head
t = "qwen2.5-coder-1.5b-instruct"; s = shipped_head(t)
sys.exit(0 if s and head_path(t) == s[0] else f"not the shipped head: {head_path(t)} (move it away)")'
    local S="--threads 2 --max-batch-size 16 --max-context 2048"
    local llama=()
    [ -x $P/.llama.cpp/bin/llama-server ] && llama=(--server llama.cpp-plain=http://127.0.0.1:8754/v1
        --start "llama.cpp-plain=SLOTS=4 $P/serve_llama_cpp.sh plain 8754")
    for workload in ${SHIPPED_HEAD_WORKLOADS:-humaneval chat}; do
        $V bench-serve \
            --server verispec-plain=http://127.0.0.1:8751/v1 --start "verispec-plain=$V serve --drafter none --port 8751 $S" \
            --server verispec-defaults=http://127.0.0.1:8752/v1 --start "verispec-defaults=$V serve --port 8752 $S" \
            --server verispec-draft-model=http://127.0.0.1:8753/v1 \
            --start "verispec-draft-model=$V serve --draft qwen2.5-coder-0.5b-instruct --port 8753 $S" \
            "${llama[@]}" --workload $workload --limit 16 --concurrency ${SHIPPED_HEAD_CONCURRENCY:-1,4} \
            --requests ${SHIPPED_HEAD_REQUESTS:-16,16} --max-tokens 128 --out $out/$workload || true
    done
    stamp $out "SHIPPED_HEAD_OUT=$out SHIPPED_HEAD_WORKLOADS='${SHIPPED_HEAD_WORKLOADS:-humaneval chat}' \
SHIPPED_HEAD_CONCURRENCY=${SHIPPED_HEAD_CONCURRENCY:-1,4} SHIPPED_HEAD_REQUESTS=${SHIPPED_HEAD_REQUESTS:-16,16} \
bash benchmarks/scripts/run.sh shipped_head"
}

prefill() {  # issue 12 items 4-5: prefix reuse and chunked prefill, each against the server without it.
    local out=$R/chunked-prefill
    local S="--drafter none --threads 2 --max-batch-size 16 --max-context 2048"
    # A 1,000-token system prompt shared by every request (the support policy, then one of the chat questions).
    $V bench-serve \
        --server prefix-cache=http://127.0.0.1:8601/v1 --start "prefix-cache=$V serve --port 8601 $S" \
        --server no-prefix-cache=http://127.0.0.1:8602/v1 --start "no-prefix-cache=$V serve --port 8602 --prefix-cache-mb 0 $S" \
        --workload benchmarks/workloads/support-system-prompt.jsonl --limit 16 --concurrency 1,4 --requests 8,8 \
        --max-tokens 64 --out $out/system-prompt || true
    # A burst of 16 requests at once: each prompt in turn and streaming, or every prompt before any token.
    $V bench-serve \
        --server chunked=http://127.0.0.1:8603/v1 --start "chunked=$V serve --port 8603 --chunked-prefill $S" \
        --server whole=http://127.0.0.1:8604/v1 --start "whole=$V serve --port 8604 $S" \
        --workload humaneval --limit 16 --concurrency 4,16 --requests 8,16 --max-tokens 128 --out $out/humaneval || true
    # A 2,000-token prompt arriving while 4 streams decode.
    .venv/bin/python benchmarks/scripts/long_prompt_admission.py --out $out/admission
    stamp $out "bash benchmarks/scripts/run.sh prefill"
}

packed_prefill() {  # issue 12 items 4 and 6: chunks inside the decoding step's forward; a k per sequence.
    local out=${PACKED_PREFILL_OUT:-$R/packed-prefill}
    local S="--threads 2 --max-batch-size 16 --max-context 2560"
    # A 2,000-token prompt arriving while 4 streams decode: packed chunks, whole, and chunks as forwards of their own.
    .venv/bin/python benchmarks/scripts/long_prompt_admission.py --out $out/admission
    # 16 clients x 2 requests (the shape of benchmarks/results/zen5/serve, whose TTFT p50 the issue starts from; the first 16
    # arrive at once), and 4 clients: plain decoding, so that only prompt handling differs.
    $V bench-serve \
        --server chunked=http://127.0.0.1:8701/v1 --start "chunked=$V serve --port 8701 --drafter none --chunked-prefill $S" \
        --server whole=http://127.0.0.1:8702/v1 --start "whole=$V serve --port 8702 --drafter none --no-chunked-prefill $S" \
        --workload humaneval --limit 32 --concurrency 4,16 --requests 16,32 --max-tokens 128 --out $out/burst || true
    # One k for all of a drafter's rows against a k per sequence, with the draft model, at 4 and 16 clients.
    $V bench-serve \
        --server k-per-sequence=http://127.0.0.1:8703/v1 --start "k-per-sequence=$V serve --port 8703 --k-per-sequence $S" \
        --server k-per-drafter=http://127.0.0.1:8704/v1 --start "k-per-drafter=$V serve --port 8704 $S" \
        --workload humaneval --limit 32 --concurrency 4,16 --requests 12,32 --max-tokens 128 --out $out/k-per-sequence || true
    stamp $out "PACKED_PREFILL_OUT=$out bash benchmarks/scripts/run.sh packed_prefill"
}

zen2() {  # an AMD EPYC Zen 2 (AVX2, no AVX-512): what each format costs there, and prompts in a burst.
    local out=${ZEN2_OUT:-$R/avx2-kernels}
    local S="--threads 2 --max-batch-size 16 --max-context 2560"
    .venv/bin/python benchmarks/scripts/forward_cost.py --formats none@float32,w4a8@float32,w4a8@bfloat16,none@bfloat16 \
        --rounds 9 --out $out/forward-cost
    # The defaults (--dtype auto: float32 here; --quantize auto), plain decoding: chunked prefill against whole.
    $V bench-serve \
        --server chunked=http://127.0.0.1:8711/v1 --start "chunked=$V serve --port 8711 --drafter none --chunked-prefill $S" \
        --server whole=http://127.0.0.1:8712/v1 --start "whole=$V serve --port 8712 --drafter none --no-chunked-prefill $S" \
        --workload humaneval --limit 32 --concurrency 4,16 --requests 16,32 --max-tokens 128 --out $out/burst || true
    stamp $out "ZEN2_OUT=$out bash benchmarks/scripts/run.sh zen2"
}

structured_output() {  # issue 12 item 1: every mode free and under each prompt's JSON schema, in one run.
    $V bench --workload benchmarks/workloads/json-extraction.jsonl --modes plain,spec,composite --k auto \
        --schema both --max-new-tokens 160 --threads 2 --out $R/structured-output
    stamp $R/structured-output "bash benchmarks/scripts/run.sh structured_output"
}

sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(humaneval code_edit sweep adversarial chat proposal serve peers)
for section in "${sections[@]}"; do
    "${section//-/_}"
done
