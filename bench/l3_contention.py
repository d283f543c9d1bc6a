"""Does the L3 tax the engine thread, and does it keep its speed while the engine thread is busy?

    .venv/bin/python bench/l3_contention.py --dir /dev/shm --page-bytes 8388608 --pages 64 --seconds 4

The engine thread is modelled by a loop of steps of pure-Python work (scheduling-like: dicts, lists, sorting;
about `--step-ms` each), which like the real engine thread submits L3 work and applies completions between
steps. Three phases: the steps alone, the L3 traffic alone (the main thread only submits and waits), and both.
The L3 traffic writes batches of pages from a page-aligned host pool through the controller's L3 worker and
reads each batch back (one page of each is compared with what was written), as serving does.

Reported: the steps' mean and p90 time with the L3 busy over the steps alone (1.0 = no tax), and the L3's
throughput with the steps running over the L3 alone (1.0 = full speed under load).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiers.l3 import L3Store  # noqa: E402
from tiers.l3.format import slot_bytes_for  # noqa: E402
from tiers.l3.process import L3Process  # noqa: E402
from tiers.l3.worker import L3Worker  # noqa: E402
from tiers.pinned import shared_buffer  # noqa: E402

NAMESPACE = b"l3-contention-01"
GB = 1e9


def python_work(units: int) -> int:
    """Scheduling-like pure-Python work: build, index and sort small records."""
    total = 0
    for u in range(units):
        rows = [(i * 7919 + u) % 1009 for i in range(200)]
        table = {r: i for i, r in enumerate(rows)}
        total += sum(sorted(table)[:10]) + len(table)
    return total


def calibrate(step_ms: float) -> int:
    """Units of `python_work` that take about step_ms on this machine."""
    start = time.perf_counter()
    python_work(50)
    per_unit = (time.perf_counter() - start) / 50
    return max(1, int(step_ms / 1e3 / per_unit))


class Traffic:
    """Keeps the L3 worker busy: write a batch, read it back when written, drop it once read."""

    def __init__(self, worker: L3Worker, store: L3Store, pool: torch.Tensor, readback: torch.Tensor, batch: int):
        self.worker, self.store, self.pool, self.readback, self.batch = worker, store, pool, readback, batch
        self.slots = pool.shape[0] // batch  # batches in flight at most
        self.next_key = 0
        self.free = list(range(self.slots))
        self.bytes_written = self.bytes_read = 0
        self.bad = 0
        self.checked = 0

    def _keys(self) -> list[bytes]:
        keys = [(self.next_key + i).to_bytes(16, "little") for i in range(self.batch)]
        self.next_key += self.batch
        return keys

    def pump(self) -> None:
        """Apply completions and submit new work (the engine thread's share: call between steps)."""
        for c in self.worker.completions():
            slot, keys = c.token
            pages = self.batch * self.pool.shape[1]
            if c.kind == "write":
                self.bytes_written += pages
                views = list(self.readback[slot * self.batch:(slot + 1) * self.batch])
                self.worker.submit_read((slot, keys), keys, views)
            else:
                self.bytes_read += pages
                first = slot * self.batch + self.checked % self.batch  # one page per batch: checking costs little
                self.checked += 1
                if not all(c.results) or not torch.equal(self.readback[first], self.pool[first]):
                    self.bad += 1
                self.store.delete(keys)
                self.free.append(slot)
        while self.free:
            slot = self.free.pop()
            keys = self._keys()
            views = list(self.pool[slot * self.batch:(slot + 1) * self.batch])
            if not self.worker.submit_write((slot, keys), keys, views):
                self.free.append(slot)
                break


def aligned_pool(pages: int, page_bytes: int) -> torch.Tensor:
    buffer = mmap.mmap(-1, pages * page_bytes)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(pages, page_bytes)


def _engine_alone(args: argparse.Namespace) -> tuple[set[int], int, list[float]]:
    """Pin this thread (the engine thread) as --pin says, calibrate its steps and time them alone; returns the L3's
    CPUs, the step size and the step times."""
    cpus = sorted(os.sched_getaffinity(0))
    engine_cpus, l3_cpus = ({cpus[0]}, set(cpus[1:])) if args.pin and len(cpus) > 1 else (set(cpus), set(cpus))
    os.sched_setaffinity(0, engine_cpus)
    units = calibrate(args.step_ms)
    for _ in range(args.warmup):
        _step(units)
    deadline = time.perf_counter() + args.seconds
    steps = []
    while time.perf_counter() < deadline:
        steps.append(_step(units))
    return l3_cpus, units, steps


def _summary(args: argparse.Namespace, units: int, steps_alone: list[float], steps_busy: list[float],
             l3_alone_bps: float, l3_busy_bps: float, bad: int, checked: int, **extra) -> dict:
    p90 = lambda xs: statistics.quantiles(xs, n=10)[-1]  # noqa: E731
    return {
        "dir": args.dir, "page_bytes": args.page_bytes, "pages": args.pages, "batch": args.batch,
        "step_units": units, "pinned": bool(args.pin and len(os.sched_getaffinity(0)) == 1),
        "switch_interval_ms": sys.getswitchinterval() * 1e3, **extra,
        "step_ms_alone": {"mean": statistics.mean(steps_alone) * 1e3, "p90": p90(steps_alone) * 1e3},
        "step_ms_with_l3": {"mean": statistics.mean(steps_busy) * 1e3, "p90": p90(steps_busy) * 1e3},
        "step_tax_mean": statistics.mean(steps_busy) / statistics.mean(steps_alone),
        "step_tax_p90": p90(steps_busy) / p90(steps_alone),
        "l3_gbps_alone": l3_alone_bps / GB, "l3_gbps_with_steps": l3_busy_bps / GB,
        "l3_speed_under_load": l3_busy_bps / l3_alone_bps if l3_alone_bps else float("nan"),
        "bad_batches": bad, "checked_batches": checked,
    }


class _SharedPages:
    """Page-aligned pages in a memfd: what `tiers.l3.process.L3Process` needs of a host pool."""

    def __init__(self, pages: int, page_bytes: int) -> None:
        flat, self.share_fd = shared_buffer(pages * page_bytes, "l3-contention")
        self.buffer = flat.view(pages, page_bytes)
        self.capacity_pages, self.page_bytes = pages, page_bytes

    def page_view(self, page: int) -> torch.Tensor:
        return self.buffer[page]


def _open_l3(args: argparse.Namespace, path: str, l3_cpus: set[int]):
    """The store, its worker, the written pages and the read-back pages, for threads or for an L3 process."""
    store_args = dict(path=path, capacity_bytes=2 * args.pages * slot_bytes_for(args.page_bytes),
                      page_bytes=args.page_bytes, namespace=NAMESPACE, io_threads=args.threads,
                      sync_batch_pages=args.batch)
    if not args.l3_process:
        pool = aligned_pool(args.pages, args.page_bytes)
        readback = aligned_pool(args.pages, args.page_bytes)
        store = L3Store(**store_args)
        return store, None, pool, readback, None
    shared = _SharedPages(2 * args.pages, args.page_bytes)
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, l3_cpus)  # the child and all its threads inherit the L3's CPUs
    try:
        proc = L3Process(shared, store_args, threads=args.threads, queue_pages=args.pages, batch_pages=args.batch)
    finally:
        os.sched_setaffinity(0, mine)
    return proc.store, proc.worker, shared.buffer[:args.pages], shared.buffer[args.pages:], proc


