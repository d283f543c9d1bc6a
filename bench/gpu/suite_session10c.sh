#!/usr/bin/env bash
# Tenth session's final call (about 5 minutes): the CUDA tests after this session's attention changes, then target 4
# with the startup objects frozen out of garbage collection (serve's gc.freeze): host + L3 (where a 179 ms full
# collection stalled the engine in call 5), GPU only and host. Results: $OUT/suite_session10c.tgz.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
timeout 240 python3 -m pytest -q tests/engine/test_engine_cuda.py tests/test_tiers.py tests/test_pinned.py \
  tests/engine/test_fused_ops.py 2>&1 | tail -3 | tee "$out/cuda_tests.txt"
B="python3 -m hicache.cli bench multiturn --url \$URL --clients 32 --rounds 8 --request-length 1024 --output-length 8"
run() {  # name port serve-flags
  timeout 170 bash bench/gpu/serve_and_bench.sh "$1" "$2" "$3 --step-log $out/$1.steps.jsonl" \
    "$B --json \$OUT/$1.json" 2>&1 | grep -E "==|metrics"
}
rm -rf /tmp/hicache-l3
run mt8_host_l3 9201 "--device-tokens 65536 --host-tokens 98304 --disk-tokens 245760 --l3-path /tmp/hicache-l3"
rm -rf /tmp/hicache-l3
run mt8_gpu_only 9202 "--device-tokens 65536 --host-tokens 0 --no-l3"
run mt8_host 9203 "--device-tokens 65536 --host-tokens 393216 --no-l3"
grep -h "gc.freeze\|froze" "$out"/*.server.log | tee "$out/freeze.txt"
grep -h "hicache_gc_" "$out"/*.metrics.txt | grep -v "^#" | tee "$out/gc_metrics.txt"
python3 bench/step_log_summary.py "$out"/mt*.steps.jsonl 2>&1 | grep -v "prefill steps of" | tee "$out/steps_summary.txt"
python3 - "$out" <<'PY' | tee "$out/ratios.txt"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("mt*.json"))}
base = runs["mt8_gpu_only"]["overall"]["ttft_ms"]
for k, r in runs.items():
    o = r["overall"]
    t = o["ttft_ms"]
    hits = o.get("cache_hit_rate_per_tier", {})
    print(f"{k:16s} {o['duration_s']:6.2f} s  TTFT p50 {t['p50']:7.1f}  p90 {t['p90']:7.1f}  mean {t['mean']:7.1f} ms  "
          + " ".join("%s %.1f%%" % (tier, 100 * v) for tier, v in hits.items())
          + f"  / GPU only: p50 {t['p50'] / base['p50']:.3f} mean {t['mean'] / base['mean']:.3f} p90 {t['p90'] / base['p90']:.3f}"
          + "  per-round p50 " + ",".join("%.0f" % x["ttft_ms"]["p50"] for x in r["rounds"]))
PY
(cd "$out" && tar czf suite_session10c.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_session10c.tgz"
