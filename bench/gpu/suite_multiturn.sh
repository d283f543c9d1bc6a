#!/usr/bin/env bash
# Issue 7 target 4: multi-turn TTFT, GPU-only vs host tier vs host + L3, Llama-3.1-8B shapes on one H200.
# 32 clients x 8 rounds x (1024 + 64) tokens ~ 278k tokens ~ 36 GB of KV; GPU KV capped at 65,536 tokens (8 GiB),
# so the working set is 4.25x the GPU pool. Results: $OUT/mt_*.json (client) and $OUT/mt_*.metrics.txt.
set -u
cd "$(dirname "$0")/../.."
B="python3 -m hicache.cli bench multiturn --url \$URL --clients 32 --rounds 8 --request-length 1024 --output-length 64"
run() { bash bench/gpu/serve_and_bench.sh "$1" "$2" "$3" "$B --json \$OUT/$1.json" 2>&1 | tail -${4:-6}; }
rm -rf /tmp/hicache-l3
run mt_gpu_only 8101 "--device-tokens 65536 --host-tokens 0 --no-l3"
run mt_host 8102 "--device-tokens 65536 --host-tokens 393216 --no-l3"
run mt_host_l3 8103 "--device-tokens 65536 --host-tokens 98304 --disk-tokens 245760 --l3-path /tmp/hicache-l3" 14
# the device returns at most 8 files: pack every result, metrics and log file of this suite into one archive
out=${OUT:-/tmp}
(cd "$out" && tar czf suite_multiturn.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_multiturn.tgz"
