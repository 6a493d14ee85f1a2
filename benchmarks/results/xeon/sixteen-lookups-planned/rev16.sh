cd /work/main
V=.venv/bin/verispec
S='--threads 2 --max-batch-size 16 --max-context 2048'
$V bench-serve --server defaults-1=http://127.0.0.1:8702/v1 --start "defaults-1=$V serve --port 8702 $S" --server plain-1=http://127.0.0.1:8701/v1 --start "plain-1=$V serve --drafter none --port 8701 $S" --server defaults-2=http://127.0.0.1:8704/v1 --start "defaults-2=$V serve --port 8704 $S" --server plain-2=http://127.0.0.1:8703/v1 --start "plain-2=$V serve --drafter none --port 8703 $S" --workload chat --limit 16 --concurrency 16 --requests 48 --max-tokens 128 --out benchmarks/results/xeon/sixteen-lookups-planned/chat-defaults-first
echo DONE
