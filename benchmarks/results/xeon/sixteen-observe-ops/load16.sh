# 16 clients, 48 chat / HumanEval requests of 128 tokens: verispec serve defaults against --drafter none, two of each,
# alternated (plain first, then defaults first for chat), on the engine of 1dca851. Run from the repository root.
V=.venv/bin/verispec
S='--threads 2 --max-batch-size 16 --max-context 2048'
OUT=benchmarks/results/xeon/sixteen-observe-ops
run() {  # workload, out, then the servers in order as name:port:args
  W=$1; D=$2; shift 2; A=()
  for s in "$@"; do
    IFS=: read -r name port args <<< "$s"
    A+=(--server "$name=http://127.0.0.1:$port/v1" --start "$name=$V serve $args --port $port $S")
  done
  $V bench-serve "${A[@]}" --workload $W --limit 16 --concurrency 16 --requests 48 --max-tokens 128 --out $OUT/$D
}
run chat chat "plain-1:8701:--drafter none" "defaults-1:8702:" "plain-2:8703:--drafter none" "defaults-2:8704:"
run chat chat-defaults-first "defaults-1:8702:" "plain-1:8701:--drafter none" "defaults-2:8704:" "plain-2:8703:--drafter none"
run humaneval humaneval "plain-1:8701:--drafter none" "defaults-1:8702:" "plain-2:8703:--drafter none" "defaults-2:8704:"
echo DONE
