#!/usr/bin/env bash
# Decode speed on the GPU: CUDA tests of the decode kernel and graphs, the engine smoke test with and without graphs
# (same greedy outputs expected), and bench/decode_bench.py (reference vs kernel vs graphs). Results in $OUT.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
python3 -m pytest -q -m cuda -p no:cacheprovider tests/engine/test_decode_kernel.py tests/engine/test_engine_cuda.py \
  2>&1 | tail -8
for graphs in 0 6; do
  python3 bench/engine_sched_smoke.py --device cuda --page-size 16 --graphs $graphs 2>&1 | tail -1
done
python3 bench/decode_bench.py --batch-sizes ${BATCHES:-1,8,32} --contexts ${CONTEXTS:-1024,8192} \
  --json "$out/decode.json" 2>&1 | tail -12
