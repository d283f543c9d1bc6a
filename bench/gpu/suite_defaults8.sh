#!/usr/bin/env bash
# Target 4's host arm with every default of the end of the eighth session (launch_loads_after_forward on, the TMA
# prefix-kernel shape), in one short device call (about 4 minutes): a short GPU-only warm-up (first-process
# costs), then GPU only and host, each with a step log. Results: $OUT/suite_defaults8.tgz.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
B="python3 -m hicache.cli bench multiturn --url \$URL --clients 32 --rounds 8 --request-length 1024 --output-length 8"
GPU="--device-tokens 65536 --host-tokens 0 --no-l3"
timeout 70 bash bench/gpu/serve_and_bench.sh warmup 8801 "$GPU" \
  "python3 -m hicache.cli bench multiturn --url \$URL --clients 32 --rounds 3 --request-length 1024 \
   --output-length 8 --json \$OUT/warmup.json" 2>&1 | grep "=="
run() {
  timeout 120 bash bench/gpu/serve_and_bench.sh "$1" "$2" "$3 --step-log $out/$1.steps.jsonl" \
    "$B --json \$OUT/$1.json" 2>&1 | grep -E "==|metrics"
}
run mt8_gpu_only 8802 "$GPU"
run mt8_host 8803 "--device-tokens 65536 --host-tokens 393216 --no-l3"
python3 bench/step_log_summary.py "$out"/*.steps.jsonl 2>&1 | tee "$out/steps_summary.txt"
python3 - "$out" <<'PY' | tee "$out/ratios.txt"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
runs = {p.stem: json.loads(p.read_text())["overall"] for p in sorted(out.glob("mt8_*.json"))}
base = runs["mt8_gpu_only"]["ttft_ms"]["p50"]
for k, o in runs.items():
    t = o["ttft_ms"]
    print(f"{k:14s} {o['duration_s']:6.2f} s  TTFT p50 {t['p50']:7.1f}  p90 {t['p90']:7.1f}  mean {t['mean']:7.1f} ms  "
          f"p50 / GPU only {t['p50'] / base:.3f}")
PY
(cd "$out" && tar czf suite_defaults8.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_defaults8.tgz"
