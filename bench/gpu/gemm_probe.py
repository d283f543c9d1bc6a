"""How fast cuBLAS runs the projections of a Llama-3.1-8B layer (bf16), against a large square GEMM on the same GPU.

The engine's prefill steps are GEMM-bound (about two thirds of a step's GPU time at 1-8k tokens). This probe times
`F.linear` for each projection at the token counts of the multi-turn benchmark's prefill steps, so the gap to the
square GEMM's rate is the most any GEMM tuning could recover.

    python3 bench/gpu/gemm_probe.py [--tokens 1024 2048 4096 8192] [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

# (name, out_features, in_features) of one Llama-3.1-8B layer with fused qkv and gate_up projections
PROJECTIONS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--json")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    a = torch.randn(8192, 8192, device=dev, dtype=dt)
    b = torch.randn(8192, 8192, device=dev, dtype=dt)
    ms = time_ms(lambda: a @ b)
    square = 2 * 8192**3 / ms / 1e9
    print(f"square 8192^3: {ms:.3f} ms, {square:.0f} TFLOPS")
    rows.append({"shape": "square 8192", "ms": ms, "tflops": square})
    weights = {name: torch.randn(n, k, device=dev, dtype=dt) for name, n, k in PROJECTIONS}
    for tokens in args.tokens:
        total_ms = total_flop = 0.0
        parts = []
        for name, n, k in PROJECTIONS:
            x = torch.randn(tokens, k, device=dev, dtype=dt)
            ms = time_ms(lambda x=x, w=weights[name]: F.linear(x, w))
            flop = 2 * tokens * n * k
            total_ms += ms
            total_flop += flop
            parts.append(f"{name} {flop / ms / 1e9:.0f}")
            rows.append({"tokens": tokens, "proj": name, "ms": ms, "tflops": flop / ms / 1e9})
        layer = total_flop / total_ms / 1e9
        print(f"{tokens:5d} tokens: layer GEMMs {total_ms:.3f} ms, {layer:.0f} TFLOPS "
              f"({layer / square:.2f} of square); "
              + ", ".join(parts), flush=True)
        rows.append({"tokens": tokens, "proj": "layer", "ms": total_ms, "tflops": layer})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
