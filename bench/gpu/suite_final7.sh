#!/usr/bin/env bash
# Seventh session, after the prefix kernel became the default: target 4's GPU-only and host + L3 arms in one call
# (their ratio from the same call), then target 6 (a prefix on L3 against recomputing it), since the kernel makes
# prefill faster and the cost model compares loading with prefilling. About 7 minutes.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
OUT_LEN=8 PACK=0 RUNS="gpu_only host_l3" timeout 260 bash bench/gpu/suite_multiturn.sh 2>&1 | grep -E "==|metrics"
L3R="python3 bench/gpu/l3_vs_recompute.py --url \$URL --prefix-tokens 8192 --evictors 6 --rounds 3"
SMALL="--device-tokens 16384 --host-tokens 16384 --disk-tokens 131072"
l3r() {  # name port serve-flags
  rm -rf /tmp/hicache-l3-r
  timeout 110 bash bench/gpu/serve_and_bench.sh "$1" "$2" "$3" "$L3R --json \$OUT/$1.json" 2>&1 |
    grep -E '^round|median|==|Error'
}
l3r l3r_off 8301 "--device-tokens 16384 --host-tokens 0 --no-l3"
l3r l3r_auto 8302 "$SMALL --l3-path /tmp/hicache-l3-r --load-mode auto"
l3r l3r_overlap 8303 "$SMALL --l3-path /tmp/hicache-l3-r --load-mode auto --load-overlap"
rm -rf /tmp/hicache-l3-r /tmp/hicache-l3
(cd "$out" && tar czf suite_final7.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_final7.tgz"
