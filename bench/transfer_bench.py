"""GPU <-> host page transfer throughput versus a raw pinned copy of one contiguous buffer (CUDA only).

For each page shape, promotes (host -> GPU) and demotes (GPU -> host) a batch of non-contiguous
pages through tiers.cuda_copy.CudaPageCopier in each mode, and times a raw `copy_` of one pinned
contiguous buffer of the same size in the same run. Reports GB/s and the ratio to raw, and checks
that the bytes arrived.

    python bench/transfer_bench.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from tiers import DevicePool, HostPool, KVLayout
from tiers.cuda_copy import CudaPageCopier

SHAPES = {
    # name: (layout, pages moved, pool pages)
    "llama-3.1-8b page64 (8 MiB)": (KVLayout(32, 8, 128, 64, 2), 384, 1024),
    "smollm2-135m page16 (180 KiB)": (KVLayout(30, 3, 64, 16, 2), 4096, 12288),
}


def timed(fn, reps: int = 5) -> float:
    """Median seconds of fn() measured with CUDA events after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def run_shape(name: str, layout: KVLayout, n: int, pool_pages: int) -> dict:
    dev = DevicePool(layout, pool_pages, torch.bfloat16, "cuda")
    host = HostPool(layout, pool_pages, torch.bfloat16, pin_memory=True)
    nbytes = n * layout.page_bytes
    raw_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    raw_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    raw_h2d = timed(lambda: raw_dev.copy_(raw_host, non_blocking=True))
    raw_d2h = timed(lambda: raw_host.copy_(raw_dev, non_blocking=True))
    rng = random.Random(0)
    host_pages = rng.sample(range(pool_pages), n)
    dev_pages = rng.sample(range(pool_pages), n)
    host.buffer[host_pages[:8]] = torch.randn(8, *host.buffer.shape[1:]).to(torch.bfloat16)
    out = {"shape": name, "page_bytes": layout.page_bytes, "pages": n, "bytes": nbytes,
           "raw_h2d_gbps": nbytes / raw_h2d / 1e9, "raw_d2h_gbps": nbytes / raw_d2h / 1e9}
    for mode in ("dma", "zero_copy"):
        try:
            copier = CudaPageCopier(dev, host, mode=mode)
        except RuntimeError as e:
            out[mode] = {"error": str(e)}
            continue
        # stream_wait: the timing stream waits for the copier's own streams, so events measure the transfer
        h2d = timed(lambda c=copier: c.to_device(host_pages, dev_pages).stream_wait())
        d2h = timed(lambda c=copier: c.to_host(dev_pages, host_pages).stream_wait())
        want = host.buffer[host_pages[:8]].clone()
        copier.to_device(host_pages, dev_pages).wait()
        ok_in = torch.equal(dev.read_pages(dev_pages[:8]).cpu(), want)
        back = rng.sample(sorted(set(range(pool_pages)) - set(host_pages)), 8)
        copier.to_host(dev_pages[:8], back).wait()
        ok_out = torch.equal(host.buffer[back], want)
        out[mode] = {
            "promote_gbps": nbytes / h2d / 1e9, "demote_gbps": nbytes / d2h / 1e9,
            "promote_ratio": raw_h2d / h2d, "demote_ratio": raw_d2h / d2h, "bytes_ok": ok_in and ok_out,
        }
    auto = CudaPageCopier(dev, host)
    out["auto_mode"] = auto.mode
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("transfer_bench needs CUDA")
    results = [run_shape(name, *spec) for name, spec in SHAPES.items()]
    print(f"device: {torch.cuda.get_device_name()}")
    for r in results:
        print(f"\n{r['shape']}: {r['pages']} pages, {r['bytes'] / 1e9:.2f} GB; "
              f"raw pinned H2D {r['raw_h2d_gbps']:.1f} GB/s, D2H {r['raw_d2h_gbps']:.1f} GB/s; "
              f"auto={r['auto_mode']}")
        for mode in ("dma", "zero_copy"):
            m = r[mode]
            if "error" in m:
                print(f"  {mode:>9}: {m['error']}")
                continue
            print(f"  {mode:>9}: promote {m['promote_gbps']:.1f} GB/s ({m['promote_ratio']:.2f} of raw), "
                  f"demote {m['demote_gbps']:.1f} GB/s ({m['demote_ratio']:.2f} of raw), bytes ok={m['bytes_ok']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
