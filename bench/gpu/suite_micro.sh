#!/usr/bin/env bash
# Issue 7 targets 1-3 in one device call, plus the CUDA tests.
# 1: bench/transfer_bench.py (copier vs raw pinned copy); 2: bench/l3_bench.py (store paths and kvikio into GPU vs
# dd / parallel O_DIRECT, with one and with four sync groups per call); 3: bench/prefill_bench.py (engine vs bare
# PyTorch stack, with a kernel profile). Results packed into $OUT/suite_micro.tgz.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
[ "${SKIP_TRANSFER:-0}" = 1 ] || python3 bench/transfer_bench.py --json "$out/transfer.json" 2>&1 | tail -12
python3 bench/prefill_bench.py --tokens 2048 8192 --profile --json "$out/prefill.json" 2>&1 | tail -60
for batch in 32 128; do
  python3 bench/l3_bench.py --dir /tmp --page-bytes 8388608 --pages 256 --batch $batch --threads 8 --repeats 2 \
    --backends posix kvikio --json "$out/l3_b$batch.json" 2>&1 | tail -9
done
python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_tiers.py tests/engine/test_engine_cuda.py \
  tests/l3/test_l3_roundtrip.py 2>&1 | tail -8
(cd "$out" && tar czf suite_micro.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_micro.tgz"
