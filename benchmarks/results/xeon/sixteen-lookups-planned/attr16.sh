cd /work/main
V=.venv/bin/verispec
S='--threads 2 --max-batch-size 16 --max-context 2048'
$V bench-serve --server plain=http://127.0.0.1:8701/v1 --start "plain=$V serve --drafter none --port 8701 $S" \
 --server suffix-only=http://127.0.0.1:8702/v1 --start "suffix-only=$V serve --drafter suffix-index --port 8702 $S" \
 --server head-only=http://127.0.0.1:8703/v1 --start "head-only=$V serve --drafter draft-model --draft head --port 8703 $S" \
 --server defaults-k0=http://127.0.0.1:8704/v1 --start "defaults-k0=$V serve --k 0 --port 8704 $S" \
 --server defaults=http://127.0.0.1:8705/v1 --start "defaults=$V serve --port 8705 $S" \
 --workload chat --limit 16 --concurrency 16 --requests 48 --max-tokens 128 --out /tmp/s29/attr16
echo DONE
