#!/usr/bin/env bash
# Issue 7: re-measure targets 1, 2, 3 and 6 after copier / allocator / attention changes, in one device call,
# each part under its own time limit so the archive is always written; then an engine-thread profile (cProfile)
# of the no-reuse 32k case with all tiers on (where target 5's throughput is lost to engine-thread time).
# PARTS picks parts (default all: "transfer l3r prefill l3 prof"); PACK=0 leaves the results unpacked.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
PARTS=${PARTS:-transfer l3r prefill l3 prof}
part() { [[ " $PARTS " == *" $1 "* ]]; }
part transfer && timeout 100 python3 bench/transfer_bench.py --json "$out/transfer.json" 2>&1 | tail -8
L3R="python3 bench/gpu/l3_vs_recompute.py --url \$URL --prefix-tokens 8192 --evictors 6 --rounds 3"
SMALL="--device-tokens 16384 --host-tokens 16384 --disk-tokens 131072"
l3r() {  # name port serve-flags
  rm -rf /tmp/hicache-l3-r
  timeout 110 bash bench/gpu/serve_and_bench.sh "$1" "$2" "$3" "$L3R --json \$OUT/$1.json" 2>&1 |
    grep -E '^round|median|==|Error'
}
if part l3r; then
  l3r l3r_off 8301 "--device-tokens 16384 --host-tokens 0 --no-l3"
  l3r l3r_auto 8302 "$SMALL --l3-path /tmp/hicache-l3-r --load-mode auto"
  l3r l3r_overlap 8303 "$SMALL --l3-path /tmp/hicache-l3-r --load-mode auto --load-overlap"
  rm -rf /tmp/hicache-l3-r
fi
part prefill && timeout 100 python3 bench/prefill_bench.py --tokens 2048 8192 --json "$out/prefill.json" 2>&1 | tail -12
part l3 && for batch in 32 128; do
  timeout 120 python3 bench/l3_bench.py --dir /tmp --page-bytes 8388608 --pages 256 --batch $batch --threads 8 \
    --repeats 2 --backends posix kvikio --json "$out/l3_b$batch.json" 2>&1 | tail -9
done
if part prof; then
  rm -rf /tmp/hicache-l3-nr
  timeout "${PROFILE_TIMEOUT:-90}" bash bench/gpu/serve_and_bench.sh nr32k_on_prof 8401 \
    "--device-tokens 262144 --host-tokens 131072 --disk-tokens 196608 --l3-path /tmp/hicache-l3-nr \
     --profile-engine $out/nr32k_engine.prof" \
    "python3 -m hicache.cli bench multiturn --url \$URL --clients 8 --rounds 1 --request-length 32768 \
     --output-length 8 --seed 7 --json \$OUT/nr32k_on_prof.json" 2>&1 | tail -3
  [ -f "$out/nr32k_engine.prof" ] && python3 -c "
import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(45)" "$out/nr32k_engine.prof" \
    >"$out/nr32k_engine.txt" 2>&1
  rm -rf /tmp/hicache-l3-nr
fi
if [ "${PACK:-1}" = 1 ]; then
  (cd "$out" && tar czf suite_recheck.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_recheck.tgz"
fi
