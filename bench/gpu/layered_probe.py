"""Host -> GPU load throughput of the copier, whole against layer by layer (tiers/layered_copy.py), by layer group
width: 8B pages (64 tokens, 8 MiB), one load of --pages pages, median of 5 (bench/RESULTS.md, 'A host hit against
a GPU hit'). "issue" is the engine thread's time to queue the load (the call's return): the GPU waits for it when
nothing else is queued."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tiers.layered_copy as layered_copy
from tiers import DevicePool, HostPool, KVLayout
from tiers.cuda_copy import CudaPageCopier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=512)
    args = ap.parse_args()
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_size=64, itemsize=2)
    dev = DevicePool(layout, args.pages, torch.bfloat16, "cuda")
    host = HostPool(layout, args.pages, torch.bfloat16, pin_memory=True)
    gb = args.pages * layout.page_bytes / 1e9
    pages = list(range(args.pages))
    for name, layered, calls in (("whole", False, 0), ("layered, 1 layer a group", True, 1 << 30),
                                 ("layered, 4 layers a group", True, 8),
                                 ("layered, 8 layers a group", True, 4)):
        layered_copy.MAX_COPY_CALLS = calls or layered_copy.MAX_COPY_CALLS
        copier = CudaPageCopier(dev, host, layered=layered)
        times, issues = [], []
        for _ in range(6):
            torch.cuda.synchronize()
            start = time.perf_counter()
            transfer = copier.to_device(pages, pages)
            issues.append(time.perf_counter() - start)
            transfer.wait()
            times.append(time.perf_counter() - start)
        t = statistics.median(times[1:])
        group = copier.layers.group_layers(1) if copier.layers is not None else 32
        print(f"{name:28s} group {group:2d}: {t * 1e3:6.1f} ms, {gb / t:5.1f} GB/s, issue "
              f"{statistics.median(issues[1:]) * 1e3:5.2f} ms", flush=True)


if __name__ == "__main__":
    main()
