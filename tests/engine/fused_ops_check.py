"""The fused elementwise kernels' inputs and outputs for test_fused_ops.py to compare, under TRITON_INTERPRET=1
(Triton's CPU interpreter must be chosen before Triton is imported): run by interpreted_checks.py (its "fused"
section), or alone.

Usage: python fused_ops_check.py OUT.pt
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from hicache.engine.kernels import fused as fused_ops  # noqa: E402


def cases() -> dict:
    """The kernels' outputs next to their inputs."""
    gen = torch.Generator().manual_seed(0)
    results: dict = {"silu": [], "rope": []}
    # rows x intermediate: 1,500 columns leave a partial second block of 1,024; 0 rows launch nothing
    for rows, inter in ((5, 1500), (3, 64), (0, 64)):
        gate_up = torch.randn(rows, 2 * inter, generator=gen) * 3
        got = fused_ops.silu_and_mul(gate_up.clone(), kernel=True)
        results["silu"].append({"gate_up": gate_up, "got": got, "contiguous": got.is_contiguous()})
    # tokens x (q + k heads of a fused qkv row) x head_dim: 5 heads leave 3 of a block of 8 masked; the view is strided
    for tokens, heads, extra, head_dim in ((7, 5, 2, 32), (2, 12, 4, 64)):
        qkv = torch.randn(tokens, heads + extra, head_dim, generator=gen)
        angles = torch.randn(tokens, 1, head_dim // 2, generator=gen)
        cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
        sin = torch.cat((-angles.sin(), angles.sin()), dim=-1)
        x = qkv.clone()
        out = fused_ops.rope_(x[:, :heads], cos, sin, kernel=True)
        results["rope"].append({"qkv": qkv, "cos": cos, "sin": sin, "heads": heads, "got": x,
                                "same_tensor": out.data_ptr() == x.data_ptr()})
    return results


if __name__ == "__main__":
    torch.save(cases(), sys.argv[1])
