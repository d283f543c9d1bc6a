"""Paged attention over the shared GPU KV pool.

The pool is one tensor ``kv[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]``; a token at
position p of a sequence lives in flat slot ``page_table[p // page_size] * page_size + p % page_size``.
`AttentionPlan` is built once per forward step (it depends only on the batch, not the layer) and `paged_attention`
runs one layer. Prefill chunks use torch SDPA; over a cached prefix, the Triton prefix kernel
(`hicache.engine.kernels.prefill`, which reads K/V in place) where it runs and is enabled. Decode tokens use the
Triton paged decode kernel (`hicache.engine.kernels.decode`) where it runs (CUDA, Triton installed, power-of-two
page size and head_dim), reading K/V in place through a page table; elsewhere they use the reference: gather into a
padded copy, then SDPA with a mask. A step where every sequence decodes can be described by a `DecodePlan` alone,
made of device tensors only, which is what CUDA graphs capture.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from torch.nn.utils.rnn import pad_sequence

from hicache.engine.kernels.decode import paged_decode_attention
from hicache.engine.kernels.prefill import PrefixKernelUnavailable, paged_prefix_attention

# cuDNN's SDPA builds a new execution plan for every new shape (1 ms of host time per call, and decode
# shapes change every step), so CUDA runs use flash / memory-efficient attention instead
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class DecodePlan:
    """Inputs of the paged decode kernel for D sequences decoding one token each (device tensors only)."""

    page_table: Tensor  # [D, >= max pages] page ids of each sequence (entries past its length unused)
    seq_lens: Tensor  # [D] keys of each sequence, this step's token included


@dataclass
class PrefillSeq:
    """One sequence's prefill chunk: rows start:end of the batch, the last end - start of its seq_len tokens.

    With the prefix kernel (`hicache.engine.kernels.prefill`) a chunk over a cached prefix carries its page table
    and is attended in place; otherwise `slots` (its keys' flat slots, gathered for SDPA) and, over a cached
    prefix, the causal `mask` of the CPU path."""

    start: int
    end: int
    seq_len: int
    slots: Tensor | None = None
    mask: Tensor | None = None
    page_table: Tensor | None = None


@dataclass
class AttentionPlan:
    """Per-step indexing shared by all layers.

    Sequences with one new token (decode) are attended together: by the paged kernel when `kernel` is set,
    else in one padded SDPA call over gathered keys. Sequences with several new tokens (prefill chunks)
    are attended one by one.
    """

    decode_rows: Tensor  # [D] row of each decode sequence's token in the [T] new-token batch
    decode_slots: Tensor  # [D, max_len] flat KV slots of each decode sequence, padded (reference path)
    decode_mask: Tensor  # [D, 1, 1, max_len] True where the key is a real, visible token (reference path)
    prefill: list[PrefillSeq]
    kernel: DecodePlan | None = None  # the decode sequences' kernel inputs, when the kernel is used
    # the decode rows are 0..D-1 (the engine plans decodes first): the kernel reads q[:D] and writes out[:D] in
    # place of a gather and a scatter per layer
    decode_first: bool = False
    # some attention runs through SDPA (a chunk without a prefix, or the reference decode path): each layer then
    # enters the SDPA backend context, which costs ~30 us of host time a layer and is skipped otherwise
    sdpa: bool = True


def slots_of(page_table: Tensor, seq_len: int, page_size: int) -> Tensor:
    """Flat KV slots of positions [0, seq_len) of a sequence with this page table."""
    offsets = torch.arange(page_size, device=page_table.device)
    return (page_table[:, None] * page_size + offsets).reshape(-1)[:seq_len]


def plan_attention(
    positions: Tensor,
    seq_lens: list[int],
    new_lens: list[int],
    page_tables: list[Tensor],
    page_size: int,
    decode_kernel: bool = False,
    decode_rows: Tensor | None = None,
    decode_lens: Tensor | None = None,
    prefill_kernel: bool = False,
) -> AttentionPlan:
    """Build the gather indices and masks for one forward step (decode page tables with `decode_kernel`,
    page tables of chunks over a cached prefix with `prefill_kernel`).

    decode_rows / decode_lens: the decode sequences' token rows and seq_lens already on the device (see
    `ForwardBatch`); made here from the lists when None.
    """
    device = positions.device
    rows_list: list[int] = []
    decode_slots: list[Tensor] = []
    decode_tables: list[Tensor] = []
    prefill: list[PrefillSeq] = []
    start = 0
    for seq_len, new_len, page_table in zip(seq_lens, new_lens, page_tables):
        if new_len > seq_len or page_table.numel() * page_size < seq_len:
            raise ValueError(
                f"sequence with seq_len={seq_len}, new_len={new_len} has "
                f"{page_table.numel()} pages of {page_size}"
            )
        end = start + new_len
        if new_len == 1 and decode_kernel:
            rows_list.append(start)
            decode_tables.append(page_table.to(device))
            start = end
            continue
        if 1 < new_len < seq_len and prefill_kernel:
            prefill.append(PrefillSeq(start, end, seq_len, page_table=page_table.to(device)))
            start = end
            continue
        slots = slots_of(page_table.to(device), seq_len, page_size)
        if new_len == 1:
            rows_list.append(start)
            decode_slots.append(slots)
        elif seq_len == new_len:
            prefill.append(PrefillSeq(start, end, seq_len, slots))  # no cached prefix: plain causal attention
        else:
            # new query at absolute position q sees keys [0, q]
            key_positions = torch.arange(seq_len, device=device)
            mask = key_positions[None, :] <= positions[start:end, None]
            prefill.append(PrefillSeq(start, end, seq_len, slots, mask))
        start = end
    if start != positions.numel():
        raise ValueError(f"new_lens sum to {start} but the batch has {positions.numel()} tokens")
    if decode_rows is None or decode_lens is None:
        decode_rows = torch.tensor(rows_list, dtype=torch.int64, device=device)
        decode_lens = torch.tensor([n for n, new in zip(seq_lens, new_lens) if new == 1], dtype=torch.int64,
                                   device=device)
    elif decode_rows.numel() != len(rows_list) or decode_lens.numel() != len(rows_list):
        raise ValueError(f"{decode_rows.numel()} decode rows and {decode_lens.numel()} lengths given for "
                         f"{len(rows_list)} decode sequences")
    if decode_tables:
        kernel = DecodePlan(page_table=pad_sequence(decode_tables, batch_first=True), seq_lens=decode_lens)
        empty = torch.empty(0, 0, dtype=torch.int64, device=device)
        return AttentionPlan(decode_rows, empty, empty.bool()[:, None, None, :], prefill, kernel,
                             decode_first=rows_list == list(range(len(rows_list))),
                             sdpa=any(seq.page_table is None for seq in prefill))

    lengths = [s.numel() for s in decode_slots]
    # a multiple of 16: CUDA memory-efficient SDPA needs 16-aligned mask rows (else it falls back to math)
    max_len = -(-max(lengths, default=0) // 16) * 16
    # padding repeats the sequence's first slot: masked out, but never uninitialised (NaN) pool memory
    slot_matrix = torch.empty(len(decode_slots), max_len, dtype=torch.int64, device=device)
    for i, slots in enumerate(decode_slots):
        slot_matrix[i, : slots.numel()] = slots
        slot_matrix[i, slots.numel() :] = slots[0]
    mask = torch.arange(max_len, device=device)[None, :] < decode_lens[:, None]  # = lengths
    return AttentionPlan(
        decode_rows=decode_rows,
        decode_slots=slot_matrix,
        decode_mask=mask[:, None, None, :],
        prefill=prefill,
        sdpa=bool(decode_slots) or any(seq.page_table is None for seq in prefill),
    )


def native_gqa(q: Tensor) -> bool:
    """Whether prefill SDPA gets the KV heads unrepeated (`enable_gqa`): CUDA half precision, where the flash
    kernel serves grouped queries itself. Float32 on CUDA has no flash kernel, so there (as on CPU) the heads are
    repeated rather than relying on which other kernel takes grouped heads."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def paged_attention(
    q: Tensor, k: Tensor, v: Tensor, kv_layer: Tensor, out_slots: Tensor, plan: AttentionPlan | DecodePlan
) -> Tensor:
    """Write this step's K/V into the pool, then attend each query to its sequence's cached + new keys.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (may be strided views of one qkv tensor);
    kv_layer: [2, num_pages, page_size, num_kv_heads, head_dim], a view into the pool (written in place).
    With a DecodePlan, row i is sequence i's one new token. Returns [T, num_heads, head_dim], not
    necessarily contiguous.
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_pool = kv_layer[0].view(-1, num_kv_heads, head_dim)
    v_pool = kv_layer[1].view(-1, num_kv_heads, head_dim)
    k_pool[out_slots] = k
    v_pool[out_slots] = v
    if isinstance(plan, DecodePlan):
        return paged_decode_attention(q, kv_layer[0], kv_layer[1], plan.page_table, plan.seq_lens)
    with sdpa_kernel(CUDA_SDPA_BACKENDS) if q.is_cuda and plan.sdpa else nullcontext():
        if not plan.decode_rows.numel() and len(plan.prefill) == 1:
            # the whole batch is one sequence's prefill: SDPA's output is the result, no copy into `out`
            return _attend_prefill(q, k, v, kv_layer, k_pool, v_pool, plan.prefill[0])
        out = torch.empty_like(q)
        _attend(q, k, v, kv_layer, k_pool, v_pool, plan, out)
    return out


def _attend(
    q: Tensor, k: Tensor, v: Tensor, kv_layer: Tensor, k_pool: Tensor, v_pool: Tensor, plan: AttentionPlan,
    out: Tensor,
) -> None:
    """kv_layer: the layer's pool [2, pages, page_size, ...] (for the kernel); k_pool, v_pool: its flat slot views."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    if plan.kernel is not None:
        rows, kernel = plan.decode_rows, plan.kernel
        if plan.decode_first:  # rows 0..D-1: read and write them in place
            d = rows.numel()
            paged_decode_attention(q[:d], kv_layer[0], kv_layer[1], kernel.page_table, kernel.seq_lens, out=out[:d])
        else:
            out[rows] = paged_decode_attention(q[rows], kv_layer[0], kv_layer[1], kernel.page_table, kernel.seq_lens)
    elif plan.decode_rows.numel():
        # one query per sequence: the query heads of a KV group act as `group` queries on its keys
        num_decode = plan.decode_rows.numel()
        q_dec = q[plan.decode_rows].view(num_decode, num_kv_heads, group, head_dim)
        k_dec = k_pool[plan.decode_slots].transpose(1, 2)  # [D, kv_heads, max_len, head_dim]
        v_dec = v_pool[plan.decode_slots].transpose(1, 2)
        o_dec = F.scaled_dot_product_attention(q_dec, k_dec, v_dec, attn_mask=plan.decode_mask)
        out[plan.decode_rows] = o_dec.reshape(num_decode, num_heads, head_dim)

    for seq in plan.prefill:
        rows = out[seq.start : seq.end]
        result = _attend_prefill(q, k, v, kv_layer, k_pool, v_pool, seq, out=rows)
        if result is not rows:  # SDPA's output: copy it in
            rows.copy_(result)


