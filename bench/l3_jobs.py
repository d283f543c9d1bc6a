"""The L3 store driven by one-chunk jobs as `HicacheTier` drives it (hicache/integrations/vllm.py: an `L3Worker`
with `jobs_threads` reader threads and one writer), without vLLM, so that machines vLLM cannot be carried to (the
GPU machines) measure the tier's own side: stores and loads of `--chunks` chunks with `--inflight` jobs outstanding,
polled as vLLM's scheduler polls `get_finished_jobs`.

    python3 bench/l3_jobs.py --dir /dev/shm --chunks 1000 --inflight 8 64 --read-batch-mib 0 16 64

Prints (and returns) GB/s of chunk bytes, store / load, the median of `--repeats` runs, the batch sizes taking turns.
"""

from __future__ import annotations

import argparse
import mmap
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiers.l3.format import slot_bytes_for  # noqa: E402
from tiers.l3.store import L3Store  # noqa: E402
from tiers.l3.worker import L3Worker  # noqa: E402

NAMESPACE = b"l3-jobs-bench-ns"


def run_jobs(worker: L3Worker, keys: list[bytes], rows: torch.Tensor, inflight: int, load: bool) -> float:
    """Seconds to store (or load) every row as one-chunk jobs, at most `inflight` outstanding."""
    outstanding = submitted = failed = 0
    start = time.perf_counter()
    while submitted < len(keys) or outstanding:
        while submitted < len(keys) and outstanding < inflight:
            key, row = [keys[submitted]], [rows[submitted]]
            if load:
                worker.submit_read(submitted, key, row)
            elif not worker.submit_write(submitted, key, row):
                raise RuntimeError("the write queue is full")
            submitted += 1
            outstanding += 1
        done = worker.completions()
        outstanding -= len(done)
        failed += sum(not all(c.results) for c in done)
        if not done:
            time.sleep(0.0002)
    if failed:
        raise RuntimeError(f"{failed} jobs failed")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[tuple[int, int], tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--chunks", type=int, default=1000)
    parser.add_argument("--chunk-mib", type=float, default=2)
    parser.add_argument("--inflight", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--read-batch-mib", type=int, nargs="+", default=[0, 16])
    parser.add_argument("--jobs-threads", type=int, default=4)
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--sync-batch-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    chunk = int(args.chunk_mib * (1 << 20))
    rows = torch.frombuffer(mmap.mmap(-1, args.chunks * chunk), dtype=torch.uint8).view(args.chunks, chunk)
    rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8))
    expected = rows.clone()
    sync_chunks = max(1, (args.sync_batch_mib << 20) // chunk)
    nbytes = args.chunks * chunk
    results: dict[tuple[int, int], tuple[float, float]] = {}
    for inflight in args.inflight:
        runs: dict[int, list[tuple[float, float]]] = {b: [] for b in args.read_batch_mib}
        for r in range(args.repeats):
            for batch in args.read_batch_mib:
                path = tempfile.mkdtemp(prefix="l3-jobs-", dir=args.dir)
                try:
                    with L3Store(path, (args.chunks + 16) * slot_bytes_for(chunk), chunk, NAMESPACE,
                                 io_threads=args.io_threads, sync_batch_pages=sync_chunks) as store:
                        store.settle()
                        worker = L3Worker(store, threads=args.jobs_threads, batch_pages=sync_chunks,
                                          read_batch_bytes=batch << 20)
                        keys = [(r * args.chunks + i).to_bytes(16, "little") for i in range(args.chunks)]
                        stored = run_jobs(worker, keys, rows, inflight, load=False)
                        rows.zero_()
                        loaded = run_jobs(worker, keys, rows, inflight, load=True)
                        worker.close()
                        if not torch.equal(rows, expected):
                            raise RuntimeError("loaded bytes differ from the stored ones")
                        runs[batch].append((nbytes / stored / 1e9, nbytes / loaded / 1e9))
                finally:
                    shutil.rmtree(path, ignore_errors=True)
        for batch, got in runs.items():
            store_gbps = statistics.median(g[0] for g in got)
            load_gbps = statistics.median(g[1] for g in got)
            results[(inflight, batch)] = (store_gbps, load_gbps)
            print(f"{args.dir}: {inflight:3d} in flight, read batch {batch:3d} MiB: store {store_gbps:6.2f} GB/s, "
                  f"load {load_gbps:6.2f} GB/s", flush=True)
    return results


if __name__ == "__main__":
    main()
