#!/usr/bin/env bash
# Coding-agent sessions through the server on a CPU machine, SmolLM2-135M and configs/default.yaml's small tiers:
# does an L3 slower than recomputing cost nothing, and does a fast one pay? (bench/RESULTS.md, 'The disk adds its
# bandwidth')
#
#   bash bench/cpu_agent.sh            # ARMS [nol3 l3slow l3shm nol3], results in $OUT [./out/cpu_agent]
#
# Arms: nol3 (GPU/host tiers only), l3slow (an L3 on the disk capped at SLOW_GBPS [0.01] GB/s each way, far
# below recompute speed), l3shm (an uncapped L3 on /dev/shm). The workload is AGENT_GEN [--sessions 6 --turns 4:4
# --context 600:1200 --seed 1], every session at once, 16-token answers, requests over MAX_CONTEXT [4000] tokens
# skipped (the default config's GPU pool holds 4,096); EXTRA [--host-tokens 4096] goes to every server (a host tier
# smaller than the sessions' contexts, so that they need the disk); a summary line per arm at the end.
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-./out}/cpu_agent
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OUT CONFIG=configs/default.yaml PYTHON=${PYTHON:-.venv/bin/python}
work=$OUT/workload
# shellcheck disable=SC2086  # AGENT_GEN is a list of flags
$PYTHON -m hicache.cli bench agent-gen ${AGENT_GEN:---sessions 6 --turns 4:4 --context 600:1200 --seed 1} \
  --out "$work" >"$OUT/workload.txt" 2>&1 || exit 1
port=8500 i=0
for arm in ${ARMS:-nol3 l3slow l3shm nol3}; do
  i=$((i + 1))
  case $arm in
    nol3) flags="--no-l3" ;;
    l3slow) rm -rf /tmp/hicache-l3-cpu; flags="--l3-path /tmp/hicache-l3-cpu --set cache.l3.read_limit_gbps=${SLOW_GBPS:-0.01} \
--set cache.l3.write_limit_gbps=${SLOW_GBPS:-0.01}" ;;
    l3shm) rm -rf /dev/shm/hicache-l3-cpu; flags="--l3-path /dev/shm/hicache-l3-cpu" ;;
    *) echo "unknown arm $arm (nol3 l3slow l3shm)"; continue ;;
  esac
  bash bench/gpu/serve_and_bench.sh "${arm}_$i" $((port + i)) "$flags ${EXTRA---host-tokens 4096}" \
    "$PYTHON -m hicache.cli bench agent $work --url \$URL --output-length 16 \
--max-context ${MAX_CONTEXT:-4000} --json $OUT/${arm}_$i.json" \
    >"$OUT/${arm}_$i.out" 2>&1
  rm -rf /tmp/hicache-l3-cpu /dev/shm/hicache-l3-cpu
done
$PYTHON - "$OUT" <<'PY'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
runs = sorted(out.glob("*_[0-9]*.json"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
base = [json.loads(p.read_text())["overall"] for p in runs if p.stem.startswith("nol3")]
ref = {k: sum(b[k] for b in base) / len(base) for k in ("duration_s",)} if base else None
ref_ttft = sum(b["ttft_ms"]["mean"] for b in base) / len(base) if base else None
for p in runs:
    o = json.loads(p.read_text())["overall"]
    hits = " ".join(f"{t} {100 * v:.1f}%" for t, v in o.get("cache_hit_rate_per_tier", {}).items())
    line = (f"{p.stem:10s} {o['duration_s']:7.2f} s  TTFT mean {o['ttft_ms']['mean']:8.1f} ms  requests "
            f"{o['requests']} errors {o['errors']} skipped {o['skipped_requests']}  hits {hits}")
    if ref:
        line += f"  / no L3 (mean of {len(base)}): duration {o['duration_s'] / ref['duration_s']:.3f}"
        line += f" TTFT mean {o['ttft_ms']['mean'] / ref_ttft:.3f}"
    print(line)
PY