def _gathered(seq: PrefillSeq, page_size: int) -> PrefillSeq:
    """A kernel-planned chunk (page table only) as the SDPA path needs it: its keys' slots and causal mask."""
    device = seq.page_table.device
    positions = torch.arange(seq.seq_len - (seq.end - seq.start), seq.seq_len, device=device)
    mask = torch.arange(seq.seq_len, device=device)[None, :] <= positions[:, None]
    return PrefillSeq(seq.start, seq.end, seq.seq_len, slots_of(seq.page_table, seq.seq_len, page_size), mask)


def _attend_prefill(
    q: Tensor, k: Tensor, v: Tensor, kv_layer: Tensor, k_pool: Tensor, v_pool: Tensor, seq: PrefillSeq,
    out: Tensor | None = None,
) -> Tensor:
    """Attention output [end - start, num_heads, head_dim] of one sequence's new tokens (rows start:end); the
    Triton kernel writes it into `out` when given (the caller copies SDPA's result, returned as a new tensor)."""
    if seq.page_table is not None:  # over a cached prefix, keys read in place by the Triton kernel
        try:
            return paged_prefix_attention(q[seq.start : seq.end], kv_layer[0], kv_layer[1], seq.page_table,
                                          seq.seq_len, out=out)
        except PrefixKernelUnavailable:  # not on this GPU (logged once): gather the keys for SDPA instead
            with sdpa_kernel(CUDA_SDPA_BACKENDS) if q.is_cuda else nullcontext():  # the plan expected no SDPA
                return _attend_prefill(q, k, v, kv_layer, k_pool, v_pool, _gathered(seq, kv_layer.shape[2]))
    start, end, slots, mask = seq.start, seq.end, seq.slots, seq.mask
    group = q.shape[1] // k.shape[1]
    # SDPA's fused (flash / memory-efficient) kernels need 4-D [batch, heads, len, head_dim] inputs
    q_seq = q[start:end].transpose(0, 1).unsqueeze(0)
    if mask is None:  # nothing cached: the keys are exactly this step's
        k_seq, v_seq = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
    else:
        k_seq = k_pool[slots].transpose(0, 1)  # [kv_heads, seq_len, head_dim]
        v_seq = v_pool[slots].transpose(0, 1)
    # flash attention reads each KV head once for its whole query group; elsewhere the KV heads are repeated
    # (on the H200, repeating an 8k-token context for Llama-3.1-8B cost ~10% of a multi-turn round's GPU time)
    gqa = group > 1 and native_gqa(q)
    if group > 1 and not gqa:
        k_seq = k_seq.repeat_interleave(group, dim=0)
        v_seq = v_seq.repeat_interleave(group, dim=0)
    k_seq, v_seq = k_seq.unsqueeze(0), v_seq.unsqueeze(0)
    if mask is None:
        o_seq = F.scaled_dot_product_attention(q_seq, k_seq, v_seq, is_causal=True, enable_gqa=gqa)
    elif q.is_cuda:  # queries are the last new_len positions: causal aligned to the bottom right
        bias = causal_lower_right(end - start, seq.seq_len)
        o_seq = F.scaled_dot_product_attention(q_seq, k_seq, v_seq, attn_mask=bias, enable_gqa=gqa)
    else:
        o_seq = F.scaled_dot_product_attention(q_seq, k_seq, v_seq, attn_mask=mask)
    return o_seq[0].transpose(0, 1)  # flash / efficient SDPA: a contiguous [len, heads, head_dim] already
