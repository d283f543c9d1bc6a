#!/usr/bin/env bash
# Issue 7 target 4: multi-turn TTFT, GPU-only vs host tier vs host + L3, Llama-3.1-8B shapes on one H200.
# 32 clients x 8 rounds x (1024 + OUT_LEN) tokens ~ 264k-278k tokens ~ 33-36 GB of KV; GPU KV capped at 65,536 tokens
# (8 GiB), so the working set is over 4x the GPU pool. OUT_LEN (default 64) sets the answer length; RUNS picks runs
# (default: gpu_only host host_l3). Results: $OUT/mt<OUT_LEN>_<run>.{json,metrics.txt,server.log}, packed at the end.
set -u
cd "$(dirname "$0")/../.."
n=${OUT_LEN:-64}
B="python3 -m hicache.cli bench multiturn --url \$URL --clients 32 --rounds 8 --request-length 1024 --output-length $n"
run() { bash bench/gpu/serve_and_bench.sh "mt${n}_$1" "$2" "$3" "$B --json \$OUT/mt${n}_$1.json" 2>&1 | tail -${4:-6}; }
for r in ${RUNS:-gpu_only host host_l3}; do
  case $r in
    gpu_only) run gpu_only 8101 "--device-tokens 65536 --host-tokens 0 --no-l3" ;;
    host) run host 8102 "--device-tokens 65536 --host-tokens 393216 --no-l3" ;;
    host_l3) rm -rf /tmp/hicache-l3
      run host_l3 8103 "--device-tokens 65536 --host-tokens 98304 --disk-tokens 245760 --l3-path /tmp/hicache-l3" 14 ;;
  esac
done
if [ "${PACK:-1}" = 1 ]; then  # the device returns at most 8 files: pack every result, metrics and log into one archive
  out=${OUT:-/tmp}
  (cd "$out" && tar czf suite_multiturn.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_multiturn.tgz"
fi
