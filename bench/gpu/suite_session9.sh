#!/usr/bin/env bash
# Ninth session, one device call (about 7 minutes): the CUDA tier tests (with the new pinned allocation), the
# pinning bench, then target 4 as the issue's example states it, 64-token answers (the fifth to eighth sessions ran
# 8), GPU only and host, after a whole GPU-only warm-up; and the 8-token host arm once more with the new host-pool
# allocation. Server logs carry the pinning time. Results: $OUT/suite_session9.tgz.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
timeout 150 python3 -m pytest -q tests/test_pinned.py tests/test_tiers.py 2>&1 | tail -3 | tee "$out/cuda_tests.txt"
timeout 120 python3 bench/gpu/pin_bench.py --gib 16 --threads 1,8,16 --json "$out/pin.json" 2>&1 | tee "$out/pin.txt"
B="python3 -m hicache.cli bench multiturn --url \$URL --clients 32 --rounds 8 --request-length 1024"
GPU="--device-tokens 65536 --host-tokens 0 --no-l3"
HOST="--device-tokens 65536 --host-tokens 393216 --no-l3"
run() {  # name port serve-flags output-length
  local t0=$(date +%s)
  timeout 170 bash bench/gpu/serve_and_bench.sh "$1" "$2" "$3 --step-log $out/$1.steps.jsonl" \
    "$B --output-length $4 --json \$OUT/$1.json" 2>&1 | grep -E "==|metrics"
  echo "$1: $(( $(date +%s) - t0 )) s wall, server start included" | tee -a "$out/wall.txt"
}
run warmup_gpu_only 8901 "$GPU" 8
run mt64_gpu_only 8902 "$GPU" 64
run mt64_host 8903 "$HOST" 64
run mt8_host 8904 "$HOST" 8
grep -h "pinned\|pinning" "$out"/*.server.log | tee "$out/pinning.txt"
python3 bench/step_log_summary.py "$out"/mt*.steps.jsonl 2>&1 | tee "$out/steps_summary.txt"
python3 - "$out" <<'PY' | tee "$out/ratios.txt"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.stem not in ("pin",)}
base = {"mt64": runs.get("mt64_gpu_only")}  # the warm-up is no baseline: a first run is slow
for k, r in runs.items():
    o = r["overall"]
    t = o["ttft_ms"]
    ref = base.get(k[:4])
    ratio = f"p50 / GPU only {t['p50'] / ref['overall']['ttft_ms']['p50']:.3f}" if ref else ""
    hits = o.get("cache_hit_rate_per_tier", {})
    print(f"{k:16s} {o['duration_s']:6.2f} s  TTFT p50 {t['p50']:7.1f}  p90 {t['p90']:7.1f}  mean {t['mean']:7.1f} ms  "
          + " ".join("%s %.1f%%" % (tier, 100 * v) for tier, v in hits.items()) + f"  {ratio}  per-round p50 "
          + ",".join("%.0f" % x["ttft_ms"]["p50"] for x in r["rounds"]))
PY
(cd "$out" && tar czf suite_session9.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_session9.tgz"
