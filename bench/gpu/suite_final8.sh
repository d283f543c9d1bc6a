#!/usr/bin/env bash
# Target 4 with this session's defaults (launch_loads_after_forward on), in one device call (about 8 minutes):
# a whole GPU-only run as warm-up (the GPU ran 8-10% slower for the first minutes of a call: bench/RESULTS.md,
# eighth session), then GPU only and host alternated twice so each host run has a neighbouring baseline, then
# host + L3. Step logs and a ratio table; results: $OUT/suite_final8.tgz.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
B="python3 -m hicache.cli bench multiturn --url \$URL --clients 32 --rounds 8 --request-length 1024 --output-length 8"
run() {  # name port serve-flags (host runs pinned 48 GiB before the port opened: ~35 s before tiers/pinned.py, ~2 s since)
  timeout 150 bash bench/gpu/serve_and_bench.sh "$1" "$2" "$3 ${EXTRA:-} --step-log $out/$1.steps.jsonl" \
    "$B --json \$OUT/$1.json" 2>&1 | grep -E "==|metrics"
}
# SM clock, temperature and power every 2 s: does the early slowness follow the clocks?
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu --format=csv \
  -l 2 >"$out/gpu_clocks.csv" 2>/dev/null &
smi=$!
GPU="--device-tokens 65536 --host-tokens 0 --no-l3"
HOST="--device-tokens 65536 --host-tokens 393216 --no-l3"
run warmup_gpu_only 8701 "$GPU"
run mt8_gpu_only_1 8702 "$GPU"
run mt8_host_1 8703 "$HOST"
if [ "${PAIRS:-2}" -ge 2 ]; then  # PAIRS=1: one pair (the ninth session's final call, with tests before it)
  run mt8_gpu_only_2 8704 "$GPU"
  run mt8_host_2 8705 "$HOST"
fi
rm -rf /tmp/hicache-l3
run mt8_host_l3 8706 "--device-tokens 65536 --host-tokens 98304 --disk-tokens 245760 --l3-path /tmp/hicache-l3"
rm -rf /tmp/hicache-l3
kill $smi 2>/dev/null
python3 bench/step_log_summary.py "$out"/*.steps.jsonl 2>&1 | tee "$out/steps_summary.txt"
python3 - "$out" <<'PY' | tee "$out/ratios.txt"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
base = {k: r["overall"]["ttft_ms"]["p50"] for k, r in runs.items() if k.startswith("mt8_gpu_only")}
for k, r in runs.items():
    o = r["overall"]
    t = o["ttft_ms"]
    hits = o.get("cache_hit_rate_per_tier", {})
    print(f"{k:18s} {o['duration_s']:6.2f} s  TTFT p50 {t['p50']:7.1f}  p90 {t['p90']:7.1f}  mean {t['mean']:7.1f} ms  "
          "hits " + " ".join("%s %.1f%%" % (tier, 100 * v) for tier, v in hits.items()) + "  p50 / "
          + " / ".join("%s %.3f" % (b[-1], t["p50"] / v) for b, v in base.items())
          + "  per-round p50 " + ",".join("%.0f" % x["ttft_ms"]["p50"] for x in r["rounds"]))
PY
(cd "$out" && tar czf suite_final8.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_final8.tgz"
