"""Paged decode attention in Triton: one query token per sequence, keys read straight from the KV pool.

The PyTorch reference (`hicache.engine.attention`) gathers every decode sequence's K and V out of the pool
into a padded copy, then runs SDPA with a mask: at 8 sequences of 8k tokens that is 0.5 GB of copies per
layer. This kernel walks each sequence's page table instead and reads each page once, in place.

It is split-K ("flash decoding"): stage 1 runs one program per (sequence, KV head, split); a split covers
a contiguous run of the sequence's pages and keeps an online softmax over them for the whole GQA group of
query heads at once (the group's queries are the rows of one `tl.dot`, so each K/V page is loaded once per
group). Stage 2 merges the splits of each (sequence, head) by their log-sum-exp. The number of splits is
fixed per call, not per sequence, so a call's launch shape depends only on the batch size: CUDA graphs
capture it once per batch size and replay it for any sequence lengths.

Inputs are device tensors only (page table and lengths included): nothing here syncs with the host.
"""

from __future__ import annotations

import functools
import math
import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine uses the PyTorch reference
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (tests)


def kernel_supported(device: torch.device, page_size: int, head_dim: int) -> bool:
    """Whether `paged_decode_attention` runs on `device` (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    if triton is None or not (device.type == "cuda" or _INTERPRET):
        return False
    # tl.arange and tl.dot need power-of-two extents of at least 16
    return all(n >= 16 and n & (n - 1) == 0 for n in (page_size, head_dim))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def num_splits_for(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per sequence so that stage 1 has ~4 programs per SM (1 to 32): a function of the batch shape
    only, so a CUDA graph captured for a batch size is right for every sequence length."""
    return max(1, min(32, -(-4 * _multiprocessors(device) // max(1, batch * num_kv_heads))))


if triton is not None:

    # strides that change between calls (the page table's width, q's row stride) are not specialised on,
    # so serving compiles each kernel once instead of once per value class
    @triton.jit(do_not_specialize=["stride_qb", "stride_tb", "stride_ob", "stride_lb"])
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, mid_o_ptr, mid_lse_ptr,
        stride_qb, stride_qh,
        stride_kp, stride_kt, stride_kh,
        stride_tb,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh,
        qk_scale,  # softmax scale * log2(e): the kernel works in base 2
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
        NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(lens_ptr + seq).to(tl.int32)
        num_pages = tl.cdiv(seq_len, PAGE)
        per_split = tl.cdiv(num_pages, NUM_SPLITS)
        first = split * per_split
        last = tl.minimum(first + per_split, num_pages)

        rows = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        toks = tl.arange(0, PAGE)
        heads = kv_head * GROUP + rows
        row_ok = rows < GROUP
        q_ptrs = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        kv_offsets = toks[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
        for p in range(first, last):
            page = tl.load(table_ptr + seq * stride_tb + p).to(tl.int64)
            tok_ok = p * PAGE + toks < seq_len
            k = tl.load(k_ptr + page * stride_kp + kv_offsets, mask=tok_ok[:, None], other=0.0)
            v = tl.load(v_ptr + page * stride_kp + kv_offsets, mask=tok_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            s = tl.where(tok_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            probs = tl.exp2(s - m_new[:, None])
            denom = denom * alpha + tl.sum(probs, axis=1)
            acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
            m = m_new

        has_keys = last > first
        safe = tl.where(denom > 0, denom, 1.0)
        out = acc / safe[:, None]
        lse = tl.where(has_keys, m + tl.log2(safe), float("-inf"))
        o_ptrs = mid_o_ptr + seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :]
        tl.store(o_ptrs, out, mask=row_ok[:, None])
        tl.store(mid_lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=row_ok)

    # num_splits is not specialised on: the prefix kernel's merge (kernels/prefill.py) passes many values, each
    # padded to a power of two (SPLITS_PAD), so that a few variants serve them all (`merge_splits`)
    @triton.jit(do_not_specialize=["stride_ob", "stride_lb", "stride_outb", "num_splits"])
    def _decode_merge_kernel(
        mid_o_ptr, mid_lse_ptr, out_ptr,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh,
        stride_outb, stride_outh,
        num_splits,
        HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        splits = tl.arange(0, SPLITS_PAD)
        dims = tl.arange(0, HEAD_DIM)
        split_ok = splits < num_splits
        lse = tl.load(mid_lse_ptr + seq * stride_lb + head * stride_lh + splits, mask=split_ok, other=float("-inf"))
        top = tl.max(lse, axis=0)
        weights = tl.where(lse > float("-inf"), tl.exp2(lse - top), 0.0)
        o = tl.load(
            mid_o_ptr + seq * stride_ob + head * stride_oh + splits[:, None] * stride_os + dims[None, :],
            mask=split_ok[:, None] & (lse > float("-inf"))[:, None],
            other=0.0,
        )
        total = tl.maximum(tl.sum(weights, axis=0), 1e-30)  # 0 only for an empty sequence: output zeros
        merged = tl.sum(o * weights[:, None], axis=0) / total
        tl.store(out_ptr + seq * stride_outb + head * stride_outh + dims, merged.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, page_table: Tensor, seq_lens: Tensor, num_splits: int | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Attention of one query per sequence over its first seq_lens[b] cached keys.

    q: [B, num_heads, head_dim] (rows may be strided); k_pool, v_pool: [num_pages, page_size, num_kv_heads,
    head_dim], one layer of the pool (strided views allowed, head_dim contiguous); page_table: [B, >= pages]
    integer page ids; seq_lens: [B] integers (0 gives a zero output). Returns [B, num_heads, head_dim] in
    q's dtype (written into `out` when given). num_splits defaults to `num_splits_for` the batch.
    """
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pool.shape
    if q.stride(-1) != 1 or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("paged_decode_attention needs head_dim-contiguous q, k and v")
    if k_pool.stride() != v_pool.stride():
        raise ValueError("k_pool and v_pool must have the same strides")
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = num_splits_for(batch, num_kv_heads, q.device)
    mid_o = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    qk_scale = (1.0 / math.sqrt(head_dim)) * math.log2(math.e)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_pool, v_pool, page_table, seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        qk_scale,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), PAGE=page_size, HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )
    return merge_splits(mid_o, mid_lse, out)


def merge_splits(mid_o: Tensor, mid_lse: Tensor, out: Tensor) -> Tensor:
    """Add split attention's shares into `out`, each row and head by the splits' log-sum-exp (base 2): mid_o [rows,
    heads, splits, head_dim] float32, each share normalised; mid_lse [rows, heads, splits], -inf for a share that saw
    no key; out [rows, heads, head_dim], head_dim contiguous. Decoding's splits and the prefix kernel's
    (kernels/prefill.py) both end here."""
    rows, heads, splits, head_dim = mid_o.shape
    _decode_merge_kernel[(rows, heads)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        splits, HEAD_DIM=head_dim, SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
        num_warps=4,
    )
    return out
