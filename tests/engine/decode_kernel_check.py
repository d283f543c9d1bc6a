"""The decode kernel's outputs for test_decode_kernel.py to compare, under TRITON_INTERPRET=1 (Triton's CPU
interpreter must be chosen before Triton is imported): run by interpreted_checks.py (its "decode" section), or
alone.

Usage: python decode_kernel_check.py OUT.pt
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from hicache.engine import load_model  # noqa: E402
from hicache.engine.attention import DecodePlan  # noqa: E402
from hicache.engine.kernels.decode import kernel_supported, paged_decode_attention  # noqa: E402
from hicache.engine.model import ForwardBatch  # noqa: E402


def kernel_cases() -> dict:
    """Random pools and page tables; the kernel's outputs next to its inputs."""
    gen = torch.Generator().manual_seed(0)
    pages, page_size, kv_heads, head_dim, heads = 40, 16, 2, 64, 6  # GQA groups of 3
    kv = torch.randn(2, pages, page_size, kv_heads, head_dim, generator=gen)
    lens = [1, 16, 17, 100, 33, 0]  # one token, a full page, a page + 1, several pages, ..., empty
    table = torch.full((len(lens), 8), -1, dtype=torch.int64)  # -1: never read past a sequence's pages
    order = torch.randperm(pages, generator=gen)
    used = 0
    for row, n in enumerate(lens):
        count = -(-n // page_size)
        table[row, :count] = order[used : used + count]
        used += count
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, head_dim, generator=gen)
    q = qkv[:, :heads]  # strided rows, as the model passes a view of its fused qkv projection
    seq_lens = torch.tensor(lens)
    return {
        "kv": kv, "table": table, "lens": seq_lens, "q": q.clone(), "page_size": page_size,
        "splits_1": paged_decode_attention(q, kv[0], kv[1], table, seq_lens, num_splits=1),
        "splits_3": paged_decode_attention(q, kv[0], kv[1], table, seq_lens, num_splits=3),
        "splits_16": paged_decode_attention(q, kv[0], kv[1], table, seq_lens, num_splits=16),  # mostly empty
        "supported": kernel_supported(q.device, page_size, head_dim),
    }


def model_cases() -> dict:
    """random:tiny: logits of a decode step through `decode_forward` (kernel) and `forward` (reference)."""
    torch.manual_seed(0)
    model, _ = load_model("random:tiny", torch.float32, torch.device("cpu"))
    page_size = 16
    kv = torch.zeros(model.kv_pool_shape(16, page_size))
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (5, 16, 40)]
    tables = [torch.tensor([3]), torch.tensor([7, 1]), torch.tensor([15, 2, 9, 4])]
    model.decode_kernel = False
    for prompt, table in zip(prompts, tables):  # prefill through the reference
        n = len(prompt)
        pos = torch.arange(n)
        model(ForwardBatch(torch.tensor(prompt), pos, table[pos // page_size] * page_size + pos % page_size,
                           [n], [n], [table]), kv, page_size)
    ids = torch.tensor([11, 22, 33])
    positions = torch.tensor([len(p) for p in prompts])
    slots = torch.stack([t[p // page_size] * page_size + p % page_size for t, p in zip(tables, positions)])
    width = max(len(t) for t in tables)
    table = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables])
    reference_kv = kv.clone()
    reference = model(
        ForwardBatch(ids, positions, slots, (positions + 1).tolist(), [1, 1, 1], list(tables)), reference_kv, page_size
    )
    model.decode_kernel = True
    eager_kernel = model(
        ForwardBatch(ids, positions, slots, (positions + 1).tolist(), [1, 1, 1], list(tables)), kv.clone(), page_size
    )
    kernel_kv = kv.clone()
    decode = model.decode_forward(ids, positions, slots, DecodePlan(table, positions + 1), kernel_kv)
    return {"reference": reference, "eager_kernel": eager_kernel, "decode_forward": decode,
            "reference_kv": reference_kv, "kernel_kv": kernel_kv}


if __name__ == "__main__":
    torch.save({"kernel": kernel_cases(), "model": model_cases()}, sys.argv[1])
