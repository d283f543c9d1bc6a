"""Prefill attention over a cached prefix on one layer: PyTorch SDPA (gather + flash, bottom-right causal, GQA)
against the Triton prefix kernel that reads the pool in place (hicache.engine.kernels.prefill).

Llama-3.1-8B heads (32 query, 8 KV, head_dim 128), bf16, 64-token pages scattered over the pool; per case the
median of --repeats timed calls of each path, TFLOPS (4 * heads * head_dim * visible query-key pairs), their
ratio, and the largest difference between the two outputs.

Usage (H200): python3 bench/gpu/prefix_attention_bench.py [--new 1024] [--contexts 1024,2048,4096,8192] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict

import torch
from torch.nn.attention import sdpa_kernel

from hicache.engine.attention import CUDA_SDPA_BACKENDS, PrefillSeq, _attend_prefill
from hicache.engine.kernels.prefill import PrefixKernelConfig, default_configs, paged_prefix_attention


def timed(fn, repeats: int) -> float:
    """Median milliseconds of fn() over `repeats` calls, each timed with CUDA events."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sweep_configs() -> list[PrefixKernelConfig]:
    """Launch shapes to compare: rows x keys per step, GQA packing, warps, pipeline stages."""
    configs = []
    for pack in (True, False):
        for block_m, block_n in ((128, 64), (128, 128), (64, 64), (64, 128)):
            for warps in (4, 8):
                for stages in (2, 3):
                    configs.append(PrefixKernelConfig(block_m, block_n, pack, warps, stages))
        for block_m in (64, 128):  # keys and values as TMA boxes, a 64-token page a step
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    configs.append(PrefixKernelConfig(block_m, 64, pack, warps, stages, tma=True))
    return configs


def case(new: int, context: int, repeats: int, configs: list[PrefixKernelConfig]) -> list[dict]:
    heads, kv_heads, dim, page_size = 32, 8, 128, 64
    total = context + new
    num_pages = -(-total // page_size) * 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = torch.randn(2, num_pages, page_size, kv_heads, dim, generator=gen, device="cuda").bfloat16()
    table = torch.randperm(num_pages, generator=gen, device="cuda")[: -(-total // page_size)]
    slots = (table[:, None] * page_size + torch.arange(page_size, device="cuda")).reshape(-1)[:total]
    q = torch.randn(new, heads, dim, generator=gen, device="cuda").bfloat16()
    k_flat, v_flat = pool[0].view(-1, kv_heads, dim), pool[1].view(-1, kv_heads, dim)
    k, v = k_flat[slots[context:]], v_flat[slots[context:]]
    positions = torch.arange(context, total, device="cuda")
    mask = torch.arange(total, device="cuda")[None, :] <= positions[:, None]
    seq = PrefillSeq(0, new, total, slots, mask)

    def sdpa():
        with sdpa_kernel(CUDA_SDPA_BACKENDS):
            return _attend_prefill(q, k, v, pool, k_flat, v_flat, seq)

    pairs = new * context + new * (new + 1) / 2  # visible (query, key) pairs
    flops = 4 * heads * dim * pairs
    ms_sdpa = timed(sdpa, repeats)
    expected = sdpa().float()
    rows = []
    for config in configs:
        def kernel(config=config):
            return paged_prefix_attention(q, pool[0], pool[1], table, total, config)

        try:
            diff = (expected - kernel().float()).abs().max().item()
        except Exception as e:  # a launch shape this GPU cannot fit (shared memory): reported, not timed
            rows.append({"new": new, "context": context, "config": asdict(config), "error": str(e)[:200]})
            continue
        ms_kernel = timed(kernel, repeats)
        rows.append({"new": new, "context": context, "config": asdict(config), "sdpa_ms": ms_sdpa,
                     "kernel_ms": ms_kernel, "sdpa_tflops": flops / ms_sdpa / 1e9,
                     "kernel_tflops": flops / ms_kernel / 1e9, "kernel_vs_sdpa_time": ms_kernel / ms_sdpa,
                     "max_abs_diff": diff})
    return rows


def describe(config: dict) -> str:
    return (f"{config['block_m']}x{config['block_n']} {'packed' if config['pack_gqa'] else 'per-head'} "
            f"w{config['num_warps']} s{config['num_stages']}{' tma' if config['tma'] else ''}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=1024)
    ap.add_argument("--contexts", default="1024,2048,4096,8192")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="time every launch shape of sweep_configs(), not only "
                    "the default (the first of default_configs for 64-token pages)")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda")
    configs = sweep_configs() if args.sweep else default_configs(device, torch.empty(1, 64, 1, 1, device=device),
                                                                   torch.empty(1, 64, 1, 1, device=device))[:1]
    rows = [row for c in args.contexts.split(",") for row in case(args.new, int(c), args.repeats, configs)]
    print(f"{'new':>6} {'context':>8} {'launch shape':>28} {'sdpa ms':>8} {'kernel ms':>10} {'sdpa TF':>8} "
          f"{'kernel TF':>10} {'kernel/sdpa':>12} {'max diff':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['new']:>6} {r['context']:>8} {describe(r['config']):>28} failed: {r['error'][:60]}")
            continue
        print(f"{r['new']:>6} {r['context']:>8} {describe(r['config']):>28} {r['sdpa_ms']:>8.3f} "
              f"{r['kernel_ms']:>10.3f} {r['sdpa_tflops']:>8.0f} {r['kernel_tflops']:>10.0f} "
              f"{r['kernel_vs_sdpa_time']:>12.2f} {r['max_abs_diff']:>9.4f}")
    if args.sweep:  # the shape with the least total time over the contexts
        totals: dict[str, float] = {}
        for r in rows:
            key = describe(r["config"])
            totals[key] = totals.get(key, 0.0) + r.get("kernel_ms", float("inf"))
        for key, total in sorted(totals.items(), key=lambda kv: kv[1])[:5]:
            print(f"sum over contexts: {total:8.3f} ms  {key}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
