"""The Triton prefix-attention kernel against plain causal attention (CPU, through Triton's interpreter)."""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import run_interpreted


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("triton", reason="the prefix kernel is written in Triton")
    return run_interpreted("prefill_kernel_check.py", tmp_path_factory.mktemp("kernel") / "results.pt")


def causal_attention(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, seq_len: int, page_size: int):
    """The last q.shape[0] positions of a seq_len-token sequence attending to keys up to their own, directly."""
    new, heads, head_dim = q.shape
    kv_heads = kv.shape[3]
    slots = (table[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:seq_len]
    k = kv[0].reshape(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, dim=1)
    v = kv[1].reshape(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
    positions = torch.arange(seq_len - new, seq_len)
    hidden = torch.arange(seq_len)[None, :] > positions[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


def test_kernel_matches_causal_attention_over_the_page_table(interpreted: dict) -> None:
    case = interpreted["kernel"]
    assert len(case["cases"]) == 8
    for c in case["cases"]:
        expected = causal_attention(c["q"], case["kv"], case["table"], c["seq_len"], case["page_size"])
        assert len(c["got"]) == 4  # every launch shape of prefill_kernel_check.CONFIGS
        for name, got in c["got"].items():
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=f"seq_len {c['seq_len']}, {name}")


def test_model_prefill_through_kernel_matches_sdpa(interpreted: dict) -> None:
    case = interpreted["model"]
    assert case["supported"] is True
    torch.testing.assert_close(case["kernel"], case["sdpa"], atol=1e-4, rtol=1e-4)
    # the chunk's K/V went to the same slots (layer 2's depend on layer 1's attention: equal up to rounding)
    torch.testing.assert_close(case["kernel_kv"], case["sdpa_kv"], atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(case["kernel_kv"]) == torch.count_nonzero(case["sdpa_kv"])


def test_refuses_a_page_table_too_short_for_the_sequence() -> None:
    pytest.importorskip("triton")
    from hicache.engine.prefill_kernel import paged_prefix_attention

    pool = torch.zeros(4, 16, 2, 16)
    with pytest.raises(ValueError, match="8 new tokens of a 40-token sequence with 2 pages of 16"):
        paged_prefix_attention(torch.zeros(8, 4, 16), pool, pool, torch.tensor([0, 1]), 40)