def run(args: argparse.Namespace) -> dict:
    l3_cpus, units, steps_alone = _engine_alone(args)
    path = tempfile.mkdtemp(prefix="l3-contention-", dir=args.dir)
    store, remote_worker, pool, readback, proc = _open_l3(args, path, l3_cpus)
    pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8))
    box: dict = {}

    def l3_alone() -> None:
        """The L3 alone; run on the L3's CPUs, so that the threads it starts (worker, I/O pool) stay there."""
        os.sched_setaffinity(0, l3_cpus)
        worker = remote_worker or L3Worker(store, threads=args.threads, queue_pages=args.pages,
                                           batch_pages=args.batch)
        traffic = Traffic(worker, store, pool, readback, args.batch)
        start = time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            traffic.pump()
            time.sleep(0.0005)  # the engine thread idles: nothing but the L3 runs
        box.update(worker=worker, traffic=traffic, seconds=time.perf_counter() - start)

    try:
        helper = threading.Thread(target=l3_alone)
        helper.start()
        helper.join()
        worker, traffic = box["worker"], box["traffic"]
        try:
            l3_alone_bps = (traffic.bytes_written + traffic.bytes_read) / box["seconds"]
            worker.wait_idle()
            traffic.pump()  # what landed after the phase ended
            traffic.bytes_written = traffic.bytes_read = 0
            steps_busy = []
            start = time.perf_counter()
            while time.perf_counter() - start < args.seconds:
                traffic.pump()
                steps_busy.append(_step(units))
            busy_s = time.perf_counter() - start
            l3_busy_bps = (traffic.bytes_written + traffic.bytes_read) / busy_s
            worker.wait_idle()
            traffic.pump()
        finally:
            worker.close()
    finally:
        store.close()
        shutil.rmtree(path)
    return _summary(args, units, steps_alone, steps_busy, l3_alone_bps, l3_busy_bps, traffic.bad, traffic.checked,
                    l3_process=bool(args.l3_process))


