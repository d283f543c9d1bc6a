"""The prefix kernel's outputs for test_prefill_kernel.py to compare, under TRITON_INTERPRET=1 (Triton's CPU
interpreter must be chosen before Triton is imported): run by interpreted_checks.py (its "prefill" and "mixed"
sections), or alone.

Usage: python prefill_kernel_check.py OUT.pt [mixed]   (mixed: only the step mixing both kernels, which also needs the
decode kernel to run under the interpreter)
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from hicache.engine import load_model  # noqa: E402
from hicache.engine.assembly import warm_up_key_splits  # noqa: E402
from hicache.engine.kernels.prefill import (  # noqa: E402
    PrefixKernelConfig,
    paged_prefix_attention,
    prefix_kernel_available,
)
from hicache.engine.model import ForwardBatch  # noqa: E402

# (seq_len, new tokens): a whole prompt, prefixes on and off page boundaries (46 - 16: the first query at position
# 30, one short of its page's last), several 16-row blocks, one token
CASES = [(5, 5), (40, 7), (48, 16), (46, 16), (100, 33), (129, 1), (192, 64), (17, 16)]
# launch shapes (pages of 16): a GQA group of 3 packed in 16 rows (5 tokens, one spare row) or a head per
# program; one page, two pages or half a page of keys per step; pages loaded as TMA boxes
CONFIGS = {
    "packed, a page a step": PrefixKernelConfig(block_m=16, block_n=16, pack_gqa=True, num_warps=4, num_stages=1),
    "a head each, a page a step": PrefixKernelConfig(block_m=16, block_n=16, pack_gqa=False, num_warps=4,
                                                     num_stages=1),
    "packed, two pages a step": PrefixKernelConfig(block_m=32, block_n=32, pack_gqa=True, num_warps=4,
                                                   num_stages=1),
    "a head each, half a page a step": PrefixKernelConfig(block_m=16, block_n=8, pack_gqa=False, num_warps=4,
                                                          num_stages=1),
    "TMA boxes, a head each": PrefixKernelConfig(block_m=16, block_n=16, pack_gqa=False, num_warps=4, num_stages=1,
                                                 tma=True),
    "TMA boxes, packed": PrefixKernelConfig(block_m=16, block_n=16, pack_gqa=True, num_warps=4, num_stages=1,
                                            tma=True),
}
# the keys shared out among programs (`num_splits`): 2 and 3 splits, and 7, more than the longest case has steps of
# keys (splits with none to walk), with a head each or a packed group, plain or TMA
SPLIT_CASES = {
    "a head each, 2 splits": (CONFIGS["a head each, a page a step"], 2),
    "packed, 3 splits": (CONFIGS["packed, a page a step"], 3),
    "a head each, half a page a step, 7 splits": (CONFIGS["a head each, half a page a step"], 7),
    "TMA boxes, packed, 3 splits": (CONFIGS["TMA boxes, packed"], 3),
}


def kernel_cases() -> dict:
    """A random pool with a shuffled page table, GQA groups of 3; the kernel's output per case and launch shape."""
    gen = torch.Generator().manual_seed(0)
    pages, page_size, kv_heads, head_dim, heads = 16, 16, 2, 32, 6
    kv = torch.randn(2, pages, page_size, kv_heads, head_dim, generator=gen)
    table = torch.randperm(pages, generator=gen)
    out = {"kv": kv, "table": table, "page_size": page_size, "cases": []}
    for seq_len, new in CASES:
        qkv = torch.randn(new, heads + 2 * kv_heads, head_dim, generator=gen)
        q = qkv[:, :heads]  # strided rows, as the model passes a view of its fused qkv projection
        # every slot the sequence does not own holds NaN, as freed pool memory may: none of it may reach the output
        poisoned = torch.full_like(kv, float("nan"))
        slots = (table[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:seq_len]
        poisoned.view(2, -1, kv_heads, head_dim)[:, slots] = kv.view(2, -1, kv_heads, head_dim)[:, slots]
        got = {name: paged_prefix_attention(q, poisoned[0], poisoned[1], table, seq_len, config)
               for name, config in CONFIGS.items()}
        got.update({name: paged_prefix_attention(q, poisoned[0], poisoned[1], table, seq_len, config,
                                                 num_splits=splits)
                    for name, (config, splits) in SPLIT_CASES.items()})
        out["cases"].append({"seq_len": seq_len, "q": q.clone(), "got": got})
    return out


def model_cases() -> dict:
    """random:tiny: logits and KV of a chunk over a cached prefix, through the kernel and through SDPA."""
    torch.manual_seed(0)
    model, _ = load_model("random:tiny", torch.float32, torch.device("cpu"))
    page_size = 16
    prompt = torch.randint(0, 512, (70,))
    table = torch.tensor([9, 2, 14, 5, 11])

    def batch(start: int, end: int) -> ForwardBatch:
        pos = torch.arange(start, end)
        return ForwardBatch(prompt[start:end], pos, table[pos // page_size] * page_size + pos % page_size,
                            [end], [end - start], [table])

    kv = torch.zeros(model.kv_pool_shape(16, page_size))
    model(batch(0, 37), kv, page_size)  # the cached prefix: 37 tokens, not page-aligned
    results = {}
    for kernel in (False, True):
        model.prefill_kernel = kernel
        pool = kv.clone()
        results[kernel] = (model(batch(37, 70), pool, page_size, all_logits=True), pool)
    # the engine's warm-up of the split kernel and its merges (CUDA only in build_engine), over this pool's layer 0
    splits_warmed = warm_up_key_splits(model, kv[0], table[:2], page_size)
    return {"supported": model.uses_prefill_kernel(page_size), "ran": prefix_kernel_available(torch.device("cpu")),
            "splits_warmed": splits_warmed, "sdpa": results[False][0],
            "kernel": results[True][0], "sdpa_kv": results[False][1], "kernel_kv": results[True][1]}


def mixed_cases() -> dict:
    """random:tiny: one step mixing decodes, chunks over cached prefixes and a whole prompt, as the engine batches
    them, through both kernels and through the reference path (gather + SDPA); decodes first (the engine's order:
    the kernels read and write their rows in place) and last (gathered and scattered)."""
    torch.manual_seed(1)
    model, _ = load_model("random:tiny", torch.float32, torch.device("cpu"))
    page_size = 16
    # (cached tokens, new tokens, pages): two decodes, two chunks over prefixes, a prompt with nothing cached
    seqs = [(40, 1, [3, 17, 8]), (21, 1, [12, 1]), (37, 30, [9, 2, 14, 5, 11]), (16, 9, [20, 6]), (0, 12, [7])]
    prompts = [torch.randint(0, 512, (cached + new,)) for cached, new, _ in seqs]
    kv = torch.zeros(model.kv_pool_shape(24, page_size))

    def batch(order: list[int], only_cached: bool) -> ForwardBatch:
        ids, pos, slots, seq_lens, new_lens, tables = [], [], [], [], [], []
        for i in order:
            cached, new, pages = seqs[i]
            start, end = (0, cached) if only_cached else (cached, cached + new)
            table = torch.tensor(pages)
            p = torch.arange(start, end)
            ids.append(prompts[i][start:end])
            pos.append(p)
            slots.append(table[p // page_size] * page_size + p % page_size)
            seq_lens.append(end)
            new_lens.append(end - start)
            tables.append(table)
        return ForwardBatch(torch.cat(ids), torch.cat(pos), torch.cat(slots), seq_lens, new_lens, tables)

    model.prefill_kernel = model.decode_kernel = False
    model(batch([0, 1, 2, 3], only_cached=True), kv, page_size)  # the cached prefixes
    results = {}
    for name, order in (("decodes first", [0, 1, 2, 3, 4]), ("decodes last", [2, 4, 3, 0, 1])):
        for kernels in (False, True):
            model.prefill_kernel = model.decode_kernel = kernels
            pool = kv.clone()
            results[name, kernels] = (model(batch(order, only_cached=False), pool, page_size), pool)
    return {"ran": model.uses_prefill_kernel(page_size) and model.uses_decode_kernel(page_size),
            "results": results}


if __name__ == "__main__":
    if sys.argv[2:] == ["mixed"]:
        torch.save(mixed_cases(), sys.argv[1])
    else:
        torch.save({"kernel": kernel_cases(), "model": model_cases()}, sys.argv[1])
