#!/usr/bin/env bash
# Issue 7 targets 4 and 5 through the server in one device call (the fourth GPU session's final code):
# multi-turn 32 x 8 x 1024 with 8-token answers (GPU only vs host tier), then no-reuse 2k/256 x 32 and
# 32k/8 x 8 with all tiers on (16 GiB host + 24 GiB L3, deferred write-through) vs off.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
OUT_LEN=8 RUNS="gpu_only host" PACK=0 bash bench/gpu/suite_multiturn.sh
nr() {  # name port serve-flags clients in out
  bash bench/gpu/serve_and_bench.sh "$1" "$2" "$3" \
    "python3 -m hicache.cli bench multiturn --url \$URL --clients $4 --rounds 1 --request-length $5 --output-length $6 --seed 7 --json \$OUT/$1.json" 2>&1 | tail -4
}
ON="--device-tokens 262144 --host-tokens 131072 --disk-tokens 196608 --l3-path /tmp/hicache-l3-nr"
OFF="--device-tokens 262144 --host-tokens 0 --no-l3"
rm -rf /tmp/hicache-l3-nr
nr nr2k_off 8201 "$OFF" 32 2048 256
nr nr2k_on 8202 "$ON" 32 2048 256
rm -rf /tmp/hicache-l3-nr
nr nr32k_off 8203 "$OFF" 8 32768 8
nr nr32k_on 8204 "$ON" 8 32768 8
rm -rf /tmp/hicache-l3-nr
(cd "$out" && tar czf suite_t45.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_t45.tgz"
