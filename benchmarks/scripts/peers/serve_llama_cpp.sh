#!/usr/bin/env bash
# Start llama.cpp's `llama-server` as a bench-serve peer, in the foreground, on the catalog's own GGUF
# files (the ones verispec converts: `verispec models --paths`).
#   serve_llama_cpp.sh MODE PORT [N_MAX]
#   MODE: plain | draft (the 0.5B drafts up to N_MAX tokens, default 8) | ngram-simple | ngram-mod
# Exit 3 with one line when it cannot run here (not built: `make peers`).
set -euo pipefail
cd "$(dirname "$0")"
mode=${1:-} port=${2:-} n_max=${3:-8}
threads=${THREADS:-2}
slots=${SLOTS:-4}  # parallel sequences (clients served at once), 2048 tokens of context each
server=.llama.cpp/bin/llama-server
case "$mode" in plain|draft|ngram-simple|ngram-mod) ;; *)
    echo "usage: serve_llama_cpp.sh plain|draft|ngram-simple|ngram-mod PORT [N_MAX]" >&2; exit 2;; esac
[ -n "$port" ] || { echo "usage: serve_llama_cpp.sh MODE PORT [N_MAX]" >&2; exit 2; }
[ -x "$server" ] || { echo "llama.cpp: skipped: not built here (run: make peers; see benchmarks/scripts/peers/llama_cpp.sh)"; exit 3; }
# One call: lines "NAME GGUF DIR" for the target, then the draft.
{ read -r _ target _ && read -r _ draft _; } < <(../../../.venv/bin/verispec models --paths \
    qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct)
[ -f "${draft:-}" ] || { echo "llama.cpp: the packaged models' GGUF files are missing (run: make models)" >&2; exit 1; }
# $slots slots for up to $slots concurrent clients, 2048 tokens of context each; /metrics on for the speculative counters.
args=(-m "$target" --host 127.0.0.1 --port "$port" -t "$threads" -tb "$threads" -c $((2048 * slots)) -np "$slots" --metrics --no-webui
      -a qwen2.5-coder-1.5b-instruct)
case "$mode" in
    plain) exec "$server" "${args[@]}" ;;
    draft) exec "$server" "${args[@]}" -md "$draft" --spec-type draft-simple --spec-draft-n-max "$n_max" -td "$threads" ;;
    ngram-*) exec "$server" "${args[@]}" --spec-type "$mode" ;;
esac
