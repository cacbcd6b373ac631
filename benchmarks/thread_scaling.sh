#!/usr/bin/env bash
# Thread scaling on one multicore machine, in one run: the decode roofline
# (read bandwidth and FMA / dot-product peaks measured at each thread count)
# and prefill against torch, at 1 to all cores. Builds the extension in place
# first (no install needed). Results go to $OUT (default: benchmarks/out).
#
#   bash benchmarks/thread_scaling.sh            (THREADS=1,2,4,8,16 to choose)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
cores="$(nproc)"
THREADS="${THREADS:-$(python3 -c "n=$cores; print(','.join(str(t) for t in (1, 2, 4, 8, 16, 32, 64) if t <= n))")}"
echo "== $(grep -m1 'model name' /proc/cpuinfo || true); $cores CPUs; threads $THREADS"
python3 setup.py build_ext --inplace -q 2>&1 | grep -v "^warning\|^$" || true
python3 -c "import sdpa; sdpa.show_config()"
echo "== decode roofline"
python3 -m sdpa.bench --roofline --shapes decode-gqa-32k --threads "$THREADS" --no-progress \
    --cache-dtypes float32,bfloat16,int8+iqk+ipv,int4:32+iqk+ipv --json "$OUT/roofline-threads.json"
echo "== prefill"
python3 -m sdpa.bench --impls sdpa,torch --threads "$THREADS" --no-progress --min-time 0.2 --error-rows 0 \
    --shapes bert-base,1k,gqa-2k,2k-causal-e128 --json "$OUT/prefill-threads.json"
