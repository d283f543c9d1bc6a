"""Prefill attention over a cached prefix in Triton: the new tokens' queries read K/V straight from the pool.

With a cached prefix, the SDPA path (`hicache.engine.attention`) first gathers the sequence's whole context out of
the paged pool into a contiguous copy, then runs flash attention with a bottom-right causal mask. This kernel walks
the page table instead: one program per (block of new tokens, query head or whole GQA group), a block of keys
gathered through the page table per step of an online softmax, the causal mask applied only on the steps that reach
the block's own positions. Few new tokens over a long prefix make few such programs; their keys are then split among
several programs, and decoding's merge adds the shares by their log-sum-exp (`prefix_splits_for`).

On by default (`model.prefill_attention: triton`): on the H200, over thousands of cached tokens, both its TMA
launch shape (Hopper, 64-token pages) and the plain one take well under the gather + SDPA path's time
(bench/RESULTS.md, 'Prefix attention kernel'). Inputs are device tensors; nothing here syncs with the
host. Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from hicache.engine.kernels import decode
from hicache.engine.kernels.decode import triton

logger = logging.getLogger(__name__)


class PrefixKernelUnavailable(RuntimeError):
    """The kernel cannot run on this GPU: it did not compile, or its tiles do not fit (shared memory, registers)."""


_unavailable: dict[object, str] = {}  # launch shape -> why its launch failed; later calls do not try again
_LAUNCH_ERRORS: tuple[type[BaseException], ...] = ()

if triton is not None:
    import triton.language as tl
    from triton.compiler import errors as _compiler_errors
    from triton.runtime import errors as _runtime_errors

    _LAUNCH_ERRORS = tuple(
        cls for cls in (getattr(_runtime_errors, "OutOfResources", None), getattr(_runtime_errors, "PTXASError", None),
                        getattr(_compiler_errors, "CompilationError", None)) if cls is not None
    )

    # the lengths change with every call: not specialised on, so serving compiles the kernel once
    # the lengths and the number of key splits change with every call: not specialised on, so serving compiles the
    # kernel once per launch shape, split or not
    @triton.jit(do_not_specialize=["n_new", "seq_len", "num_splits", "stride_qt", "stride_ot", "stride_mt",
                                   "stride_lt"])
    def _prefix_attention_kernel(
        q_ptr, k_ptr, v_ptr, k_desc, v_desc, table_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
        n_new, seq_len, num_splits,
        stride_qt, stride_qh,
        stride_kp, stride_ks, stride_kh,
        stride_ot, stride_oh,
        stride_mt, stride_mh, stride_ms,
        stride_lt, stride_lh,
        qk_scale,
        GROUP: tl.constexpr, HEADS_PER_BLOCK: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        # a block's BLOCK_M rows are TOKENS new tokens x HEADS_PER_BLOCK query heads (1, or a whole GQA group,
        # which then reads each K/V tile once for all of its heads). SPLIT: the block's keys are shared out among
        # num_splits programs: program `split` takes its share of the whole steps, the last one also the steps that
        # reach the block's own positions, and each writes its softmax's partial output and log-sum-exp
        TOKENS: tl.constexpr = BLOCK_M // HEADS_PER_BLOCK
        block = tl.program_id(0)
        first_head = tl.program_id(1) * HEADS_PER_BLOCK
        split = tl.program_id(2)
        kv_head = first_head // GROUP
        r = tl.arange(0, BLOCK_M)
        tokens = block * TOKENS + r // HEADS_PER_BLOCK
        heads = first_head + r % HEADS_PER_BLOCK
        row_ok = (tokens < n_new) & (r < TOKENS * HEADS_PER_BLOCK)  # a group of 3 leaves spare rows
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        positions = seq_len - n_new + tokens  # absolute position of each query (padding rows: >= seq_len)
        first = seq_len - n_new + block * TOKENS
        visible_end = tl.minimum(first + TOKENS, seq_len)  # no row sees a key at or past this
        unmasked_end = (first + 1) // BLOCK_N * BLOCK_N  # whole steps of keys every row of the block sees
        offs_n = tl.arange(0, BLOCK_N)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        if not SPLIT:
            lo = 0
            hi = unmasked_end
        else:
            per_split = tl.cdiv(unmasked_end // BLOCK_N, num_splits) * BLOCK_N
            lo = split * per_split
            hi = tl.minimum(lo + per_split, unmasked_end)
        for start in range(lo, hi, BLOCK_N):
            keys = start + offs_n
            if USE_TMA:  # one page a step (BLOCK_N == PAGE): a [PAGE, HEAD_DIM] box of the pool's 2-D view
                row = tl.load(table_ptr + start // PAGE).to(tl.int32) * PAGE
                k = k_desc.load([row, kv_head * HEAD_DIM])
            else:
                pages = tl.load(table_ptr + keys // PAGE)
                kv_rows = pages * stride_kp + (keys % PAGE) * stride_ks + kv_head * stride_kh
                kv_offsets = kv_rows[:, None] + dims[None, :]
                k = tl.load(k_ptr + kv_offsets)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.math.exp2(scores - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if USE_TMA:
                v = v_desc.load([row, kv_head * HEAD_DIM])
            else:
                v = tl.load(v_ptr + kv_offsets)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        # the keys that reach the block's own positions: key j is visible to the query at position i iff j <= i.
        # Every row sees key 0, so without splits a row's running max is finite after its first step here or above;
        # a split may have seen no key of a row yet (a max of -inf), whose terms then count as 0 (`m_use`)
        diag_start = unmasked_end if not SPLIT else tl.where(split == num_splits - 1, unmasked_end, visible_end)
        for start in range(diag_start, visible_end, BLOCK_N):
            keys = start + offs_n
            in_seq = keys < seq_len
            if USE_TMA:  # the page's slots past seq_len hold anything (NaN too): zeroed before p @ v
                row = tl.load(table_ptr + start // PAGE).to(tl.int32) * PAGE
                k = k_desc.load([row, kv_head * HEAD_DIM])
                v = tl.where(in_seq[:, None], v_desc.load([row, kv_head * HEAD_DIM]), 0.0)
            else:
                pages = tl.load(table_ptr + keys // PAGE, mask=in_seq, other=0)
                kv_rows = pages * stride_kp + (keys % PAGE) * stride_ks + kv_head * stride_kh
                kv_offsets = kv_rows[:, None] + dims[None, :]
                k = tl.load(k_ptr + kv_offsets, mask=in_seq[:, None], other=0.0)
                v = tl.load(v_ptr + kv_offsets, mask=in_seq[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            scores = tl.where((keys[None, :] <= positions[:, None]) & in_seq[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_use = m_new if not SPLIT else tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(scores - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if not SPLIT:
            out = acc / l_i[:, None]
            tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:  # this split's share, normalised, and its log-sum-exp (base 2; -inf where it saw no key of the row)
            seen = l_i > 0
            safe = tl.where(seen, l_i, 1.0)
            tl.store(mid_o_ptr + tokens[:, None] * stride_mt + heads[:, None] * stride_mh + split * stride_ms
                     + dims[None, :], acc / safe[:, None], mask=row_ok[:, None])
            tl.store(mid_lse_ptr + tokens * stride_lt + heads * stride_lh + split,
                     tl.where(seen, m_i + tl.log2(safe), float("-inf")), mask=row_ok)


@dataclass(frozen=True)
class PrefixKernelConfig:
    """Launch shape: rows (new tokens x packed heads) and keys per program step, warps, pipeline stages.

    pack_gqa puts a GQA group's query heads in one program's rows, so each K/V tile is read once per group
    instead of once per query head. tma loads each step's keys and values as one box of the pool's 2-D view
    (`triton.tools.tensor_descriptor`; the Hopper copy engine on the GPU), one page a step (block_n must be the
    page size).
    """

    block_m: int = 64
    block_n: int = 64
    pack_gqa: bool = False
    num_warps: int = 4
    num_stages: int = 2
    tma: bool = False


# the fastest shapes of the H200 sweep (`bench/gpu/prefix_attention_bench.py --sweep`; bench/RESULTS.md, 'Prefix
# attention kernel'): without TMA for any GPU Triton supports (GQA packing made no difference), with TMA for Hopper
# and later with 64-token pages (one page a step).
CUDA_CONFIG = PrefixKernelConfig(block_m=64, block_n=64, pack_gqa=False, num_warps=4, num_stages=2)
TMA_CONFIG = PrefixKernelConfig(block_m=128, block_n=64, pack_gqa=False, num_warps=4, num_stages=2, tma=True)
INTERPRETER_CONFIG = PrefixKernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


@functools.cache
def _tma_supported(device: torch.device) -> bool:
    """Hopper or later, and a Triton with host-side TMA descriptors (asked once per device: every layer of every
    prefill chunk picks its launch shape)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def default_configs(device: torch.device, k_pool: Tensor | None = None, v_pool: Tensor | None = None,
                    ) -> list[PrefixKernelConfig]:
    """The launch shapes to try for pools like these, fastest first, without those that failed on this process:
    the TMA shape where it applies (Hopper+, one page of TMA_CONFIG.block_n keys a step, contiguous pools), then
    the plain one that every Triton GPU runs; the interpreter's on CPU."""
    if device.type != "cuda":
        candidates = [INTERPRETER_CONFIG]
    else:
        candidates = [CUDA_CONFIG]
        pools_fit = k_pool is None or (k_pool.shape[1] == TMA_CONFIG.block_n and k_pool.is_contiguous()
                                       and v_pool is not None and v_pool.is_contiguous())
        if pools_fit and _tma_supported(device):
            candidates.insert(0, TMA_CONFIG)
    return [c for c in candidates if c not in _unavailable]


