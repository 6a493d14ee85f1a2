set -u
cd /work/main
V=.venv/bin/verispec
S="--threads 2 --max-batch-size 16 --max-context 2048"
for w in humaneval chat code-edit; do
$V bench-serve \
 --server plain=http://127.0.0.1:8701/v1 --start "plain=$V serve --drafter none --port 8701 $S" \
 --server head-run3=http://127.0.0.1:8702/v1 --start "head-run3=$V serve --draft /tmp/dh/head-run3.safetensors --port 8702 $S" \
 --server defaults=http://127.0.0.1:8703/v1 --start "defaults=$V serve --port 8703 $S" \
 --server llama.cpp-plain=http://127.0.0.1:8704/v1 --start "llama.cpp-plain=SLOTS=16 benchmarks/scripts/peers/serve_llama_cpp.sh plain 8704" \
 --workload $w --limit 16 --concurrency 1 --requests 8 --max-tokens 128 --out benchmarks/results/xeon/draft-head-run4-served/$w || true
done
echo DONE
