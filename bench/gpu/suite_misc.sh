#!/usr/bin/env bash
# Issue 7 targets 5 and 6, on one H200 with Llama-3.1-8B shapes.
# 5: no reuse: single-turn random prompts (2k in / 256 out x 32, and 32k in / 8 out x 8), all tiers on vs off.
# 6: a prefix on L3 vs recomputing it: auto (cost model), auto + overlap, tiers off (always-load with ALWAYS=1).
set -u
cd "$(dirname "$0")/../.."
nr() {  # name port serve-flags clients in out
  bash bench/gpu/serve_and_bench.sh "$1" "$2" "$3" \
    "python3 -m hicache.cli bench multiturn --url \$URL --clients $4 --rounds 1 --request-length $5 --output-length $6 --seed 7 --json \$OUT/$1.json" 2>&1 | tail -4
}
ON="--device-tokens 262144 --host-tokens 393216 --disk-tokens 196608 --l3-path /tmp/hicache-l3-nr"
OFF="--device-tokens 262144 --host-tokens 0 --no-l3"
rm -rf /tmp/hicache-l3-nr
nr nr2k_off 8201 "$OFF" 32 2048 256
nr nr2k_on 8202 "$ON" 32 2048 256
rm -rf /tmp/hicache-l3-nr  # all on, but host -> disk write_through_selective: only pages hit at least once go to disk
sed 's/host_to_disk: write_through$/host_to_disk: write_through_selective/' configs/h200-llama8b.yaml >/tmp/h200-sel.yaml
CONFIG=/tmp/h200-sel.yaml nr nr2k_sel 8205 "$ON" 32 2048 256
rm -rf /tmp/hicache-l3-nr
nr nr32k_off 8203 "$OFF" 8 32768 8
nr nr32k_on 8204 "$ON" 8 32768 8
rm -rf /tmp/hicache-l3-nr
L3R="python3 bench/gpu/l3_vs_recompute.py --url \$URL --prefix-tokens 8192 --evictors 6 --rounds 3"
SMALL="--device-tokens 16384 --host-tokens 16384 --disk-tokens 131072"
l3r() {  # name port serve-flags
  rm -rf /tmp/hicache-l3-r
  bash bench/gpu/serve_and_bench.sh "$1" "$2" "$3" "$L3R --json \$OUT/$1.json" 2>&1 | grep -E '^round|median|==|Error'
}
l3r l3r_off 8301 "--device-tokens 16384 --host-tokens 0 --no-l3"
l3r l3r_auto 8302 "$SMALL --l3-path /tmp/hicache-l3-r --load-mode auto"
l3r l3r_overlap 8303 "$SMALL --l3-path /tmp/hicache-l3-r --load-mode auto --load-overlap"
[ "${ALWAYS:-0}" = 1 ] && l3r l3r_always 8304 "$SMALL --l3-path /tmp/hicache-l3-r --load-mode always"
# the device returns at most 8 files: pack every result, metrics and log file of this suite into one archive
out=${OUT:-/tmp}
(cd "$out" && tar czf suite_misc.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_misc.tgz"
