#!/usr/bin/env bash
# scheduler.admit_during_forward on the H200, in one device call (about 7 minutes):
#   1. the copier's CUDA tests (fenced loads and backups);
#   2. a throwaway warm-up server run (the first run on a fresh machine is 13-16% slower: bench/RESULTS.md);
#   3. target 4's multi-turn run: GPU only, the host tier with launch_loads_after_forward alone and with
#      admit_during_forward too, GPU only again (the baseline's drift within the call), then host + L3 with both.
# Each server writes a step log; the summary goes to steps_summary.txt. Results: $OUT/suite_admit.tgz.
# EXTRA: more serve flags for every run.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
timeout 120 python3 -m pytest -q tests/test_tiers.py 2>&1 | tail -3 | tee "$out/cuda_tests.txt"
B="python3 -m hicache.cli bench multiturn --url \$URL --clients 32 --rounds 8 --request-length 1024 --output-length 8"
timeout 90 bash bench/gpu/serve_and_bench.sh warmup 8601 "--device-tokens 65536 --host-tokens 0 --no-l3" \
  "python3 -m hicache.cli bench multiturn --url \$URL --clients 16 --rounds 2 --request-length 1024 \
   --output-length 8 --json \$OUT/warmup.json" 2>&1 | grep "=="
run() {  # name port serve-flags (host runs pinned 48 GiB before the port opened: ~35 s before tiers/pinned.py, ~2 s since)
  timeout 150 bash bench/gpu/serve_and_bench.sh "$1" "$2" "$3 ${EXTRA:-} --step-log $out/$1.steps.jsonl" \
    "$B --json \$OUT/$1.json" 2>&1 | grep -E "==|metrics"
}
LATER="--set scheduler.launch_loads_after_forward=true --set scheduler.admit_during_forward=false"
AHEAD="--set scheduler.launch_loads_after_forward=true --set scheduler.admit_during_forward=true"
run mt8_gpu_only 8602 "--device-tokens 65536 --host-tokens 0 --no-l3"
run mt8_host_later 8603 "--device-tokens 65536 --host-tokens 393216 --no-l3 $LATER"
run mt8_host_ahead 8604 "--device-tokens 65536 --host-tokens 393216 --no-l3 $AHEAD"
run mt8_gpu_only_2 8605 "--device-tokens 65536 --host-tokens 0 --no-l3"
rm -rf /tmp/hicache-l3
run mt8_host_l3_ahead 8606 "--device-tokens 65536 --host-tokens 98304 --disk-tokens 245760 --l3-path /tmp/hicache-l3 $AHEAD"
rm -rf /tmp/hicache-l3
python3 bench/step_log_summary.py "$out"/*.steps.jsonl 2>&1 | tee "$out/steps_summary.txt"
python3 - "$out" <<'PY' | tee "$out/ratios.txt"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
runs = {p.stem: json.loads(p.read_text())["overall"] for p in sorted(out.glob("mt8_*.json"))}
base = [r["ttft_ms"]["p50"] for k, r in runs.items() if k.startswith("mt8_gpu_only")]
for k, r in runs.items():
    t = r["ttft_ms"]
    print(f"{k:20s} {r['duration_s']:6.2f} s  TTFT p50 {t['p50']:7.1f}  p90 {t['p90']:7.1f}  mean {t['mean']:7.1f} ms  "
          "p50 / GPU-only runs: " + " / ".join("%.3f" % (t["p50"] / b) for b in base))
PY
(cd "$out" && tar czf suite_admit.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_admit.tgz"
