"""Where a copy through a shared mapping of an in-memory file (the L3's `mapped` path) spends its time.

Each case maps a fresh, fallocated file and copies 8 MiB pages into it and back out with N threads:
- `fresh`: no population: every 4 KiB page faults on its first copy;
- `madvise`: MADV_POPULATE_WRITE first (what `MappedFile.populate` asks for);
- `touch`: an atomic add of zero on every 4 KiB page first (its fallback where the kernel refuses the advice).
Each copy runs twice: through the store's native hashed copy (`hicache_write_mapped` / `hicache_read_mapped`, xxh3
in 256 KiB pieces) and as a bare memmove, so the table shows the faults' and the hash's share apart.

    python3 bench/l3_map_probe.py --dir /dev/shm --mib 2048 --threads 8
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiers.l3 import io as l3_io  # noqa: E402
from tiers.l3 import native  # noqa: E402

PAGE = 8 << 20


def _timed(threads: int, pages: int, one) -> float:
    """GB/s of `one(page)` over every page, `threads` at a time."""
    def worker(t: int) -> None:
        for p in range(t, pages, threads):
            one(p)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    return pages * PAGE / (time.perf_counter() - start) / 1e9


def _case(io, case: str, path: str, memory: int, pages: int, threads: int) -> dict:
    """One case on a fresh file at `path`: its population time, then the hashed and bare copies each way."""
    lib, length, piece = io.lib, pages * PAGE, l3_io.MAPPED_PIECE_BYTES
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, length)
        mapped = io.map(fd, length, writable=True)
        base = mapped.address
        row: dict = {}
        start = time.perf_counter()
        if case == "madvise":
            row["populate_rc"] = lib.hicache_populate(base, length, 1)  # 0: advice taken, 1: fell back to touch
        elif case == "touch":
            lib.hicache_touch(base, length, 1)
        row["populate_s"] = time.perf_counter() - start

        def hashed(fn, what: str):
            def one(p: int) -> None:
                digest = ctypes.c_uint64()
                rc = fn(base, length, fd, memory + p * PAGE, PAGE, p * PAGE, piece, ctypes.byref(digest))
                if rc:
                    raise OSError(-rc, what)
            return one

        write = hashed(lib.hicache_write_mapped, "hicache_write_mapped")
        row["write_hashed_first_gbps"] = _timed(threads, pages, write)
        row["write_hashed_gbps"] = _timed(threads, pages, write)
        row["write_memmove_gbps"] = _timed(threads, pages,
                                           lambda p: ctypes.memmove(base + p * PAGE, memory + p * PAGE, PAGE))
        row["read_hashed_gbps"] = _timed(threads, pages, hashed(lib.hicache_read_mapped, "hicache_read_mapped"))
        row["read_memmove_gbps"] = _timed(threads, pages,
                                          lambda p: ctypes.memmove(memory + p * PAGE, base + p * PAGE, PAGE))
        mapped.close()
        return row
    finally:
        os.close(fd)
        os.unlink(path)


def probe(directory: str, mib: int, threads: int) -> dict:
    io = native.load()
    if io is None:
        raise SystemExit("the native L3 loop is not available here (not built: pip install -e .; or no libxxhash)")
    pages = max(1, mib * (1 << 20) // PAGE)
    memory = mmap.mmap(-1, pages * PAGE)
    memory[:] = b"\x5a" * (pages * PAGE)  # the host side faulted in, as the pinned host pool is
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    results = {"dir": directory, "pages": pages, "page_bytes": PAGE, "threads": threads, "cases": {}}
    for case in ("fresh", "madvise", "touch"):
        row = _case(io, case, os.path.join(directory, "l3-map-probe.bin"), address, pages, threads)
        results["cases"][case] = row
        rc = f" rc {row['populate_rc']}" if "populate_rc" in row else ""
        print(f"{case:8s} populate {row['populate_s']:6.2f} s{rc}"
              f"  write: first {row['write_hashed_first_gbps']:6.2f}  hashed {row['write_hashed_gbps']:6.2f}"
              f"  memmove {row['write_memmove_gbps']:6.2f}   read: hashed {row['read_hashed_gbps']:6.2f}"
              f"  memmove {row['read_memmove_gbps']:6.2f} GB/s", flush=True)
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/dev/shm", help="a directory on a memory file system")
    parser.add_argument("--mib", type=int, default=2048, help="bytes copied each way, MiB")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results = probe(args.dir, args.mib, args.threads)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
