"""Two elementwise steps of a Llama layer as one Triton kernel each, on CUDA.

- `silu_and_mul`: SwiGLU's silu(gate) * up from the fused gate_up projection's output. PyTorch needs two kernels
  (silu in place, then a multiply into it): five passes over a [tokens, intermediate] tensor; this reads gate and
  up once and writes the product once, into a contiguous tensor.
- `rope_`: rotary embedding of the q and k heads in place. PyTorch needs three kernels (the half-swapped copy, a
  multiply, a multiply-add); this reads each head once and writes it once.

Both compute in float32 and round once, where PyTorch rounds after each of its kernels. Elsewhere (CPU, no Triton,
or `enabled` False) they run the PyTorch ops. Inputs are device tensors and nothing syncs with the host, so CUDA
graphs capture them. On the CPU the kernels run only when asked (`kernel=True`), under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

from hicache.engine.kernels.decode import _INTERPRET, triton

# process-wide switch (config: model.fused_elementwise); benchmarks flip it to time both paths in one process
enabled = True

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, n_heads, stride_xt, stride_xh, stride_ct, stride_st,
                     HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        dims = tl.arange(0, HALF)
        ok = (heads < n_heads)[:, None]
        first = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :]
        x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
        cos1 = tl.load(cos_ptr + token * stride_ct + dims).to(tl.float32)[None, :]
        cos2 = tl.load(cos_ptr + token * stride_ct + HALF + dims).to(tl.float32)[None, :]
        sin1 = tl.load(sin_ptr + token * stride_st + dims).to(tl.float32)[None, :]  # the negated half
        sin2 = tl.load(sin_ptr + token * stride_st + HALF + dims).to(tl.float32)[None, :]
        tl.store(first, (x1 * cos1 + x2 * sin1).to(x_ptr.dtype.element_ty), mask=ok)
        tl.store(first + HALF, (x2 * cos2 + x1 * sin2).to(x_ptr.dtype.element_ty), mask=ok)


def _kernel_runs(x: Tensor, kernel: bool | None) -> bool:
    """kernel None: on CUDA while `enabled`; True: wherever Triton runs (the CPU under TRITON_INTERPRET=1)."""
    if triton is None:
        return False
    return (x.is_cuda or _INTERPRET) if kernel else (kernel is None and enabled and x.is_cuda)


def silu_and_mul(gate_up: Tensor, kernel: bool | None = None) -> Tensor:
    """silu(gate) * up of gate_up = [..., 2 * I] (gate first, then up). With the kernel, a new contiguous [..., I]
    tensor; otherwise the product is written into the gate half, a strided view, as PyTorch's ops do."""
    half = gate_up.shape[-1] // 2
    if not _kernel_runs(gate_up, kernel) or gate_up.stride(-1) != 1:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate, inplace=True).mul_(up)
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    out = torch.empty(rows.shape[0], half, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if rows.shape[0]:
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(half, block))](rows, out, half, rows.stride(0), out.stride(0),
                                                                   BLOCK=block)
    return out.view(*gate_up.shape[:-1], half)


def rope_(x: Tensor, cos: Tensor, sin: Tensor, kernel: bool | None = None) -> Tensor:
    """Rotate x [T, heads, head_dim] in place by position (half-split layout, as HF); returns x.

    cos: [T, 1, head_dim] as HF's; sin: [T, 1, head_dim] with its first half negated
    (`hicache.engine.model.rope_cos_sin`). x may be a strided view (the q and k heads of a fused qkv projection)
    whose head_dim is contiguous.
    """
    tokens, heads, head_dim = x.shape
    half = head_dim // 2
    fits = head_dim % 2 == 0 and half >= 16 and half & (half - 1) == 0  # tl.arange: a power of two
    if not (_kernel_runs(x, kernel) and fits and x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1):
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return x.mul_(cos).addcmul_(swapped, sin)
    block_h = 8
    if tokens:
        _rope_kernel[(tokens, triton.cdiv(heads, block_h))](x, cos, sin, heads, x.stride(0), x.stride(1),
                                                          cos.stride(0), sin.stride(0), HALF=half, BLOCK_H=block_h)
    return x
