"""Reads and writes at once: how a disk shares its time between them, and whether the L3 store keeps those shares.

    python3 bench/l3_mixed.py --dir /tmp --page-bytes 8388608 --pages 256 --seconds 5

Serving reads prefixes from the L3 while it writes new pages to it. A cost model that prices a page read at the
disk's read speed and a page written at its write speed, on one shared clock, assumes the two share the disk's time
without loss: a second of mixed traffic moves `r` bytes read and `w` bytes written with r / R + w / W = 1, where R
and W are the read-only and write-only speeds. This measures that sum ("time shares"; 1.0: shared without loss,
below 1: each slows the other more than by the time it takes), for

- raw O_DIRECT: `--threads` reader threads and as many writer threads on 8 MiB chunks (one fdatasync a batch);
- the store, as serving drives it: an `L3Worker` (one writer thread, batches of `--batch` pages, reads first) with
  `--reads-in-flight` reads of `--read-pages` pages queued at a time, like a bounded prefetch queue.

Each is run read-only, write-only and mixed, for `--seconds` each. The store's reads are checked against what was
written (one page a call).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiers.l3 import L3Store  # noqa: E402
from tiers.l3.format import slot_bytes_for  # noqa: E402
from tiers.l3.worker import L3Worker  # noqa: E402

NAMESPACE = b"l3-mixed-bench01"
GB = 1e9


def _aligned(pages: int, page_bytes: int) -> torch.Tensor:
    buffer = mmap.mmap(-1, pages * page_bytes)
    pool = torch.frombuffer(buffer, dtype=torch.uint8).view(pages, page_bytes)
    pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8))  # faulted in, and not all zero
    return pool


def _shares(alone: dict, mixed: dict) -> float:
    return mixed["read_gbps"] / alone["read_gbps"] + mixed["write_gbps"] / alone["write_gbps"]


# ---------------------------------------------------------------------------------------------------------- raw


def _raw_phase(path: str, pool: torch.Tensor, seconds: float, readers: int, writers: int, batch: int) -> dict:
    """`readers` threads pread random chunks of the file's first half, `writers` threads pwrite the second half in
    turn (fdatasync each `batch` chunks), for `seconds`; GB/s each way."""
    chunk = pool.shape[1]
    half = pool.shape[0]  # the file holds 2 x pages chunks: reads from [0, half), writes to [half, 2 half)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    stop = threading.Event()
    moved = {"read": 0, "write": 0}
    lock = threading.Lock()
    addr = pool.data_ptr()
    views = [memoryview((ctypes.c_char * chunk).from_address(addr + i * chunk)) for i in range(half)]

    def reader(t: int) -> None:
        rng, n = random.Random(t), 0
        while not stop.is_set():
            c = rng.randrange(half)
            n += os.preadv(fd, [views[(c + t) % half]], c * chunk)
        with lock:
            moved["read"] += n

    def writer(t: int) -> None:
        c, n, since = t, 0, 0
        while not stop.is_set():
            n += os.pwrite(fd, views[c % half], (half + c % half) * chunk)
            c += writers
            since += 1
            if since == batch:
                os.fdatasync(fd)
                since = 0
        with lock:
            moved["write"] += n

    threads = [threading.Thread(target=reader, args=(t,)) for t in range(readers)]
    threads += [threading.Thread(target=writer, args=(t,)) for t in range(writers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    if writers:
        os.fdatasync(fd)
    elapsed = time.perf_counter() - start
    os.close(fd)
    return {"read_gbps": moved["read"] / elapsed / GB, "write_gbps": moved["write"] / elapsed / GB}


def raw(directory: str, pool: torch.Tensor, seconds: float, threads: int, batch: int) -> dict:
    path = os.path.join(directory, "l3-mixed-raw.bin")
    size = 2 * pool.numel()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
        os.pwrite(fd, pool.numpy().tobytes(), 0)  # the read half holds data (an unwritten extent reads as zeros)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        result = {"read_only": _raw_phase(path, pool, seconds, threads, 0, batch),
                  "write_only": _raw_phase(path, pool, seconds, 0, threads, batch),
                  "mixed": _raw_phase(path, pool, seconds, threads, threads, batch)}
    finally:
        os.unlink(path)
    result["time_shares"] = _shares({"read_gbps": result["read_only"]["read_gbps"],
                                     "write_gbps": result["write_only"]["write_gbps"]}, result["mixed"])
    return result


# -------------------------------------------------------------------------------------------------------- store


class _StoreTraffic:
    """Drives an L3Worker as serving does: reads of stored pages kept `in_flight` deep, writes of new pages while the
    worker's queue takes them (each written page deleted once written, so the store never fills)."""

    def __init__(self, worker: L3Worker, store: L3Store, pool: torch.Tensor, readback: torch.Tensor,
                 stored: list[bytes], read_pages: int, in_flight: int, batch: int):
        self.worker, self.store, self.pool, self.readback = worker, store, pool, readback
        self.stored, self.read_pages, self.in_flight, self.batch = stored, read_pages, in_flight, batch
        self.page_bytes = pool.shape[1]
        self.rng = random.Random(7)
        self.reads_out = self.writes_out = 0
        self.read_bytes = self.write_bytes = 0
        self.bad = self.checked = 0
        self.next_key = 1 << 40
        self.free_slots = list(range(in_flight))  # read-back buffers not being read into

    def _read(self) -> None:
        slot = self.free_slots.pop()
        start = self.rng.randrange(len(self.stored) - self.read_pages + 1)
        keys = self.stored[start:start + self.read_pages]
        views = list(self.readback[slot * self.read_pages:(slot + 1) * self.read_pages])
        self.worker.submit_read(("read", slot, start), keys, views)
        self.reads_out += 1

    def _write(self) -> bool:
        keys = [(self.next_key + i).to_bytes(16, "little") for i in range(self.batch)]
        start = self.rng.randrange(len(self.pool) - self.batch + 1)
        if not self.worker.submit_write(("write", keys), keys, list(self.pool[start:start + self.batch])):
            return False
        self.next_key += self.batch
        self.writes_out += 1
        return True

    def pump(self, reads: bool, writes: bool) -> None:
        for c in self.worker.completions():
            if c.kind == "read":
                self.reads_out -= 1
                _, slot, start = c.token
                self.free_slots.append(slot)
                self.read_bytes += sum(c.results) * self.page_bytes
                j = self.checked % self.read_pages
                self.checked += 1
                if not all(c.results) or not torch.equal(self.readback[slot * self.read_pages + j],
                                                         self.pool[start + j]):
                    self.bad += 1
            else:
                self.writes_out -= 1
                self.write_bytes += sum(c.results) * self.page_bytes
                self.store.delete(list(c.token[1]))
        while reads and self.reads_out < self.in_flight:
            self._read()
        while writes and self._write():
            pass


