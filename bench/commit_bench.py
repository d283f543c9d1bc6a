"""Host-side (Python) cost of the tier controller's commit / write-through path, per committed page, on CPU.

Replays the no-reuse 32k case of `bench/gpu/run.sh noloss` (8 requests x 32,768-token prompts, 64-token pages,
8,192-token prefill chunks = 128 pages, a GPU pool of exactly 4,096 pages, 2,048 host pages, 3,072 L3 pages)
against a real TierController on tiny CPU pages (4 KiB, so copies cost next to nothing and what is timed is the
controller's Python). Per engine step it makes the calls the scheduler makes: `begin_step`, `poll`, `alloc_device`
for the chunk, and `commit` of the request's growing token list (hicache/engine/scheduler.py `_commit`); a
request is admitted with `acquire` and released (its decode page freed) two requests later, as its decode steps
end while later requests prefill. After the last commit the engine idles (`begin_step`, `poll`, `idle`) until
the deferred backlog has started: "drain", when the GPU has nothing to run anyway.

The flush slice is set to what 8 MiB pages give on the H200 (1 GiB / 8 MiB = 128 pages per step).
Arms: off (GPU only), host (write-through to host), l3 (write-through to host and L3, posix backend in a
temporary directory, asynchronous worker as in the server). Reports microseconds per committed page of engine
thread time (wall, median of --reps runs) for commit and for all controller calls during the prefill steps.

    python bench/commit_bench.py [--arms off,host,l3] [--defer 0.25] [--reps 5] [--profile l3] [--sync-l3]

--sync-l3 runs L3 writes inline (deterministic: the printed stats digest must not change with an optimisation).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import pstats
import random
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch

from controller import CostModel, L3Worker, TierController, WritePolicy
from controller.backups import FLUSH_SLICE_BYTES
from radix import RadixTree, namespace_fingerprint
from tiers import DevicePool, HostPool, KVLayout, PageCopier

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, page_size=64, itemsize=2)  # 4 KiB pages
H200_PAGE_BYTES = 8 << 20  # Llama-3.1-8B, bf16, 64-token pages


class Timed:
    """Engine-thread wall time per controller call name, and the thread's CPU time in all of them (wall - CPU:
    waiting, mostly for the GIL held by the L3 threads)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu = 0.0

    def __call__(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        c0, t0 = time.thread_time(), time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds[name] += time.perf_counter() - t0
        self.cpu += time.thread_time() - c0
        return out


class TimedCopier:
    """The CPU copier, its calls timed apart: on the GPU they are CUDA launches, which this bench does not model,
    so "ctrl" (all calls minus the copier) is the controller's own Python."""

    def __init__(self, copier: PageCopier) -> None:
        self.copier = copier
        self.seconds = 0.0

    def to_host(self, device_pages: Any, host_pages: Any) -> Any:
        t0 = time.perf_counter()
        out = self.copier.to_host(device_pages, host_pages)
        self.seconds += time.perf_counter() - t0
        return out

    def to_device(self, host_pages: Any, device_pages: Any) -> Any:
        t0 = time.perf_counter()
        out = self.copier.to_device(host_pages, device_pages)
        self.seconds += time.perf_counter() - t0
        return out


def build(arm: str, args: argparse.Namespace, l3_dir: str) -> TierController:
    dev = DevicePool(LAYOUT, args.device_pages, torch.bfloat16, "cpu")
    host = HostPool(LAYOUT, args.host_pages, torch.bfloat16, pin_memory=False) if arm in ("host", "l3") else None
    l3 = worker = None
    if arm == "l3":
        from tiers.l3 import L3Store

        l3 = L3Store(l3_dir, args.disk_pages * LAYOUT.page_bytes, LAYOUT.page_bytes, namespace_fingerprint({}),
                     io_backend="posix", io_threads=8, sync_batch_pages=32)
        worker = L3Worker(l3, threads=8, queue_pages=args.queue_pages, batch_pages=32, synchronous=args.sync_l3)
    copier = TimedCopier(PageCopier(dev, host)) if host is not None else None
    policy = WritePolicy("write_through", "write_through", defer_above_free=args.defer)
    tree = RadixTree(LAYOUT.page_size, namespace_fingerprint({}), args.eviction_policy)
    cost = CostModel(LAYOUT.page_size, LAYOUT.page_bytes)
    ctrl = TierController(tree, dev, host, l3, copier, policy, cost, worker,
                          min(args.disk_pages, l3.capacity_pages) if l3 is not None else None)
    ctrl.writes.flush_slice_pages = ctrl.writes._flush_budget = FLUSH_SLICE_BYTES // H200_PAGE_BYTES  # as on the H200
    return ctrl


def prompts(args: argparse.Namespace) -> list[list[int]]:
    """The requests' token ids: random, so no two share a page."""
    rng = random.Random(args.seed)
    return [[rng.randrange(128_000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]


def replay(ctrl: TierController, requests: list[list[int]], args: argparse.Namespace) -> tuple[Timed, Timed, int]:
    """(prefill-step timings, drain timings, committed pages)."""
    ps = LAYOUT.page_size
    chunk = args.chunk_tokens // ps
    t = Timed()
    active: list[tuple[Any, list[int]]] = []
    committed = 0
    for tokens in requests:
        full_pages = len(tokens) // ps
        t("begin_step", ctrl.writes.begin_step)
        t("poll", ctrl.poll)
        ticket = t("acquire", ctrl.acquire, tokens, max_pages=(len(tokens) - 1) // ps, overlap=True)
        pages = ticket.prefix_pages()
        done = len(pages)
        first = True
        while done < full_pages:
            if not first:
                t("begin_step", ctrl.writes.begin_step)
                t("poll", ctrl.poll)
            first = False
            n = min(chunk, full_pages - done)
            new = t("alloc_device", ctrl.alloc_device, n)
            if new is None:
                raise RuntimeError("GPU pool exhausted: the replay holds too many requests")
            pages += new
            done += n
            pages[:done] = t("commit", ctrl.commit, ticket, tokens[: done * ps], pages[:done])
            committed += n
        decode = t("alloc_device", ctrl.alloc_device, 1)  # the decode tokens' page (never full: not committed)
        active.append((ticket, decode or []))
        if len(active) > args.decode_lag:
            old, spare = active.pop(0)
            t("release", ctrl.release, old)
            t("free_device", ctrl.free_device, spare)
    for old, spare in active:
        ctrl.release(old)
        ctrl.free_device(spare)
    drain = Timed()
    while ctrl.writes.deferred:
        drain("begin_step", ctrl.writes.begin_step)
        drain("poll", ctrl.poll)
        drain("idle", ctrl.idle)
    return t, drain, committed


def digest(ctrl: TierController) -> str:
    """A fingerprint of where every page ended up and of the counters (equal before and after a pure speed-up)."""
    h = hashlib.sha256(json.dumps(ctrl.stats.snapshot(), sort_keys=True).encode())
    for node in sorted(ctrl.tree.nodes(), key=lambda n: n.keys[0]):
        # node.loc[0], [1]: its GPU and host pages, None where it has no copy there
        where = (node.keys[0], node.num_pages, node.loc[0], node.loc[1], node.lock_ref, node.pin_ref)
        h.update(repr(where).encode())
    return h.hexdigest()[:16]


def run_once(arm: str, args: argparse.Namespace, profile: cProfile.Profile | None = None) -> dict[str, Any]:
    requests = prompts(args)
    with tempfile.TemporaryDirectory(prefix="commit-bench-") as d:
        ctrl = build(arm, args, d)
        if profile is not None:
            profile.enable()
        t, drain, committed = replay(ctrl, requests, args)
        copier_s = getattr(ctrl.copier, "seconds", 0.0)  # prefill steps and drain (no copier: none timed)
        if profile is not None:
            profile.disable()
        ctrl.worker.wait_idle()
        ctrl.poll()
        ctrl.check_integrity()
        out = {
            "commit_us": 1e6 * t.seconds["commit"] / committed,
            "total_us": 1e6 * sum(t.seconds.values()) / committed,
            "cpu_us": 1e6 * t.cpu / committed,
            "ctrl_us": 1e6 * (sum(t.seconds.values()) + sum(drain.seconds.values()) - copier_s) / committed,
            "drain_us": 1e6 * sum(drain.seconds.values()) / committed,
            "calls_us": {k: round(1e6 * v / committed, 2) for k, v in sorted(t.seconds.items())},
            "committed_pages": committed,
            "digest": digest(ctrl),
            "stats": ctrl.stats.snapshot(),
        }
        ctrl.close()
        ctrl.l3.close()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="off,host,l3")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--defer", type=float, default=0.25, help="write_policy.defer_above_free (h200 config: 0.25)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--chunk-tokens", type=int, default=8192)
    ap.add_argument("--device-pages", type=int, default=4096)
    ap.add_argument("--host-pages", type=int, default=2048)
    ap.add_argument("--disk-pages", type=int, default=3072)
    ap.add_argument("--queue-pages", type=int, default=512, help="L3 write queue (h200 config: 512)")
    ap.add_argument("--decode-lag", type=int, default=2, help="requests prefilled while one decodes")
    ap.add_argument("--eviction-policy", default="lrfu")
    ap.add_argument("--sync-l3", action="store_true", help="L3 writes inline (deterministic digest)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--profile", help="arm to run once under cProfile (top functions by own time)")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = {}
    for arm in args.arms.split(","):
        runs = [run_once(arm, args) for _ in range(args.reps)]
        med = {k: statistics.median(r[k] for r in runs) for k in ("commit_us", "total_us", "cpu_us", "drain_us",
                                                                   "ctrl_us")}
        calls = {k: statistics.median(r["calls_us"][k] for r in runs) for k in runs[0]["calls_us"]}
        digests = sorted({r["digest"] for r in runs})
        results[arm] = {**med, "calls_us": calls, "digests": digests, "stats": runs[0]["stats"]}
        print(f"{arm:5s} commit {med['commit_us']:7.2f} us/page   all calls {med['total_us']:7.2f} us/page   "
              f"(CPU {med['cpu_us']:6.2f})   drain {med['drain_us']:6.2f}   "
              f"all but copies, with drain {med['ctrl_us']:6.2f} us/page")
        print(f"      {runs[0]['committed_pages']} pages, median of {args.reps}; digest {','.join(digests)}")
        print("      per call (us/page): " + ", ".join(f"{k} {v:.2f}" for k, v in calls.items()))
        s = runs[0]["stats"]
        print(f"      evictions {s['evictions']} drops {s['drops']} deferred {s['deferred_pages']} "
              f"demoted {s['pages_demoted']}")
    if args.profile:
        prof = cProfile.Profile()
        run_once(args.profile, args, prof)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        print(buf.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