def prefix_kernel_available(device: torch.device) -> bool:
    """False once every default launch shape failed on this device (`PrefixKernelUnavailable`): callers then use
    SDPA."""
    return bool(default_configs(device))


# Key splits: a program's keys are shared out while fewer than SPLIT_TARGET_PER_SM programs per SM would run, each
# split keeping at least SPLIT_MIN_STEPS steps of keys, and at most SPLIT_MAX_ROWS new tokens x splits of partial
# outputs (float32, 64 MiB at 32 heads of 128).
SPLIT_TARGET_PER_SM = 4
SPLIT_MIN_STEPS = 16
SPLIT_MAX = 32
SPLIT_MAX_ROWS = 4096


def prefix_splits_for(n_new: int, seq_len: int, programs: int, block_n: int, device: torch.device) -> int:
    """Key splits per program of a call: a few new tokens over a long prefix make few programs (a block of tokens
    per query head), each walking every key, and leave most SMs idle; split, each program walks a share of the keys
    and a merge adds the shares by their log-sum-exp, as decoding does. 1 where the programs already fill the GPU
    or the prefix is short (bench/RESULTS.md, 'Prefix attention kernel')."""
    target = SPLIT_TARGET_PER_SM * decode._multiprocessors(device)
    if programs >= target:
        return 1
    steps = (seq_len - n_new) // block_n
    return max(1, min(-(-target // programs), steps // SPLIT_MIN_STEPS, SPLIT_MAX, SPLIT_MAX_ROWS // n_new))


def paged_prefix_attention(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, page_table: Tensor, seq_len: int,
    config: PrefixKernelConfig | None = None, out: Tensor | None = None, num_splits: int | None = None,
) -> Tensor:
    """Causal attention of one sequence's new tokens (the last q.shape[0] of its seq_len) over all its keys.

    q: [n_new, num_heads, head_dim] (rows may be strided, head_dim contiguous); k_pool, v_pool: [num_pages,
    page_size, num_kv_heads, head_dim], one layer of the pool, the new tokens' K/V already written; page_table:
    [>= ceil(seq_len / page_size)] integer page ids. Returns [n_new, num_heads, head_dim] in q's dtype, written into
    `out` when given (a view of that shape and dtype whose head_dim is contiguous, e.g. rows of a larger output).
    Needs `hicache.engine.kernels.decode.kernel_supported` for the device, page size and head_dim. Without `config`
    the default launch shapes are tried in turn (`default_configs`): one that does not compile or fit on this GPU
    is logged once and skipped from then on. Raises PrefixKernelUnavailable when none (or the given `config`)
    can run. num_splits: key splits per program (default `prefix_splits_for` the call).
    """
    if config is not None:
        return _launch(q, k_pool, v_pool, page_table, seq_len, config, out, num_splits)
    configs = default_configs(q.device, k_pool, v_pool)
    if not configs:
        raise PrefixKernelUnavailable("; ".join(sorted(set(_unavailable.values()))) or "no launch shape applies")
    for config in configs[:-1]:
        try:
            return _launch(q, k_pool, v_pool, page_table, seq_len, config, out, num_splits)
        except PrefixKernelUnavailable:
            continue  # logged by _launch; the next shape
    return _launch(q, k_pool, v_pool, page_table, seq_len, configs[-1], out, num_splits)


def _launch(q: Tensor, k_pool: Tensor, v_pool: Tensor, page_table: Tensor, seq_len: int,
            config: PrefixKernelConfig, out: Tensor | None = None, num_splits: int | None = None) -> Tensor:
    if config in _unavailable:
        raise PrefixKernelUnavailable(_unavailable[config])
    n_new, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pool.shape
    if not 0 < n_new <= seq_len or page_table.numel() * page_size < seq_len:
        raise ValueError(f"{n_new} new tokens of a {seq_len}-token sequence with {page_table.numel()} pages "
                         f"of {page_size}")
    if q.stride(-1) != 1 or k_pool.stride(-1) != 1 or k_pool.stride() != v_pool.stride():
        raise ValueError("paged_prefix_attention needs head_dim-contiguous q, k and v, k and v alike")
    group = num_heads // num_kv_heads
    heads_per_block = group if config.pack_gqa else 1
    if config.block_m < heads_per_block:
        raise ValueError(f"block_m {config.block_m} cannot hold a GQA group of {group} query heads")
    k_desc, v_desc = k_pool, v_pool  # without TMA the kernel never reads these arguments: any tensor will do
    if config.tma:
        if config.block_n != page_size or not (k_pool.is_contiguous() and v_pool.is_contiguous()):
            raise ValueError(f"the TMA kernel takes one page ({page_size} keys) a step from contiguous pools, "
                             f"not {config.block_n} keys")
        k_desc, v_desc = (_page_descriptor(pool, config) for pool in (k_pool, v_pool))
    if out is None:
        out = torch.empty(n_new, num_heads, head_dim, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match q {tuple(q.shape)} {q.dtype}, head_dim "
                         "contiguous")
    grid = (triton.cdiv(n_new, config.block_m // heads_per_block), num_heads // heads_per_block)
    splits = num_splits or prefix_splits_for(n_new, seq_len, grid[0] * grid[1], config.block_n, q.device)
    if splits > 1:  # each split's normalised share and log-sum-exp, added up below (`decode.merge_splits`)
        mid_o = torch.empty(n_new, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(n_new, num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out  # never written
    try:
        _prefix_attention_kernel[(*grid, splits)](
            q, k_pool, v_pool, k_desc, v_desc, page_table, out, mid_o, mid_lse,
            n_new, seq_len, splits,
            q.stride(0), q.stride(1),
            k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
            out.stride(0), out.stride(1),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_lse.stride(0), mid_lse.stride(1),
            (1.0 / math.sqrt(head_dim)) * math.log2(math.e),
            GROUP=group, HEADS_PER_BLOCK=heads_per_block, PAGE=page_size, HEAD_DIM=head_dim,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, USE_TMA=config.tma,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLIT=splits > 1,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    except _LAUNCH_ERRORS as e:  # e.g. a GPU with less shared memory than the tiles need (float32 doubles them)
        why = _unavailable[config] = f"{type(e).__name__}: {e}"
        logger.warning("prefix attention kernel's launch shape %s unavailable on %s with %s (%s); chunks over a "
                       "cached prefix use the next default shape, or SDPA after the last", config, q.device, q.dtype,
                       why)
        raise PrefixKernelUnavailable(why) from e
    return decode.merge_splits(mid_o, mid_lse, out) if splits > 1 else out


def _page_descriptor(pool: Tensor, config: PrefixKernelConfig) -> object:
    """A TMA descriptor of one layer's K or V pool viewed as [pages x page_size, kv_heads x head_dim]: one page of one
    KV head is the box at (page * page_size, kv_head * head_dim)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_pages, page_size, num_kv_heads, head_dim = pool.shape
    flat = pool.view(num_pages * page_size, num_kv_heads * head_dim)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [config.block_n, head_dim])