def _store_phase(traffic: _StoreTraffic, seconds: float, reads: bool, writes: bool) -> dict:
    traffic.read_bytes = traffic.write_bytes = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        traffic.pump(reads, writes)
        time.sleep(0.0005)
    elapsed = time.perf_counter() - start
    result = {"read_gbps": traffic.read_bytes / elapsed / GB, "write_gbps": traffic.write_bytes / elapsed / GB}
    traffic.worker.wait_idle()
    traffic.pump(False, False)
    return result


def store(directory: str, pool: torch.Tensor, seconds: float, threads: int, batch: int, read_pages: int,
          in_flight: int, queue_pages: int) -> dict:
    pages, page_bytes = pool.shape
    path = tempfile.mkdtemp(prefix="l3-mixed-", dir=directory)
    readback = _aligned(read_pages * in_flight, page_bytes)
    try:
        capacity = (pages + queue_pages + 2 * batch) * slot_bytes_for(page_bytes)
        with L3Store(path, capacity, page_bytes, NAMESPACE, io_threads=threads, sync_batch_pages=batch) as s:
            stored = [i.to_bytes(16, "little") for i in range(pages)]
            for b in range(0, pages, batch):
                if not all(s.write_pages(stored[b:b + batch], list(pool[b:b + batch]))):
                    raise RuntimeError(f"prefill write failed: {s.stats()}")
            worker = L3Worker(s, threads=threads, queue_pages=queue_pages, batch_pages=batch)
            traffic = _StoreTraffic(worker, s, pool, readback, stored, read_pages, in_flight, batch)
            try:
                result = {"read_only": _store_phase(traffic, seconds, True, False),
                          "write_only": _store_phase(traffic, seconds, False, True),
                          "mixed": _store_phase(traffic, seconds, True, True)}
            finally:
                worker.close()
            result.update(io_backend=s.stats()["io_backend"], bad_reads=traffic.bad, checked_reads=traffic.checked)
    finally:
        shutil.rmtree(path)
    result["time_shares"] = _shares({"read_gbps": result["read_only"]["read_gbps"],
                                     "write_gbps": result["write_only"]["write_gbps"]}, result["mixed"])
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp", help="directory on the file system to measure")
    parser.add_argument("--page-bytes", type=int, default=8 << 20)
    parser.add_argument("--pages", type=int, default=256, help="pages stored (and read at random)")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each phase")
    parser.add_argument("--threads", type=int, default=8, help="store io_threads; raw reader (and writer) threads")
    parser.add_argument("--batch", type=int, default=32, help="pages per write batch (one fdatasync each)")
    parser.add_argument("--read-pages", type=int, default=16, help="pages per store read call")
    parser.add_argument("--reads-in-flight", type=int, default=4, help="store reads queued at a time")
    parser.add_argument("--queue-pages", type=int, default=512, help="the worker's write queue (cache.l3.queue_pages)")
    parser.add_argument("--skip-raw", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    pool = _aligned(args.pages, args.page_bytes)
    result: dict = {"dir": args.dir, "page_bytes": args.page_bytes, "pages": args.pages, "seconds": args.seconds,
                    "threads": args.threads, "batch": args.batch, "read_pages": args.read_pages,
                    "reads_in_flight": args.reads_in_flight}
    runs: list[tuple[str, Callable[[], dict]]] = []
    if not args.skip_raw:
        runs.append(("raw", lambda: raw(args.dir, pool, args.seconds, args.threads, args.batch)))
    runs.append(("store", lambda: store(args.dir, pool, args.seconds, args.threads, args.batch, args.read_pages,
                                        args.reads_in_flight, args.queue_pages)))
    for name, fn in runs:
        r = result[name] = fn()
        print(f"{name:5s} read only {r['read_only']['read_gbps']:5.2f} GB/s | write only "
              f"{r['write_only']['write_gbps']:5.2f} GB/s | mixed: read {r['mixed']['read_gbps']:5.2f} + write "
              f"{r['mixed']['write_gbps']:5.2f} GB/s | time shares {r['time_shares']:.2f}", flush=True)
    if "store" in result and result["store"]["bad_reads"]:
        print(f"store: {result['store']['bad_reads']} reads differ from what was written", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if "store" in result and result["store"]["bad_reads"]:
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
