"""The fused elementwise kernels (hicache.engine.kernels.fused) against PyTorch's ops (CPU, through Triton's
interpreter), and their PyTorch fallback."""

from __future__ import annotations

import torch

from hicache.engine.kernels import fused as fused_ops


def test_silu_and_mul_kernel_matches_pytorch(interpreted_fused: dict) -> None:
    assert [c["gate_up"].shape[0] for c in interpreted_fused["silu"]] == [5, 3, 0]
    for case in interpreted_fused["silu"]:
        gate, up = case["gate_up"].chunk(2, dim=-1)
        expected = torch.nn.functional.silu(gate) * up
        assert case["contiguous"] and case["got"].shape == expected.shape
        torch.testing.assert_close(case["got"], expected, atol=1e-5, rtol=1e-5)


def test_rope_kernel_rotates_only_the_viewed_heads_in_place(interpreted_fused: dict) -> None:
    for case in interpreted_fused["rope"]:
        qkv, heads, cos, sin = case["qkv"], case["heads"], case["cos"], case["sin"]
        half = qkv.shape[-1] // 2
        x1, x2 = qkv[:, :heads, :half], qkv[:, :heads, half:]
        true_sin = sin[..., half:]  # the second half holds sin itself
        expected = torch.cat((x1 * cos[..., :half] - x2 * true_sin, x2 * cos[..., half:] + x1 * true_sin), dim=-1)
        assert case["same_tensor"]
        torch.testing.assert_close(case["got"][:, :heads], expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(case["got"][:, heads:], qkv[:, heads:])  # the v heads are untouched


def test_without_cuda_the_pytorch_ops_run_and_agree(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(1)
    gate_up = torch.randn(4, 2 * 96, generator=gen)
    gate, up = gate_up.clone().chunk(2, dim=-1)
    got = fused_ops.silu_and_mul(gate_up.clone())  # CPU: PyTorch's two ops, into the gate half
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up)
    monkeypatch.setattr(fused_ops, "enabled", False)
    assert not fused_ops._kernel_runs(torch.empty(1), None)
    if fused_ops.triton is not None:
        assert fused_ops._kernel_runs(torch.empty(1), True) == fused_ops._INTERPRET
