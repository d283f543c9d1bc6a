"""Does Triton compile the prefix-attention kernel again for a page table that is only 8-byte aligned?

Triton specialises pointer arguments on 16-byte alignment. Before `hicache.engine.engine.pack_aligned`, a step's page
tables were views at any int64 offset of one uploaded array, and the H200 step logs showed one or two prefill steps
per server run 0.3-0.5 s slower than their size explains (bench/RESULTS.md, 'Triton alignment recompile'). In a fresh
process this times: a first call (compile), a second call with an aligned table, then the first call with a table one
int64 further on (8-byte aligned), then a second such call.

Usage (H200): python3 bench/gpu/align_probe.py
"""

from __future__ import annotations

import time

import torch

from hicache.engine.kernels.prefill import paged_prefix_attention


def main() -> None:
    heads, kv_heads, dim, page = 32, 8, 128, 64
    new, total = 1024, 4096
    pages = total // page
    pool = torch.randn(2, 2 * pages, page, kv_heads, dim, device="cuda").bfloat16()
    backing = torch.randperm(2 * pages, device="cuda")[: pages + 2]
    aligned, shifted = backing[:pages], backing[1 : pages + 1]
    q = torch.randn(new, heads, dim, device="cuda").bfloat16()
    for label, table in (("first call (aligned)", aligned), ("aligned again", aligned),
                         ("8-byte aligned, first", shifted), ("8-byte aligned, again", shifted)):
        torch.cuda.synchronize()
        start = time.perf_counter()
        paged_prefix_attention(q, pool[0], pool[1], table, total)
        torch.cuda.synchronize()
        print(f"{label:24s} ptr % 16 = {table.data_ptr() % 16:2d}: {1000 * (time.perf_counter() - start):8.1f} ms")


if __name__ == "__main__":
    main()
