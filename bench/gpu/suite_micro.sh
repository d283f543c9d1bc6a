#!/usr/bin/env bash
# Issue 7 targets 1-3 in one device call, plus the CUDA tests and a first run of overlapped loading.
# 1: bench/transfer_bench.py (copier vs raw pinned copy); 2: bench/l3_bench.py (store and kvikio vs dd /
# parallel O_DIRECT); 3: bench/prefill_bench.py (engine vs bare PyTorch stack). Results packed in $OUT.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
python3 bench/transfer_bench.py --json "$out/transfer.json" 2>&1 | tail -12
python3 bench/prefill_bench.py --tokens 2048 8192 --json "$out/prefill.json" 2>&1 | tail -8
python3 bench/l3_bench.py --dir /tmp --page-bytes 8388608 --pages 256 --batch 32 --threads 8 --repeats 2 \
  --json "$out/l3.json" 2>&1 | tail -5
python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_tiers.py tests/engine/test_engine_cuda.py tests/l3/test_l3_roundtrip.py 2>&1 | tail -8
rm -rf /tmp/hicache-l3-o
bash bench/gpu/serve_and_bench.sh l3r_overlap 8310 \
  "--device-tokens 16384 --host-tokens 16384 --disk-tokens 131072 --l3-path /tmp/hicache-l3-o --load-overlap" \
  "python3 bench/gpu/l3_vs_recompute.py --url \$URL --prefix-tokens 8192 --evictors 6 --json \$OUT/l3r_overlap.json" \
  2>&1 | grep -E '"ttft_s"|==|Error|error' | head -20
(cd "$out" && tar czf suite_micro.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_micro.tgz"
