"""hicache's engine tiers against the engines' own file tiers, on the same storage, in one run: vLLM's `fs`
secondary tier against `HicacheTier`, and SGLang's `HiCacheFile` against `HicacheStorage`, with the raw rate of
the storage (bench/l3_bench.py's `raw_best`) beside them. Two more arms, "vllm memcpy" and "sglang memcpy", measure
the calls themselves: a tier that only copies each chunk to and from memory it holds, over every core, with no file
and no checksum (`memcpy_tier`, `MemcpyBackend`). They touch no storage, so they are the same on every directory. With
one job in flight a job's round trip is all they pay, so no tier does better in substance; with more, a tier that
batches its jobs can pass them.

    .venv/bin/python bench/integrations_bench.py --dirs /dev/shm /tmp --chunks 1000 --chunk-mib 2 --json out.json

Each system stores `--chunks` chunks and loads them back, with 1, 8 and 64 jobs in flight (`--inflight`), each job
`--chunks-per-job` chunks, into a fresh directory per run. vLLM's tiers are driven through their own job API
(submit_store / submit_load / get_finished_jobs) from one thread that keeps the window full, as the scheduler does;
SGLang's backends are called (batch_set / batch_get) from one thread, a call of as many chunks as jobs in flight at
a time, as its cache controller's prefetch and backup threads call them (`run_sglang_calls`). Between the stores and
the loads, every file is written back and dropped from the page cache, so that loads read the storage. hicache's
checksums are on (they always are); its store syncs data and index as it always does, where vLLM's `fs` tier and
SGLang's `HiCacheFile` write without a sync (HiCacheFile through the page cache): "synced" adds, for every system,
the os.sync that writes back what the stores left dirty. A hicache store starts timing once its store has settled
(`settle`; the seconds that took are reported as "ready"). Every figure is the median of `--repeats` runs, the
systems taking turns. Figures are GB/s of chunk bytes.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from l3_bench import raw_best  # noqa: E402

GB = 1e9


def aligned_rows(chunks: int, chunk_bytes: int) -> np.ndarray:
    """`chunks` rows of `chunk_bytes` in page-aligned anonymous memory (as vLLM's primary tier and a host pool),
    filled with random bytes."""
    buf = mmap.mmap(-1, chunks * chunk_bytes)
    rows = np.frombuffer(buf, dtype=np.uint8).reshape(chunks, chunk_bytes)
    rng = np.random.default_rng(0)
    for i in range(chunks):
        rows[i] = rng.integers(0, 256, chunk_bytes, dtype=np.uint8) if i < 8 else rows[i % 8]
        rows[i, :8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    return rows


def drop_page_cache(directory: str) -> None:
    """Write back and forget the cached pages of every file under `directory`, so that the loads that follow
    read the storage, not memory (a cache is read back long after it was written). No effect on tmpfs."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return
    except OSError:
        pass
    for parent, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def settle(system: Any) -> float:
    """Seconds until a hicache tier's store has done its start-up work (`ChunkStore.settle`: a slab on tmpfs mapped
    in), so that the runs time the steady state a server serves in, not its first second; 0 for the engines' own
    tiers, which have none."""
    chunks = getattr(system, "chunks", None)
    if chunks is None or not hasattr(chunks, "settle"):
        return 0.0
    start = time.perf_counter()
    chunks.settle()
    return time.perf_counter() - start


def synced(store_s: float) -> float:
    """`store_s` plus the time to write back what the stores left dirty in the page cache (os.sync): the store
    time to durable bytes. hicache's jobs complete once synced; the engines' own tiers complete with their bytes in
    the page cache, which a sustained load cannot outrun for long."""
    start = time.perf_counter()
    os.sync()
    return store_s + time.perf_counter() - start


def figures(nbytes: int, store_s: float, durable_s: float, load_s: float, ready_s: float) -> dict[str, float]:
    return {"store_gbps": nbytes / store_s / GB, "durable_gbps": nbytes / durable_s / GB,
            "load_gbps": nbytes / load_s / GB, "ready_s": ready_s}


def median_figures(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over repeated runs (a 2-core box varies by a third run to run)."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


# ---- vLLM: the fs tier and HicacheTier through the SecondaryTierManager job API

def vllm_spec(chunk_bytes: int) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0",), group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": chunk_bytes, "block_size": 16}, engine_id="integrations-bench",
        model=OffloadingModelConfig(name="bench/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=True))
    return TieringOffloadingSpec(config)


def memcpy_tier(spec: Any, view: memoryview, threads: int) -> Any:
    """A vLLM secondary tier that only copies: each chunk to and from memory it already holds, split into one
    piece per thread, with no file, no checksum and no index: what the job API allows a tier that does no other work,
    each job's round trip through submit_*, a thread and get_finished_jobs. One job at a time, that round trip is
    the bound of any tier; with many, batching several jobs into one call (as `HicacheTier` does) can pass it."""
    from vllm.v1.kv_offload.base import LookupResult, RequestOffloadingContext
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

    class MemcpyTier(SecondaryTierManager):
        def __init__(self) -> None:
            super().__init__(spec, view, "memcpy")
            chunk = self.block_size_bytes
            self.rows = np.frombuffer(view, dtype=np.uint8).reshape(-1, chunk)
            self.held = np.zeros_like(self.rows)  # touched: the copies fault in nothing
            self.piece = -(-chunk // threads // 4096) * 4096 if chunk >= threads * 4096 else chunk
            self.pool = ThreadPoolExecutor(threads, thread_name_prefix="memcpy-tier")
            self.left: dict[int, int] = {}  # job -> its pieces not yet copied
            self.lock = threading.Condition()
            self.done: queue.SimpleQueue[int] = queue.SimpleQueue()

        def _copy(self, job_id: int, dst: np.ndarray, src: np.ndarray) -> None:
            np.copyto(dst, src)
            with self.lock:
                self.left[job_id] -= 1
                if self.left[job_id]:
                    return
                del self.left[job_id]
                self.lock.notify_all()
            self.done.put(job_id)

        def _submit(self, job: Any, load: bool) -> None:
            dst, src = (self.rows, self.held) if load else (self.held, self.rows)
            pieces = [(c, o) for c in job.chunk_ids for o in range(0, self.block_size_bytes, self.piece)]
            with self.lock:
                self.left[job.job_id] = len(pieces)
            for c, o in pieces:
                self.pool.submit(self._copy, job.job_id, dst[c, o:o + self.piece], src[c, o:o + self.piece])

        def submit_store(self, job_metadata: Any) -> None:
            self._submit(job_metadata, load=False)

        def submit_load(self, job_metadata: Any) -> None:
            self._submit(job_metadata, load=True)

        def get_finished_jobs(self) -> list[Any]:
            finished = []
            while not self.done.empty():
                finished.append(JobResult(job_id=self.done.get(), success=True))
            return finished

        def lookup(self, key: Any, req_context: Any) -> Any:
            return LookupResult.HIT

        def on_new_request(self, req_context: Any) -> Any:
            return RequestOffloadingContext()

        def drain_jobs(self) -> None:
            with self.lock:
                self.lock.wait_for(lambda: not self.left)

        def shutdown(self) -> None:
            self.pool.shutdown(wait=True)
            self.rows = self.held = np.empty(0, dtype=np.uint8)

    return MemcpyTier()


def vllm_tier(kind: str, directory: str, rows: np.ndarray, chunks: int) -> Any:
    spec = vllm_spec(rows.shape[1])
    view = memoryview(rows)
    if kind == "memcpy":
        return memcpy_tier(spec, view, len(os.sched_getaffinity(0)))
    if kind == "fs":
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

        return FileSystemTierManager(spec, view, "fs", root_dir=directory)
    from hicache.integrations.vllm import HicacheTier

    size_gib = chunks * (rows.shape[1] + 4096) / (1 << 30) * 1.05
    return HicacheTier(spec, view, "hicache", path=directory, size_gib=size_gib)


def run_vllm_jobs(tier: Any, keys: list[bytes], per_job: int, inflight: int, promotion: bool) -> float:
    """Seconds to store (or load) every key through the tier with at most `inflight` jobs outstanding."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    ctx = ReqContext(req_id="bench")
    jobs = [list(range(i, min(i + per_job, len(keys)))) for i in range(0, len(keys), per_job)]
    outstanding = 0
    failed = 0
    start = time.perf_counter()
    next_job = 0
    while next_job < len(jobs) or outstanding:
        while next_job < len(jobs) and outstanding < inflight:
            ids = jobs[next_job]
            job = TransferJob(job_id=next_job, keys=[keys[i] for i in ids], chunk_ids=np.array(ids, dtype=np.int64),
                              is_promotion=promotion, req_context=ctx)
            (tier.submit_load if promotion else tier.submit_store)(job)
            next_job += 1
            outstanding += 1
        done = list(tier.get_finished_jobs())
        outstanding -= len(done)
        failed += sum(not d.success for d in done)
        if not done:
            time.sleep(0.0002)
    elapsed = time.perf_counter() - start
    if failed:
        raise RuntimeError(f"{failed} jobs failed")
    return elapsed


def bench_vllm(kind: str, root: str, rows: np.ndarray, per_job: int, inflight: int) -> dict[str, float]:
    from vllm.v1.kv_offload.base import make_offload_key

    chunks, chunk_bytes = rows.shape
    keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(chunks)]
    directory = tempfile.mkdtemp(prefix=f"vllm-{kind}-", dir=root)
    expected = rows.copy()
    try:
        tier = vllm_tier(kind, directory, rows, chunks)
        try:
            ready_s = settle(tier)
            store_s = run_vllm_jobs(tier, keys, per_job, inflight, promotion=False)
            durable_s = synced(store_s)
            rows[:] = 0
            drop_page_cache(directory)
            load_s = run_vllm_jobs(tier, keys, per_job, inflight, promotion=True)
        finally:
            tier.shutdown()
        if not np.array_equal(rows, expected):
            raise RuntimeError(f"vllm {kind}: loaded bytes differ from the stored ones")
        return figures(chunks * chunk_bytes, store_s, durable_s, load_s, ready_s)
    finally:
        rows[:] = expected
        shutil.rmtree(directory, ignore_errors=True)


# ---- SGLang: HiCacheFile and HicacheStorage through the generic batch_set / batch_get

class FlatPool:
    """What a storage backend asks of SGLang's host pool on the generic path: flat pages of one shape."""

    layout = "page_first"
    page_size = 64

    def __init__(self, page_elements: int) -> None:
        self.page_elements = page_elements

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.empty(self.page_elements, dtype=torch.bfloat16)


class MemcpyBackend:
    """An SGLang storage backend that only copies: each page to and from memory it already holds (torch's copy,
    over all its threads), with no file, no checksum and no index: what a call of that many pages allows on this
    machine a backend that does no other work, as `memcpy_tier` is for vLLM's jobs."""

    def __init__(self, chunks: int, chunk_bytes: int) -> None:
        self.held = torch.zeros(chunks, chunk_bytes // 2, dtype=torch.bfloat16)
        self.slots: dict[str, int] = {}

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> bool:
        for key, value in zip(keys, values):
            self.held[self.slots.setdefault(key, len(self.slots))].copy_(value)
        return True

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[torch.Tensor | None]:
        for key, target in zip(keys, targets):
            target.copy_(self.held[self.slots[key]])
        return list(targets)


def sglang_backend(kind: str, directory: str, chunks: int, chunk_bytes: int) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    if kind == "memcpy":
        return MemcpyBackend(chunks, chunk_bytes)
    if kind == "file":
        extra: dict[str, Any] = {"file_storage_path": directory}
    else:
        extra = {"backend_name": "hicache", "module_path": "hicache.integrations.sglang",
                 "class_name": "HicacheStorage", "path": directory,
                 "size_gib": chunks * (chunk_bytes + 8192) / (1 << 30) * 1.05}
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name="bench/model", extra_config=extra)
    pool = FlatPool(chunk_bytes // 2)
    backend = StorageBackendFactory.create_backend("dynamic" if kind == "hicache" else "file", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def run_sglang_calls(call: Any, batches: list[list[int]]) -> float:
    """Seconds for one thread to make the calls one after another, as SGLang's cache controller does: its prefetch
    I/O thread (`prefetch_io_aux_func`) and its backup thread (`_page_backup`) each call the backend with a batch of
    up to STORAGE_BATCH_SIZE (128) pages at a time, and wait for it."""
    start = time.perf_counter()
    results = [call(batch) for batch in batches]
    elapsed = time.perf_counter() - start
    if not all(results):
        raise RuntimeError("a call failed")
    return elapsed


def bench_sglang(kind: str, root: str, rows: np.ndarray, per_job: int, inflight: int) -> dict[str, float]:
    chunks, chunk_bytes = rows.shape
    pages = torch.from_numpy(rows).view(torch.bfloat16)
    keys = [f"{i:064x}" for i in range(chunks)]
    per_call = per_job * inflight  # SGLang's pages in flight: those of the one call it waits for
    batches = [list(range(i, min(i + per_call, chunks))) for i in range(0, chunks, per_call)]
    directory = tempfile.mkdtemp(prefix=f"sglang-{kind}-", dir=root)
    expected = rows.copy()
    try:
        backend = sglang_backend(kind, directory, chunks, chunk_bytes)
        try:
            ready_s = settle(backend)
            store_s = run_sglang_calls(lambda ids: backend.batch_set([keys[i] for i in ids], [pages[i] for i in ids]),
                                       batches)
            durable_s = synced(store_s)
            rows[:] = 0
            drop_page_cache(directory)

            def load(ids: list[int]) -> bool:
                got = backend.batch_get([keys[i] for i in ids], [pages[i] for i in ids])
                return all(g is not None for g in got)

            load_s = run_sglang_calls(load, batches)
        finally:
            if hasattr(backend, "close"):
                backend.close()
        if not np.array_equal(rows, expected):
            raise RuntimeError(f"sglang {kind}: loaded bytes differ from the stored ones")
        return figures(chunks * chunk_bytes, store_s, durable_s, load_s, ready_s)
    finally:
        rows[:] = expected
        shutil.rmtree(directory, ignore_errors=True)


SYSTEMS = {"vllm fs": ("vllm", "fs"), "vllm HicacheTier": ("vllm", "hicache"),
           "sglang HiCacheFile": ("sglang", "file"), "sglang HicacheStorage": ("sglang", "hicache"),
           "vllm memcpy": ("vllm", "memcpy"), "sglang memcpy": ("sglang", "memcpy")}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dirs", nargs="+", default=["/dev/shm", "/tmp"], help="storage to measure, one each")
    parser.add_argument("--chunks", type=int, default=1000)
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--chunks-per-job", type=int, default=1)
    parser.add_argument("--inflight", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--raw-threads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (the median is reported)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    rows = aligned_rows(args.chunks, chunk_bytes)
    results: dict[str, Any] = {"chunks": args.chunks, "chunk_bytes": chunk_bytes, "per_job": args.chunks_per_job}
    for root in args.dirs:
        raw = raw_best(root, args.chunks * chunk_bytes, args.raw_threads, args.repeats)
        entry: dict[str, Any] = {"raw_write_gbps": raw["write"]["best"] / GB, "raw_read_gbps": raw["read"]["best"] / GB}
        print(f"{root}: raw write {entry['raw_write_gbps']:.2f} GB/s, read {entry['raw_read_gbps']:.2f} GB/s",
              flush=True)
        for inflight in args.inflight:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in args.systems}
            for _ in range(args.repeats):  # the systems take turns, so that a drift of the machine hits them alike
                for name in args.systems:
                    engine, kind = SYSTEMS[name]
                    run = bench_vllm if engine == "vllm" else bench_sglang
                    runs[name].append(run(kind, root, rows, args.chunks_per_job, inflight))
            for name, got in ((name, median_figures(r)) for name, r in runs.items()):
                entry[f"{name} @{inflight}"] = got
                print(f"{root}: {name:22} {inflight:3} in flight: store {got['store_gbps']:6.2f} GB/s "
                      f"({got['durable_gbps']:6.2f} synced), load {got['load_gbps']:6.2f} GB/s; "
                      f"ready after {got['ready_s']:.2f} s", flush=True)
        results[root] = entry
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
