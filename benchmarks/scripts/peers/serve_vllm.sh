#!/usr/bin/env bash
# Serve TARGET_DIR with vLLM's CPU build (installed by vllm.sh) on 127.0.0.1:PORT, in the
# foreground (exec). OpenAI-compatible API under /v1, Prometheus metrics under /metrics.
#
#   serve_vllm.sh MODE PORT TARGET_DIR [DRAFT_DIR]
#     plain   no speculation
#     draft   speculative decoding with the draft model DRAFT_DIR, 5 tokens a step
#     ngram   n-gram prompt lookup, 5 tokens a step, n-grams of 2 to 4 tokens
#
# Environment (defaults in brackets): VLLM_CPU_KVCACHE_SPACE [2] (GiB of KV cache),
# VLLM_CPU_OMP_THREADS_BIND [auto] (`auto` keeps one core for vLLM's busy scheduler process and
# runs the model on the rest; `0-1` runs the model on both cores of a 2-core machine, sharing one
# with the scheduler), VLLM_GENERATION_CONFIG [qwen-stop/] (a folder with the generation_config.json
# whose eos_token_id list ends generation), VLLM_SERVE_EXTRA (extra `vllm serve` arguments, split on spaces).
#
# Exit 2: bad arguments. Exit 3: vLLM is not installed / cannot run here (one line says why).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=$HERE/.vllm-venv
SPEC_TOKENS=5

usage() { echo "usage: $(basename "$0") plain|draft|ngram PORT TARGET_DIR [DRAFT_DIR] (DRAFT_DIR required for draft)" >&2; exit 2; }

[ $# -ge 3 ] && [ $# -le 4 ] || usage
MODE=$1 PORT=$2 TARGET=$3 DRAFT=${4:-}
case "$MODE" in plain|draft|ngram) ;; *) usage ;; esac
[[ "$PORT" =~ ^[0-9]+$ ]] && [ "$PORT" -ge 1 ] && [ "$PORT" -le 65535 ] || usage
[ "$MODE" != draft ] || [ -n "$DRAFT" ] || usage

skip() { echo "vllm $MODE: skipped: $*" >&2; exit 3; }

[ -x "$VENV/bin/vllm" ] && [ -f "$VENV/.verispec-vllm-ready" ] \
    || skip "vLLM is not installed in $VENV (run $HERE/vllm.sh first)"
[ -f "$TARGET/config.json" ] || { echo "vllm $MODE: $TARGET has no config.json (need a HF-style model dir)" >&2; exit 2; }
if [ "$MODE" = draft ]; then
    [ -f "$DRAFT/config.json" ] || { echo "vllm $MODE: $DRAFT has no config.json (need a HF-style model dir)" >&2; exit 2; }
fi
TARGET=$(cd "$TARGET" && pwd)

ARGS=(
    serve "$TARGET"
    --host 127.0.0.1 --port "$PORT"
    --served-model-name "$(basename "$TARGET")"
    --dtype bfloat16
    --enforce-eager
    --max-model-len 2048
    --uvicorn-log-level warning
    # The stop tokens verispec and llama.cpp use for the Qwen pair: <|endoftext|> ends completions,
    # <|im_end|> chat turns. The model's own generation_config names only <|im_end|>, so without this
    # vLLM writes past the end of a completion (seen: 128 tokens where the others stop at 29).
    --generation-config "${VLLM_GENERATION_CONFIG:-$HERE/qwen-stop}"
)
case "$MODE" in
    draft)
        DRAFT=$(cd "$DRAFT" && pwd)
        ARGS+=(--speculative-config "{\"method\": \"draft_model\", \"model\": \"$DRAFT\", \"num_speculative_tokens\": $SPEC_TOKENS}") ;;
    ngram)
        ARGS+=(--speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $SPEC_TOKENS, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}") ;;
esac
# shellcheck disable=SC2206
[ -z "${VLLM_SERVE_EXTRA:-}" ] || ARGS+=($VLLM_SERVE_EXTRA)

export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-auto}
# Nothing phones home; models come from local dirs only.
export VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 DO_NOT_TRACK=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TOKENIZERS_PARALLELISM=false
# vLLM's CPU backend wants Intel OpenMP (shipped in the venv by intel-openmp) and tcmalloc (if the
# system has it) preloaded; without libiomp speculative decoding is much slower, it warns.
if [[ "${LD_PRELOAD:-}" != *libiomp* && "${LD_PRELOAD:-}" != *libgomp* && "${LD_PRELOAD:-}" != *libomp* ]]; then
    pre=()
    tcm=$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 |libtcmalloc\.so\.4 / {print $NF; exit}')
    [ -n "$tcm" ] && pre+=("$tcm")
    [ -f "$VENV/lib/libiomp5.so" ] && pre+=("$VENV/lib/libiomp5.so")
    [ ${#pre[@]} -eq 0 ] || export LD_PRELOAD="$(IFS=:; echo "${pre[*]}")${LD_PRELOAD:+:$LD_PRELOAD}"
fi

echo "vllm $MODE: serving $(basename "$TARGET") on http://127.0.0.1:$PORT (KV cache ${VLLM_CPU_KVCACHE_SPACE} GiB, threads $VLLM_CPU_OMP_THREADS_BIND)" >&2
exec "$VENV/bin/vllm" "${ARGS[@]}"
