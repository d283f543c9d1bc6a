#!/usr/bin/env bash
# Seventh session, after the prefix kernel became the default: target 4's GPU-only and host + L3 arms in one call
# (their ratio from the same call), then target 6 (a prefix on L3 against recomputing it), since the kernel makes
# prefill faster and the cost model compares loading with prefilling. About 7 minutes.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
OUT_LEN=8 PACK=0 RUNS="gpu_only host_l3" timeout 260 bash bench/gpu/suite_multiturn.sh 2>&1 | grep -E "==|metrics"
PARTS=l3r PACK=0 bash bench/gpu/suite_recheck.sh
rm -rf /tmp/hicache-l3
(cd "$out" && tar czf suite_final7.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_final7.tgz"
