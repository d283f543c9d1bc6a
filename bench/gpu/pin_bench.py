"""How fast can the host pool's memory be pinned? Startup with a 48 GiB host tier spent 28-36 s pinning it on the
H200 machine with torch's pinned allocation; `tiers/pinned.py` (huge-touch, the host pool's allocation) takes
2.0-7.9 s (bench/RESULTS.md, 'Host pool pinning'). This times, for --gib of memory:

  torch        torch.empty(..., pin_memory=True), the host pool's allocation before tiers/pinned.py;
  register-N   a pageable torch.empty, then cudaHostRegister of N equal slices from N threads at once;
  touch-N      a pageable torch.empty whose pages N threads fault in first (writing zeros), then one
               cudaHostRegister of memory already resident;
  huge-touch-N the same over an anonymous mmap advised MADV_HUGEPAGE (2 MiB pages where the kernel's
               transparent huge pages allow: 512x fewer faults);

then checks that the registered memory copies to the GPU at pinned speed (a pageable buffer would be ~3x slower).

Usage (H200): python3 bench/gpu/pin_bench.py [--gib 8] [--threads 1,4,8] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from tiers.pinned import anonymous_buffer, touch_in_parallel


def copy_gbps(buf: torch.Tensor, nbytes: int = 1 << 30) -> float:
    """Host -> GPU bandwidth of the buffer's first nbytes, non_blocking (async only from pinned memory)."""
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src = buf[:nbytes]
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - start) / 1e9


def pin_torch(nbytes: int) -> dict:
    start = time.perf_counter()
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    seconds = time.perf_counter() - start
    row = {"method": "torch", "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9, "pinned": buf.is_pinned(),
           "h2d_gbps": copy_gbps(buf)}
    del buf
    return row


def pin_register(nbytes: int, threads: int) -> dict:
    cudart = torch.cuda.cudart()
    buf = torch.empty(nbytes, dtype=torch.uint8)
    base, step = buf.data_ptr(), -(-nbytes // threads)
    errors: list[object] = []

    def register(offset: int) -> None:
        size = min(step, nbytes - offset)
        err = cudart.cudaHostRegister(base + offset, size, 0)
        if int(err) != 0:
            errors.append(err)

    start = time.perf_counter()
    workers = [threading.Thread(target=register, args=(i * step,)) for i in range(threads) if i * step < nbytes]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - start
    row = {"method": f"register-{threads}", "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9,
           "errors": [str(e) for e in errors], "pinned": buf.is_pinned(), "h2d_gbps": copy_gbps(buf)}
    for i in range(len(workers)):
        cudart.cudaHostUnregister(base + i * step)
    del buf
    return row


def pin_touched(nbytes: int, threads: int, huge: bool) -> dict:
    """Fault the pages in from `threads` threads (tiers.pinned.touch_in_parallel), then register once; over
    tiers.pinned.anonymous_buffer (the host pool's way) when `huge`."""
    cudart = torch.cuda.cudart()
    start = time.perf_counter()
    buf = anonymous_buffer(nbytes) if huge else torch.empty(nbytes, dtype=torch.uint8)
    touch_in_parallel(buf, threads)
    touched = time.perf_counter()
    err = cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0)
    seconds = time.perf_counter() - start
    row = {"method": f"{'huge-' if huge else ''}touch-{threads}", "seconds": seconds,
           "touch_s": touched - start, "register_s": seconds - (touched - start),
           "gb_per_s": nbytes / seconds / 1e9, "errors": [str(err)] if int(err) != 0 else [],
           "pinned": buf.is_pinned(), "h2d_gbps": copy_gbps(buf)}
    cudart.cudaHostUnregister(buf.data_ptr())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--threads", default="1,4,8")
    ap.add_argument("--json")
    args = ap.parse_args()
    nbytes = int(args.gib * (1 << 30))
    torch.cuda.init()
    threads = [int(t) for t in args.threads.split(",")]
    rows = [pin_torch(nbytes)] + [pin_register(nbytes, t) for t in threads]
    rows += [pin_touched(nbytes, t, huge) for huge in (False, True) for t in threads]
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            print("transparent huge pages:", f.read().strip())
    except OSError:
        pass
    for r in rows:
        split = f" (touch {r['touch_s']:.2f} s, register {r['register_s']:.2f} s)" if "touch_s" in r else ""
        print(f"{r['method']:>13}: {r['seconds']:6.2f} s{split}, {r['gb_per_s']:5.2f} GB/s pinned, is_pinned "
              f"{r['pinned']}, H2D {r['h2d_gbps']:5.1f} GB/s {r.get('errors') or ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
