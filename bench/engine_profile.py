"""Profile decode steps of the engine model (torch.profiler), top ops by device and host time.

Usage: python bench/engine_profile.py --model random:llama-3.1-8b --device cuda --batch-size 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_cpu_bench import bench_decode, synchronize  # noqa: E402

from hicache.engine import load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    device = torch.device(args.device)
    model, _ = load_model(args.model, getattr(torch, args.dtype), device)
    bench_decode(model, args.batch_size, args.context, 4)  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        synchronize(device)
        start = time.perf_counter()
        seconds = bench_decode(model, args.batch_size, args.context, 8)
    print(f"steps: {[round(s * 1000, 1) for s in seconds]} ms; total {time.perf_counter() - start:.2f} s")
    sort = "cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=20, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