def _step(units: int) -> float:
    start = time.perf_counter()
    python_work(units)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/dev/shm", help="where the L3 store lives")
    p.add_argument("--page-bytes", type=int, default=8 << 20)
    p.add_argument("--pages", type=int, default=64, help="host pool pages (and the write queue, in pages)")
    p.add_argument("--batch", type=int, default=16, help="pages per write / read")
    p.add_argument("--threads", type=int, default=4, help="L3 I/O threads")
    p.add_argument("--step-ms", type=float, default=10.0, help="Python work per engine step")
    p.add_argument("--seconds", type=float, default=4.0, help="length of each phase")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--pin", action="store_true",
                   help="engine thread on one CPU, the L3's threads on the others: a machine with cores to spare, "
                        "where what is left of the tax is the interpreter lock's")
    p.add_argument("--python-checksum", action="store_true",
                   help="checksum with the xxhash binding (holds the interpreter lock) instead of libxxhash")
    p.add_argument("--python-loop", action="store_true",
                   help="pages move through the Python piece loop (one lock round trip per 1 MiB piece) instead of "
                        "the native one (tiers/l3/native.py: one call per page, the lock released)")
    p.add_argument("--l3-process", action="store_true",
                   help="the store in a process of its own (tiers/l3/process.py, as cache.l3.worker: process) "
                        "instead of threads beside the engine thread")
    p.add_argument("--switch-interval-ms", type=float,
                   help="sys.setswitchinterval for the run (Python's default: 5 ms): how long a thread that wants "
                        "the interpreter lock waits before the holder is asked to let go")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    if args.python_loop:
        os.environ["HICACHE_NATIVE"] = "0"  # read when the store opens, here or in the L3 process
    if args.python_checksum:
        import tiers.l3.format

        tiers.l3.format._XXH3_64 = None
        tiers.l3.format._NativeStream.lib = None  # the pieces' streaming hash too
    result = run(args)
    pinned = (", engine thread pinned" if result["pinned"] else "") + f", switch {result['switch_interval_ms']:g} ms"
    print(f"{args.pages} x {args.page_bytes} B pages in {args.dir}, batches of {args.batch}, "
          f"{args.step_ms:.0f} ms Python steps ({os.cpu_count()} CPUs{pinned})")
    print(f"  engine steps: {result['step_ms_alone']['mean']:.2f} ms alone, "
          f"{result['step_ms_with_l3']['mean']:.2f} ms with the L3 busy: tax x{result['step_tax_mean']:.3f} "
          f"(p90 x{result['step_tax_p90']:.3f})")
    print(f"  L3 traffic: {result['l3_gbps_alone']:.2f} GB/s alone, {result['l3_gbps_with_steps']:.2f} GB/s "
          f"beside the steps: x{result['l3_speed_under_load']:.3f}; "
          f"{result['bad_batches']} of {result['checked_batches']} checked batches read back wrong")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
