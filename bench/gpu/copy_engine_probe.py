"""Does a small copy wait behind a big one queued on another CUDA stream (a shared copy-engine queue)?

The engine's step inputs (token ids, positions, page tables) and its sampled tokens cross PCIe in small
copies on the compute stream while tier transfers (host -> GPU loads, GPU -> host backups) run on side
streams. If the copy engines serve streams in one queue, every small copy waits for the big transfer ahead.

For each direction: queue a big pinned copy (--mib) on a side stream, then at once a small copy on the
compute stream, pinned (non_blocking) and pageable (blocking, as `torch.tensor(..., device=...)`); report
when the small copy completed, against the big copy's own duration. Usage: python3 bench/gpu/copy_engine_probe.py
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def probe(direction: str, big_mib: int, small: str) -> dict[str, float]:
    dev = torch.device("cuda")
    n = big_mib << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(n, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream(dev)
    small_host = torch.arange(4096, dtype=torch.int64)
    if small == "pinned":
        small_host = small_host.pin_memory()
    small_gpu = torch.empty(4096, dtype=torch.int64, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(side):
        (gpu.copy_(host, non_blocking=True) if direction == "h2d" else host.copy_(gpu, non_blocking=True))
        big_done = torch.cuda.Event()
        big_done.record(side)
    queued = time.perf_counter()
    if direction == "h2d":
        small_gpu.copy_(small_host, non_blocking=small == "pinned")
    else:
        small_host.copy_(small_gpu, non_blocking=small == "pinned")
    returned = time.perf_counter()
    torch.cuda.current_stream().synchronize()
    small_done = time.perf_counter()
    big_done.synchronize()
    big_end = time.perf_counter()
    return {"small_returned_ms": (returned - queued) * 1e3, "small_done_ms": (small_done - queued) * 1e3,
            "big_done_ms": (big_end - t0) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    probe("h2d", 64, "pinned")  # warm-up
    results = {}
    for direction in ("h2d", "d2h"):
        for small in ("pinned", "pageable"):
            r = min((probe(direction, args.mib, small) for _ in range(3)), key=lambda r: r["small_done_ms"])
            results[f"{direction}_{small}"] = r
            print(f"{direction} big {args.mib} MiB + small {small}: small copy done after {r['small_done_ms']:.2f} ms "
                  f"(call returned after {r['small_returned_ms']:.2f} ms); big copy took {r['big_done_ms']:.2f} ms",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
