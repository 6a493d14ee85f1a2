#!/usr/bin/env bash
# `make peers`: set up the engines verispec is compared with, each in its own folder here, never in
# the project's .venv: llama.cpp (built from source) and vLLM (CPU build). A peer that cannot run on
# this machine says why in one line and the others still get set up. Never part of `make test`.
set -uo pipefail
cd "$(dirname "$0")"
../../../.venv/bin/verispec models --paths qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct || exit 1
status=0
for peer in llama_cpp vllm; do
    bash "$peer.sh"
    code=$?
    if [ $code -eq 3 ]; then
        echo "$peer: not set up on this machine (see the line above); benchmarks run without it"
    elif [ $code -ne 0 ]; then
        echo "$peer: setup failed (exit $code)" >&2; status=1
    fi
done
exit $status
