#!/usr/bin/env bash
# `verispec serve`'s defaults at two commits against its own plain server, in one run: OLD names the older
# commit's `verispec` (e.g. a clean clone's .venv/bin/verispec after `make models` there), NAME its label, OUT the
# folder, WORKLOADS / LEVELS / REQUESTS what to run. Written for results/xeon/defaults-before-after-deep-fix:
#   OLD=/tmp/ci-clone/.venv/bin/verispec NAME=defaults-1cb5055 OUT=benchmarks/results/xeon/deep-position-fix-ab \
#     bash benchmarks/scripts/before_after_served.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
source .venv/bin/activate
: "${OLD:?OLD must name the verispec executable of the older commit}"
NAME=${NAME:-defaults-before}
OUT=${OUT:?OUT must name the results folder}
V=verispec
S="--threads 2 --max-batch-size 16 --max-context 2048"
for workload in ${WORKLOADS:-humaneval chat}; do
  requests=${REQUESTS:-4,16}
  [ "$workload" = chat ] && requests=${CHAT_REQUESTS:-8,16}
  $V bench-serve \
    --server verispec-plain=http://127.0.0.1:8701/v1 --start "verispec-plain=$V serve --drafter none --port 8701 $S" \
    --server "$NAME=http://127.0.0.1:8703/v1" --start "$NAME=$OLD serve --port 8703 $S" \
    --server defaults-after=http://127.0.0.1:8702/v1 --start "defaults-after=$V serve --port 8702 $S" \
    --workload "$workload" --limit 16 --concurrency "${LEVELS:-1,16}" --requests "$requests" --max-tokens 128 \
    --out "$OUT/$workload" || true
done
