"""The L3 store's fixed cost per call: 32-page write_pages / read_pages calls of small pages (64 KiB, so the copies
themselves take ~0.2 ms a call) on a slab in memory, 4 I/O threads; the mean milliseconds a call, then a cProfile
of one more pass.

    python3 bench/l3_call_overhead.py [--dir /dev/shm] [--page-kib 64] [--pages 4096] [--threads 4] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiers.l3.store import L3Store  # noqa: E402

CALL_PAGES = 32


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--page-kib", type=int, default=64)
    parser.add_argument("--pages", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    page, n = args.page_kib << 10, args.pages
    directory = tempfile.mkdtemp(dir=args.dir)
    store = L3Store(directory + "/s", 2 * n * (page + 8192), page, b"call-overhead-ns", io_backend="auto",
                    io_threads=args.threads, sync_batch_pages=CALL_PAGES)
    try:
        populating = getattr(store._io, "_populating", None)
        if populating is not None:
            populating.join()  # measure the steady state, not the first touches
        pages = torch.randint(0, 255, (n, page), dtype=torch.uint8)
        keys = [i.to_bytes(16, "little") for i in range(n)]
        out = torch.empty_like(pages)

        def one_pass() -> tuple[float, float]:
            start = time.perf_counter()
            for b in range(0, n, CALL_PAGES):
                if not all(store.write_pages(keys[b:b + CALL_PAGES], list(pages[b:b + CALL_PAGES]))):
                    raise RuntimeError(f"write failed: {store.stats()}")
            wrote = time.perf_counter() - start
            start = time.perf_counter()
            for b in range(0, n, CALL_PAGES):
                if not all(store.read_pages(keys[b:b + CALL_PAGES], list(out[b:b + CALL_PAGES]))):
                    raise RuntimeError(f"read failed: {store.stats()}")
            read = time.perf_counter() - start
            if not torch.equal(out, pages):
                raise RuntimeError("read back bytes differ")
            store.delete(keys)
            return wrote, read

        one_pass()
        wrote, read = one_pass()
        calls = n / CALL_PAGES
        result = {"io_backend": store.stats()["io_backend"], "page_bytes": page, "call_pages": CALL_PAGES,
                  "write_ms_per_call": 1e3 * wrote / calls, "read_ms_per_call": 1e3 * read / calls}
        print(f"{result['io_backend']}: {CALL_PAGES} pages of {args.page_kib} KiB a call: write "
              f"{result['write_ms_per_call']:.3f} ms, read {result['read_ms_per_call']:.3f} ms a call")
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            one_pass()
            profile.disable()
            pstats.Stats(profile).sort_stats("cumulative").print_stats(20)
        return result
    finally:
        store.close()
        shutil.rmtree(directory)


if __name__ == "__main__":
    main()
