#!/usr/bin/env bash
# Issue 13's benchmark: the same 2 cores as 1 replica x 2 threads or 2 replicas x 1 thread on Ray Serve,
# with the single-process server (no Ray) beside them, at 1, 4 and 8 streaming clients, in one run.
# Each server is started fresh for each of its turns (bench-serve --start) and stopped after it.
#   bash benchmarks/scripts/ray-replicas/run.sh    # needs `make models` (the ray extra included)
set -euo pipefail
cd "$(dirname "$0")/../../.."
V=.venv/bin/verispec
KIND=${MACHINE_KIND:-$(.venv/bin/python -c 'from verispec.bench.machine import machine_kind; print(machine_kind())')}
S="--drafter none --max-batch-size 16 --max-context 2048"
$V bench-serve \
    --server ray-1x2=http://127.0.0.1:8801/v1 --start "ray-1x2=$V serve --replicas 1 --threads 2 --port 8801 $S" \
    --server ray-2x1=http://127.0.0.1:8802/v1 --start "ray-2x1=$V serve --replicas 2 --threads 2 --port 8802 $S" \
    --server single-2=http://127.0.0.1:8803/v1 --start "single-2=$V serve --threads 2 --port 8803 $S" \
    --workload humaneval --limit 8 --concurrency 1,4,8 --requests 3,8,8 --max-tokens 128 \
    --out benchmarks/results/$KIND/ray-replicas/throughput
