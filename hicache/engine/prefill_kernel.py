"""Prefill attention over a cached prefix in Triton: the new tokens' queries read K/V straight from the pool.

With a cached prefix, the SDPA path (`hicache.engine.attention`) first gathers the sequence's whole context
out of the paged pool into a contiguous copy, then runs flash attention with a bottom-right causal mask. On
the H200 that flash kernel ran at ~206 TFLOPS for 1,024 new tokens over a 7k-token context (bench/RESULTS.md,
sixth session), as long as all of the round's GEMMs. This kernel walks the page table instead: one program per
(block of new tokens, query head), one page of keys per step of an online softmax, the causal mask applied only
on the pages that reach the block's own positions.

Opt-in (`model.prefill_attention: triton`) until it is measured against SDPA on a GPU. Inputs are device
tensors; nothing here syncs with the host. Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hicache.engine.decode_kernel import triton

if triton is not None:
    import triton.language as tl

    # the lengths change with every call: not specialised on, so serving compiles the kernel once
    @triton.jit(do_not_specialize=["n_new", "seq_len", "stride_qt", "stride_ot"])
    def _prefix_attention_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, out_ptr,
        n_new, seq_len,
        stride_qt, stride_qh,
        stride_kp, stride_ks, stride_kh,
        stride_ot, stride_oh,
        qk_scale,
        GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        block = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # new tokens of this program
        row_ok = rows < n_new
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=row_ok[:, None],
                    other=0.0)
        positions = seq_len - n_new + rows  # absolute position of each query (padding rows: >= seq_len)
        first = seq_len - n_new + block * BLOCK_M
        visible_end = tl.minimum(first + BLOCK_M, seq_len)  # no row sees a key at or past this
        unmasked_end = (first + 1) // PAGE * PAGE  # whole pages every row of the block sees
        slots = tl.arange(0, PAGE)
        kv_offsets = slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start in range(0, unmasked_end, PAGE):
            page = tl.load(table_ptr + start // PAGE)
            k = tl.load(k_ptr + page * stride_kp + kv_offsets)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.math.exp2(scores - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + page * stride_kp + kv_offsets)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        # the pages that reach the block's own positions: key j is visible to the query at position i iff j <= i.
        # Every row sees key 0, so a row's running max is finite after its first page here or above
        for start in range(unmasked_end, visible_end, PAGE):
            page = tl.load(table_ptr + start // PAGE)
            keys = start + slots
            in_seq = keys < seq_len
            k = tl.load(k_ptr + page * stride_kp + kv_offsets, mask=in_seq[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            scores = tl.where((keys[None, :] <= positions[:, None]) & in_seq[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.math.exp2(scores - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + page * stride_kp + kv_offsets, mask=in_seq[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_prefix_attention(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, page_table: Tensor, seq_len: int, block_m: int | None = None,
) -> Tensor:
    """Causal attention of one sequence's new tokens (the last q.shape[0] of its seq_len) over all its keys.

    q: [n_new, num_heads, head_dim] (rows may be strided, head_dim contiguous); k_pool, v_pool: [num_pages,
    page_size, num_kv_heads, head_dim], one layer of the pool, the new tokens' K/V already written; page_table:
    [>= ceil(seq_len / page_size)] integer page ids. Returns [n_new, num_heads, head_dim] in q's dtype.
    Needs `hicache.engine.decode_kernel.kernel_supported` for the device, page size and head_dim.
    """
    n_new, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pool.shape
    if not 0 < n_new <= seq_len or page_table.numel() * page_size < seq_len:
        raise ValueError(f"{n_new} new tokens of a {seq_len}-token sequence with {page_table.numel()} pages "
                         f"of {page_size}")
    if q.stride(-1) != 1 or k_pool.stride(-1) != 1 or k_pool.stride() != v_pool.stride():
        raise ValueError("paged_prefix_attention needs head_dim-contiguous q, k and v, k and v alike")
    out = torch.empty(n_new, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if block_m is None:
        block_m = 128 if q.is_cuda else 16
    grid = (triton.cdiv(n_new, block_m), num_heads)
    _prefix_attention_kernel[grid](
        q, k_pool, v_pool, page_table, out,
        n_new, seq_len,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        out.stride(0), out.stride(1),
        (1.0 / math.sqrt(head_dim)) * math.log2(math.e),
        GROUP=num_heads // num_kv_heads, PAGE=page_size, HEAD_DIM=head_dim, BLOCK_M=block_m,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=8 if block_m >= 128 else 4, num_stages=3,
    )
    return out
