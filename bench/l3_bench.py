"""L3 store throughput vs the best raw O_DIRECT transfer of the same bytes on the same directory.

    .venv/bin/python bench/l3_bench.py --dir /tmp --page-bytes 2097152 --pages 256 --json out.json

Raw baselines: `dd bs=64M oflag=direct conv=fdatasync` / `iflag=direct`, and N Python threads doing
O_DIRECT pwrite/pread of 8 MiB chunks (+ one fdatasync), each chunk from or into its own memory as each store
page has its own host page; where the file lives in memory (tmpfs) also N threads copying 8 MiB chunks through a
mapping of it (memmove); the fastest counts. Each figure is the best of
--repeats runs. The store's writes include its fdatasync and LMDB commits; its reads include checksums.
Source/destination pages live in a 4 KiB-aligned pool (like the pinned host pool) unless --unaligned.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiers.l3 import L3Store, native  # noqa: E402
from tiers.l3.format import slot_bytes_for  # noqa: E402

NAMESPACE = b"l3-bench-ns-0001"
CHUNK = 8 << 20
GB = 1e9


def _pool(pages: int, page_bytes: int, aligned: bool) -> torch.Tensor:
    if aligned:
        buffer = mmap.mmap(-1, pages * page_bytes)
        return torch.frombuffer(buffer, dtype=torch.uint8).view(pages, page_bytes)
    return torch.empty(pages, page_bytes, dtype=torch.uint8)


def _dd(path: str, total: int, write: bool) -> float:
    """dd throughput in bytes/s, from dd's own byte count and time."""
    bs = 64 << 20
    count = max(1, total // bs)
    if write:
        cmd = ["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}", "oflag=direct",
               "conv=fdatasync,notrunc"]
    else:
        cmd = ["dd", f"if={path}", "of=/dev/null", f"bs={bs}", f"count={count}", "iflag=direct"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", done.stderr)
    return int(match.group(1)) / float(match.group(2))


def _parallel_direct(path: str, total: int, threads: int, write: bool) -> float:
    """N threads of O_DIRECT pwrite/pread over 8 MiB chunks (+ fdatasync for writes); bytes/s."""
    fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | os.O_DIRECT)
    chunks = total // CHUNK
    # every chunk has its own memory, as every store page has its own host page: one small buffer per thread
    # would stay in the CPU caches, and on a RAM-speed file system measure the caches, not the transfer
    memory = mmap.mmap(-1, chunks * CHUNK)
    zero = bytes(CHUNK)
    for c in range(chunks):  # fault it in first, as the store's host pool is
        memory[c * CHUNK:(c + 1) * CHUNK] = zero

    def worker(t: int) -> None:
        view = memoryview(memory)
        for c in range(t, chunks, threads):
            part = view[c * CHUNK:(c + 1) * CHUNK]
            if write:
                os.pwrite(fd, part, c * CHUNK)
            else:
                os.preadv(fd, [part], c * CHUNK)

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(worker, range(threads)))
        if write:
            os.fdatasync(fd)
        return chunks * CHUNK / (time.perf_counter() - start)
    finally:
        os.close(fd)


def _parallel_mapped(path: str, total: int, threads: int, write: bool) -> float:
    """N threads copying 8 MiB chunks between their own memory and a shared mapping of the file (memmove, the
    interpreter lock released); bytes/s. The raw ceiling of a file that lives in memory."""
    chunks = total // CHUNK
    memory = mmap.mmap(-1, chunks * CHUNK)
    memory[:] = bytes(chunks * CHUNK)  # faulted in, as the store's host pool is
    fd = os.open(path, os.O_RDWR)
    try:
        # faulted in at once (MAP_POPULATE): the store maps its slab once and keeps it, so faults are not its cost
        file = mmap.mmap(fd, chunks * CHUNK, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        mine = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        theirs = ctypes.addressof(ctypes.c_char.from_buffer(file))

        dst, src = (theirs, mine) if write else (mine, theirs)

        def worker(t: int) -> None:
            for c in range(t, chunks, threads):
                ctypes.memmove(dst + c * CHUNK, src + c * CHUNK, CHUNK)

        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(worker, range(threads)))
        return chunks * CHUNK / (time.perf_counter() - start)
    finally:
        os.close(fd)


