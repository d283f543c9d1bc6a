#!/usr/bin/env bash
# Tenth session (about 3-5 minutes a call): where the host arm's small prefill steps lose time. Target 4's 8-token
# workload: a GPU-only run (its step log is the baseline), the host arm with the step log's timings (enqueue_ms,
# enqueue_cpu_ms, gc_ms, gpu_ms, wait_ms); with TRACE=FIRST:COUNT the host arm again under --trace-gpu for those
# steps (late rounds, where the GPU pool is full), summarised by bench/gpu/trace_summary.py; with OMP1=1 the host
# arm again with one OpenMP thread.
# Results: $OUT/suite_session10.tgz.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
B="python3 -m hicache.cli bench multiturn --url \$URL --clients 32 --rounds 8 --request-length 1024 --output-length 8"
GPU="--device-tokens 65536 --host-tokens 0 --no-l3"
HOST="--device-tokens 65536 --host-tokens 393216 --no-l3"
run() {  # name port serve-flags
  timeout 170 bash bench/gpu/serve_and_bench.sh "$1" "$2" "$3 ${EXTRA:-} --step-log $out/$1.steps.jsonl" \
    "$B --json \$OUT/$1.json" 2>&1 | grep -E "==|metrics"
}
run mt8_gpu_only 9001 "$GPU"
run mt8_host 9002 "$HOST"
if [ -n "${TRACE:-}" ]; then  # call 1: a profiler window of the host arm
  run mt8_host_traced 9003 "$HOST --trace-gpu $out/host.trace.json --trace-steps $TRACE"
  python3 bench/gpu/trace_summary.py "$out/host.trace.json" 2>&1 | tee "$out/trace_summary.txt"
  gzip -f "$out/host.trace.json"
fi
if [ -n "${OMP1:-}" ]; then  # the host arm with one OpenMP / MKL thread: do idle worker threads take the cores?
  OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 run mt8_host_omp1 9004 "$HOST"
fi
python3 bench/step_log_summary.py "$out"/*.steps.jsonl 2>&1 | tee "$out/steps_summary.txt"
python3 - "$out" <<'PY' | tee "$out/ratios.txt"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("mt8*.json"))}
base = runs["mt8_gpu_only"]["overall"]["ttft_ms"]["p50"]
for k, r in runs.items():
    o = r["overall"]
    t = o["ttft_ms"]
    hits = o.get("cache_hit_rate_per_tier", {})
    print(f"{k:16s} {o['duration_s']:6.2f} s  TTFT p50 {t['p50']:7.1f}  p90 {t['p90']:7.1f}  mean {t['mean']:7.1f} ms  "
          + " ".join("%s %.1f%%" % (tier, 100 * v) for tier, v in hits.items()) + f"  p50 / GPU only {t['p50'] / base:.3f}"
          + "  per-round p50 " + ",".join("%.0f" % x["ttft_ms"]["p50"] for x in r["rounds"]))
PY
(cd "$out" && tar czf suite_session10.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_session10.tgz"
