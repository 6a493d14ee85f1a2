#!/usr/bin/env bash
# The draft head (`--draft head`, built by `make head`) served against verispec's own plain server and its defaults
# (composite: the suffix index, then the 0.5B draft model), alone and behind the suffix index, in one run per
# workload. Written for results/<kind>/draft-head-served:
#   OUT=benchmarks/results/xeon/draft-head-served bash benchmarks/scripts/draft_head_served.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
source .venv/bin/activate
OUT=${OUT:?OUT must name the results folder}
V=verispec
S="--threads 2 --max-batch-size 16 --max-context 2048"
for workload in ${WORKLOADS:-humaneval chat code-edit}; do
  $V bench-serve \
    --server plain=http://127.0.0.1:8701/v1 --start "plain=$V serve --drafter none --port 8701 $S" \
    --server defaults=http://127.0.0.1:8702/v1 --start "defaults=$V serve --port 8702 $S" \
    --server composite-head=http://127.0.0.1:8703/v1 --start "composite-head=$V serve --draft head --port 8703 $S" \
    --server head=http://127.0.0.1:8704/v1 --start "head=$V serve --drafter draft-model --draft head --port 8704 $S" \
    --workload "$workload" --limit 16 --concurrency "${LEVELS:-1,4}" --requests "${REQUESTS:-8,16}" --max-tokens 128 \
    --out "$OUT/$workload" || true
done
