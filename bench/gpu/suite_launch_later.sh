#!/usr/bin/env bash
# scheduler.launch_loads_after_forward on the H200, in one device call (about 9 minutes):
#   0. how fast 8 GiB of host memory pins, as the host pool does it and by parallel cudaHostRegister
#      (bench/gpu/pin_bench.py: startup spent 28-36 s pinning a 48 GiB host pool);
#   1. the copier's CUDA tests (the fence: a load started after a fence skips compute queued after it);
#   2. a throwaway warm-up server run (the first run on a fresh machine is 13-16% slower: bench/RESULTS.md,
#      seventh session);
#   3. target 4's multi-turn run: GPU only, then the host tier with the setting off and on, then host + L3
#      (12 GiB host, 30 GiB L3), where queued requests' L3 prefetches now go to the front of the queue.
# Results: $OUT/suite_launch_later.tgz.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
[ -n "${PIN:-}" ] && timeout 90 python3 bench/gpu/pin_bench.py --gib 8 --json "$out/pin.json" 2>&1 | tail -5
timeout 120 python3 -m pytest -q tests/test_tiers.py 2>&1 | tail -3 | tee "$out/cuda_tests.txt"
B="python3 -m hicache.cli bench multiturn --url \$URL --clients 32 --rounds 8 --request-length 1024 --output-length 8"
timeout 90 bash bench/gpu/serve_and_bench.sh warmup 8501 "--device-tokens 65536 --host-tokens 0 --no-l3" \
  "python3 -m hicache.cli bench multiturn --url \$URL --clients 16 --rounds 2 --request-length 1024 \
   --output-length 8 --json \$OUT/warmup.json" 2>&1 | grep "=="
run() {  # name port serve-flags (host runs pinned 48 GiB before the port opened: ~35 s before tiers/pinned.py, ~2 s since); a step log each
  timeout 150 bash bench/gpu/serve_and_bench.sh "$1" "$2" "$3 --step-log $out/$1.steps.jsonl" \
    "$B --json \$OUT/$1.json" 2>&1 | grep -E "==|metrics"
}
run mt8_gpu_only 8502 "--device-tokens 65536 --host-tokens 0 --no-l3"
run mt8_host_now 8503 "--device-tokens 65536 --host-tokens 393216 --no-l3"
run mt8_host_later 8504 "--device-tokens 65536 --host-tokens 393216 --no-l3 \
  --set scheduler.launch_loads_after_forward=true"
rm -rf /tmp/hicache-l3  # host + L3 with prefetch room going to the front of the queue (seventh session's change)
run mt8_host_l3 8505 "--device-tokens 65536 --host-tokens 98304 --disk-tokens 245760 --l3-path /tmp/hicache-l3"
rm -rf /tmp/hicache-l3
python3 bench/step_log_summary.py "$out"/*.steps.jsonl 2>&1 | tee "$out/steps_summary.txt"
(cd "$out" && tar czf suite_launch_later.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_launch_later.tgz"
