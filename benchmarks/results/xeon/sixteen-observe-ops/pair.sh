cd "$(git rev-parse --show-toplevel)"
# One served pair (or more: MODES) of 16 clients x 48 chat requests, each server under steplog_serve.py (every scheduler
# step timed, its parts too; SIGUSR1 dumps the log to $OUT/steps-MODE-R.json), with the server threads CPU seconds and
# minor faults read from /proc before and after. OUT=/tmp/pairs R=0 MODES="plain defaults" bash pair.sh
OUT=${OUT:-/tmp/pairs}; mkdir -p $OUT
V=.venv/bin/verispec
S='--threads 2 --max-batch-size 16 --max-context 2048'
R=${R:-0}
for mode in ${MODES:-plain defaults}; do
  case $mode in plain) A="--drafter none"; X="";; defaults) A=""; X="";; noop) A=""; X="NOOP_OBSERVE=1";; clone) A=""; X="CLONE_OBSERVE=1";; esac
  env $ENVV $X STEPLOG=$OUT/steps-$mode-$R.json .venv/bin/python benchmarks/results/xeon/sixteen-observe-ops/steplog_serve.py $A --port 8709 $S > $OUT/serve-$mode-$R.log 2>&1 &
  PID=$!
  until curl -s localhost:8709/health >/dev/null 2>&1; do sleep 1; done
  sleep 2
  for t in /proc/$PID/task/*; do echo "   $(basename $t) $(awk '{print ($14+$15)/100, $14/100, $15/100, "minflt", $10}' $t/stat)"; done > $OUT/threads-$mode-$R.before
  $V bench-serve --server $mode=http://127.0.0.1:8709/v1 --workload ${W:-chat} --limit 16 --concurrency 16 --requests 48 --max-tokens 128 --out $OUT/bs-$mode-$R 2>&1 | grep "tok/s" | tail -1
  kill -USR1 $PID; sleep 2
  for t in /proc/$PID/task/*; do echo "   $(basename $t) $(awk '{print ($14+$15)/100, $14/100, $15/100, "minflt", $10}' $t/stat)"; done > $OUT/threads-$mode-$R.txt
  kill $PID; wait $PID 2>/dev/null
done
