#!/usr/bin/env bash
# Issue 13 item 3: does prefix affinity pay? 2 replicas x 1 thread on Ray Serve, Ray's default routing
# against --prefix-affinity, on the two kinds of prefix reuse the serving work has: one system prompt
# shared by every request (the support workload) and four stores' system prompts (workloads/tenants.jsonl),
# each ~1,000 tokens, in one run per workload. 64 new tokens, as in benchmarks/results/zen4/chunked-prefill.
#   bash benchmarks/scripts/ray-replicas/affinity.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
V=.venv/bin/verispec
KIND=${MACHINE_KIND:-$(.venv/bin/python -c 'from verispec.bench.machine import machine_kind; print(machine_kind())')}
S="--replicas 2 --threads 2 --drafter none --max-batch-size 16 --max-context 2048"
for workload in tenants support; do
    file=benchmarks/workloads/tenants.jsonl
    [ $workload = support ] && file=benchmarks/workloads/support-system-prompt.jsonl
    $V bench-serve \
        --server default-routing=http://127.0.0.1:8811/v1 --start "default-routing=$V serve --port 8811 $S" \
        --server prefix-affinity=http://127.0.0.1:8812/v1 --start "prefix-affinity=$V serve --port 8812 --prefix-affinity $S" \
        --workload $file --limit 16 --concurrency 4 --requests 16 --max-tokens 64 \
        --out benchmarks/results/$KIND/ray-replicas/affinity-$workload
done
