#!/usr/bin/env bash
# Issue 7, targets 4-5 diagnostics in one device call (bench/gpu/tier_overhead.py, in-process, no server):
# the no-reuse cost of write-through vs deferred write-through (fresh and full GPU pool, with kernel tables),
# then the multi-turn run's per-round breakdown with the kernel table of round 6.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
timeout "${NR_TIMEOUT:-330}" python3 bench/gpu/tier_overhead.py no-reuse --out "$out" --cases 2k --steady --profile \
  2>&1 | grep -v -e USDT -e Warning | tee "$out/no_reuse.log" | grep -E '^(2k|32k|profiled|results)'
timeout "${MT_TIMEOUT:-220}" python3 bench/gpu/tier_overhead.py multiturn --out "$out" --profile-round 6 \
  2>&1 | grep -v -e USDT -e Warning | tee "$out/multiturn.log" | grep -E 'round|results'
(cd "$out" && tar czf suite_overhead.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_overhead.tgz"
