#!/usr/bin/env bash
# The library's `--k auto` draft model against the served one, after the library runs the server's step
# (issue: one step for both paths). Same flags, the same prompts, one client; each mode against its own plain.
# Written for benchmarks/results/zen3/one-step-zen3 (not run there yet); OUT names the folder.
#   bash benchmarks/scripts/library_vs_served.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
source .venv/bin/activate
KIND=${MACHINE_KIND:-$(python -c 'from verispec.bench.machine import machine_kind; print(machine_kind())')}
out=${OUT:-benchmarks/results/$KIND/library-vs-served}
for workload in humaneval chat; do
  verispec bench --workload "$workload" --limit 4 --modes plain,spec --k auto --draft-quantize w4a8 \
    --max-new-tokens 128 --threads 2 --out "$out/library-$workload"
  verispec bench-serve --workload "$workload" --limit 4 --concurrency 1 --requests 4 --max-tokens 128 \
    --temperature 0 --out "$out/served-$workload" \
    --server plain=http://127.0.0.1:8301/v1 --start "plain=verispec serve --port 8301 --drafter none --threads 2" \
    --server spec=http://127.0.0.1:8302/v1 \
    --start "spec=verispec serve --port 8302 --drafter draft-model --draft-quantize w4a8 --k auto --threads 2"
done
