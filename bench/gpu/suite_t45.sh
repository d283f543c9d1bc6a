#!/usr/bin/env bash
# Issue 7 targets 4 and 5 through the server in one device call:
#   multi-turn 32 x 8 x 1024 with 8-token answers: GPU only, then the host tier once per write-through deferral
#   setting in $DEFERS (cache.write_policy.defer_above_free; default "0.25 1.0");
#   no reuse, 2k/256 x 32 and 32k/8 x 8: tiers off, then all on (16 GiB host + 24 GiB L3) per setting in $DEFERS.
# The fourth session ran it with DEFERS=0.25 (about 5.5 minutes); both settings take about 7.5 (fifth session).
# POLICIES="lru lrfu" adds an eviction-policy A/B to the multi-turn part (about 2.5 more minutes).
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
DEFERS=${DEFERS:-0.25 1.0}
PARTS=${PARTS:-mt nr}  # mt: target 4 only, nr: target 5 only
EXTRA=${EXTRA:-}  # more serve flags for every run, e.g. "--set scheduler.chunk_tokens=4096"
B8="python3 -m hicache.cli bench multiturn --url \$URL --clients 32 --rounds 8 --request-length 1024 --output-length 8"
mt() { bash bench/gpu/serve_and_bench.sh "$1" "$2" "$3 $EXTRA" "$B8 --json \$OUT/$1.json" 2>&1 | tail -6; }
nr() {  # name port serve-flags clients in out
  bash bench/gpu/serve_and_bench.sh "$1" "$2" "$3 $EXTRA" \
    "python3 -m hicache.cli bench multiturn --url \$URL --clients $4 --rounds 1 --request-length $5 --output-length $6 --seed 7 --json \$OUT/$1.json" 2>&1 | tail -4
}
port=8100
next() { port=$((port + 1)); }
POLICIES=${POLICIES:-lrfu}  # eviction policies for target 4 (each: GPU only, then host per $DEFERS), e.g. "lru lrfu"
if [[ " $PARTS " == *" mt "* ]]; then
for e in $POLICIES; do
  ev="--set cache.eviction_policy=$e"
  next; mt "mt8_gpu_only_$e" $port "--device-tokens 65536 --host-tokens 0 --no-l3 $ev"
  for d in $DEFERS; do
    next; mt "mt8_host_d${d}_$e" $port \
      "--device-tokens 65536 --host-tokens 393216 --no-l3 --set cache.write_policy.defer_above_free=$d $ev"
  done
done
fi
ON="--device-tokens 262144 --host-tokens 131072 --disk-tokens 196608 --l3-path /tmp/hicache-l3-nr"
OFF="--device-tokens 262144 --host-tokens 0 --no-l3"
NR_CASES=${NR_CASES:-2k 32k}  # target 5 cases to run
declare -A NR=([2k]="2k 32 2048 256" [32k]="32k 8 32768 8")
[[ " $PARTS " == *" nr "* ]] && for name in $NR_CASES; do
  set -- ${NR[$name]}
  next; nr "nr$1_off" $port "$OFF" "$2" "$3" "$4"
  for d in $DEFERS; do
    rm -rf /tmp/hicache-l3-nr
    next; nr "nr$1_on_d$d" $port "$ON --set cache.write_policy.defer_above_free=$d" "$2" "$3" "$4"
  done
done
rm -rf /tmp/hicache-l3-nr
(cd "$out" && tar czf suite_t45.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_t45.tgz"