def _in_memory(path: str) -> bool:
    """Whether the file lives in memory (tmpfs): there a copy through a mapping is a raw transfer too."""
    io = native.load()
    if io is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        return io.in_memory(fd)
    finally:
        os.close(fd)


def raw_best(directory: str, total: int, threads: int, repeats: int) -> dict:
    """Best raw O_DIRECT write and read throughput for `total` bytes in `directory` (and of copies through a mapping
    where the file lives in memory)."""
    total = max(CHUNK, total // CHUNK * CHUNK)
    path = os.path.join(directory, "l3-bench-raw.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.posix_fallocate(fd, 0, total)
    os.close(fd)
    try:
        mapped = _in_memory(path)
        result = {}
        for write in (True, False):
            dd = max(_dd(path, total, write) for _ in range(repeats))
            py = max(_parallel_direct(path, total, threads, write) for _ in range(repeats))
            op = "write" if write else "read"
            result[op] = {"dd": dd, f"python_{threads}_threads": py, "best": max(dd, py)}
            if mapped:
                copy = max(_parallel_mapped(path, total, threads, write) for _ in range(repeats))
                result[op].update(mapped_copy=copy, best=max(dd, py, copy))
        return result
    finally:
        os.unlink(path)


def store_throughput(directory: str, page_bytes: int, pages: int, batch: int, threads: int, repeats: int,
                     aligned: bool, backend: str = "auto", device: str = "cpu",
                     sync_batch_pages: int = 32, python_loop: bool = False) -> dict:
    """Best write_pages and read_pages throughput (bytes/s) of the L3 store (`python_loop`: pages move through
    the Python piece loop, not the native one of tiers/l3/native.py)."""
    path = tempfile.mkdtemp(prefix="l3-bench-", dir=directory)
    source = _pool(pages, page_bytes, aligned)
    source.copy_(torch.randint(0, 256, source.shape, dtype=torch.uint8))
    target = torch.empty(pages, page_bytes, dtype=torch.uint8, device=device) if device != "cpu" \
        else _pool(pages, page_bytes, aligned)
    target.zero_()  # faulted in, as the host pool is: a first pass must not time the faults of its own buffers
    writes, reads = [], []
    try:
        with L3Store(path, pages * slot_bytes_for(page_bytes), page_bytes, NAMESPACE, io_backend=backend,
                     io_threads=threads, sync_batch_pages=sync_batch_pages) as store:
            if python_loop and hasattr(store._io, "native"):
                store._io.native = None
            loop = "native" if getattr(store._io, "native", None) is not None else "python"
            for r in range(repeats):
                keys = [(r * pages + i).to_bytes(16, "little") for i in range(pages)]
                # pages [b, b + batch) per call
                start = time.perf_counter()
                for b in range(0, pages, batch):
                    if not all(store.write_pages(keys[b:b + batch], list(source[b:b + batch]))):
                        raise RuntimeError(f"write failed: {store.stats()}")
                writes.append(pages * page_bytes / (time.perf_counter() - start))
                start = time.perf_counter()
                for b in range(0, pages, batch):
                    if not all(store.read_pages(keys[b:b + batch], list(target[b:b + batch]))):
                        raise RuntimeError(f"read failed: {store.stats()}")
                if device != "cpu":
                    torch.cuda.synchronize()
                reads.append(pages * page_bytes / (time.perf_counter() - start))
                if not torch.equal(target.cpu(), source):
                    raise RuntimeError("read back bytes differ")
                store.delete(keys)
            stats = store.stats()
        return {"write": max(writes), "read": max(reads), "first_write": writes[0], "first_read": reads[0],
                "io_backend": stats["io_backend"], "page_loop": loop,
                "fsyncs": stats["fsyncs"], "index_commits": stats["index_commits"]}
    finally:
        shutil.rmtree(path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp", help="directory on the file system to measure")
    parser.add_argument("--page-bytes", type=int, default=2 << 20)
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64, help="pages per write_pages/read_pages call")
    parser.add_argument("--threads", type=int, default=4, help="store io_threads and raw Python threads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sync-batch-pages", type=int, default=32, help="store sync_batch_pages")
    parser.add_argument("--unaligned", action="store_true", help="pages in an ordinary (64 B-aligned) tensor")
    parser.add_argument("--backends", nargs="+", default=["auto"], choices=["auto", "posix", "kvikio", "buffered"],
                        help="store I/O paths to measure with host pages (the first is the headline 'store')")
    parser.add_argument("--python-loop", action="store_true",
                        help="move pages through the Python piece loop instead of the native one (tiers/l3/native.py)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    total = args.pages * args.page_bytes
    raw = raw_best(args.dir, total, args.threads, args.repeats)
    stores = {b: store_throughput(args.dir, args.page_bytes, args.pages, args.batch, args.threads, args.repeats,
                                  aligned=not args.unaligned, backend=b, sync_batch_pages=args.sync_batch_pages,
                                  python_loop=args.python_loop)
              for b in args.backends}
    store = stores[args.backends[0]]
    result = {"dir": args.dir, "page_bytes": args.page_bytes, "pages": args.pages, "batch": args.batch,
              "threads": args.threads, "sync_batch_pages": args.sync_batch_pages,
              "aligned_pool": not args.unaligned, "raw": raw, "store": store,
              "write_ratio": store["write"] / raw["write"]["best"],
              "read_ratio": store["read"] / raw["read"]["best"],
              "stores": {b: {**r, "write_ratio": r["write"] / raw["write"]["best"],
                             "read_ratio": r["read"] / raw["read"]["best"]} for b, r in stores.items()}}
    if torch.cuda.is_available():
        try:
            result["kvikio_gpu"] = store_throughput(args.dir, args.page_bytes, args.pages, args.batch,
                                                    args.threads, args.repeats, True, "kvikio", "cuda",
                                                    args.sync_batch_pages)
        except Exception as e:  # kvikio missing or GDS unavailable: report, do not fail the run
            result["kvikio_gpu"] = {"error": str(e)}
    print(f"{args.pages} pages x {args.page_bytes} B in {args.dir} ({store['io_backend']}, "
          f"{'unaligned' if args.unaligned else 'aligned'} pool, batch {args.batch}, "
          f"{args.threads} threads, sync every {args.sync_batch_pages} pages)")
    for op in ("write", "read"):
        mapped = f", mapped copy {raw[op]['mapped_copy'] / GB:.2f}" if "mapped_copy" in raw[op] else ""
        print(f"  {op:5s} raw best {raw[op]['best'] / GB:6.2f} GB/s "
              f"(dd {raw[op]['dd'] / GB:.2f}, python {raw[op][f'python_{args.threads}_threads'] / GB:.2f}{mapped})")
        for b, r in result["stores"].items():
            print(f"        store [{b} -> {r['io_backend']}, {r['page_loop']} loop] {r[op] / GB:6.2f} GB/s"
                  f"   ratio {r[op + '_ratio']:.2f}   (first pass, a fresh store: {r['first_' + op] / GB:.2f} GB/s)")
    if "kvikio_gpu" in result and "read" in result["kvikio_gpu"]:
        kv = result["kvikio_gpu"]
        kv["write_ratio"], kv["read_ratio"] = kv["write"] / raw["write"]["best"], kv["read"] / raw["read"]["best"]
        print(f"  kvikio GPU pages: write {kv['write'] / GB:.2f} GB/s (ratio {kv['write_ratio']:.2f}), "
              f"read into GPU {kv['read'] / GB:.2f} GB/s (ratio {kv['read_ratio']:.2f}) [{kv['io_backend']}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
