#!/usr/bin/env bash
# The Triton prefix-attention kernel on the GPU, in one device call (about 9 minutes):
#   1. the CUDA tests (its bf16 accuracy, the step-input upload, the copier), 2. one layer against SDPA
#   (bench/gpu/prefix_attention_bench.py), 3. target 4's multi-turn run, GPU only and host tier, with
#   model.prefill_attention sdpa and then triton (the same engine in both arms of each pair).
# Results: $OUT/suite_prefix_kernel.tgz. PARTS picks parts (default "tests micro mt").
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
PARTS=${PARTS:-tests micro mt}
if [[ " $PARTS " == *" tests "* ]]; then
  timeout 240 python3 -m pytest -q -x tests/engine/test_engine_cuda.py tests/engine/test_host_io.py \
    tests/test_tiers.py 2>&1 | tail -5 | tee "$out/cuda_tests.txt"
fi
if [[ " $PARTS " == *" micro "* ]]; then
  timeout 120 python3 bench/gpu/prefix_attention_bench.py --json "$out/prefix_attention.json" 2>&1 | tail -8
fi
B8="python3 -m hicache.cli bench multiturn --url \$URL --clients 32 --rounds 8 --request-length 1024 --output-length 8"
port=8300
if [[ " $PARTS " == *" mt "* ]]; then
  for a in sdpa triton; do
    for arm in "gpu_only --host-tokens 0" "host --host-tokens 393216"; do
      set -- $arm
      port=$((port + 1))
      name="mt8_$1_$a"
      timeout 200 bash bench/gpu/serve_and_bench.sh "$name" $port \
        "--device-tokens 65536 $2 $3 --no-l3 --set model.prefill_attention=$a" "$B8 --json \$OUT/$name.json" 2>&1 | tail -3
    done
  done
fi
(cd "$out" && tar czf suite_prefix_kernel.tgz --remove-files $(ls | grep -v '\.tgz$')) && echo "results: $out/suite_prefix_kernel.tgz"
