#!/usr/bin/env bash
# Tenth session's last call (about 5 minutes): the GEMM probe, the host arm with scheduler.admit_during_forward
# (8-token answers) against the default, and target 4 as the issue's example states it (64-token answers), GPU only
# and host. Results: $OUT/suite_session10b.tgz.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
timeout 120 python3 bench/gpu/gemm_probe.py --json "$out/gemm.json" 2>&1 | tee "$out/gemm.txt"
B="python3 -m hicache.cli bench multiturn --url \$URL --clients 32 --rounds 8 --request-length 1024"
GPU="--device-tokens 65536 --host-tokens 0 --no-l3"
HOST="--device-tokens 65536 --host-tokens 393216 --no-l3"
run() {  # name port serve-flags output-length
  timeout 170 bash bench/gpu/serve_and_bench.sh "$1" "$2" "$3 --step-log $out/$1.steps.jsonl" \
    "$B --output-length $4 --json \$OUT/$1.json" 2>&1 | grep -E "==|metrics"
}
run mt8_host 9101 "$HOST" 8
run mt8_host_admit 9102 "$HOST --set scheduler.admit_during_forward=true" 8
run mt64_gpu_only 9103 "$GPU" 64
run mt64_host 9104 "$HOST" 64
python3 bench/step_log_summary.py "$out"/mt*.steps.jsonl 2>&1 | grep -v "prefill steps of" | tee "$out/steps_summary.txt"
python3 - "$out" <<'PY' | tee "$out/ratios.txt"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("mt*.json"))}
for k, r in runs.items():
    o = r["overall"]
    t = o["ttft_ms"]
    hits = o.get("cache_hit_rate_per_tier", {})
    ref = runs.get("mt64_gpu_only") if k.startswith("mt64") else None
    ratio = f"  p50 / GPU only {t['p50'] / ref['overall']['ttft_ms']['p50']:.3f}" if ref else ""
    print(f"{k:16s} {o['duration_s']:6.2f} s  TTFT p50 {t['p50']:7.1f}  p90 {t['p90']:7.1f}  mean {t['mean']:7.1f} ms  "
          + " ".join("%s %.1f%%" % (tier, 100 * v) for tier, v in hits.items()) + ratio
          + "  per-round p50 " + ",".join("%.0f" % x["ttft_ms"]["p50"] for x in r["rounds"]))
PY
(cd "$out" && tar czf suite_session10b.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_session10b.tgz"
