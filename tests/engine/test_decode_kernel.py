"""The Triton paged decode kernel against plain attention (CPU, through Triton's interpreter), and the
decode CUDA graphs against eager decode (CUDA only)."""

from __future__ import annotations

import math

import pytest
import torch


def reference_attention(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, page_size: int):
    """Softmax attention of each row's query over its sequence's keys, computed directly; zeros if empty."""
    batch, heads, head_dim = q.shape
    kv_heads = kv.shape[3]
    out = torch.zeros_like(q)
    for b in range(batch):
        n = int(lens[b])
        if n == 0:
            continue
        slots = (table[b, :, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
        k = kv[0].reshape(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, dim=1)
        v = kv[1].reshape(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b], k) / math.sqrt(head_dim)
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("splits", [1, 3, 16])
def test_kernel_matches_attention_over_the_page_table(interpreted_decode: dict, splits: int) -> None:
    case = interpreted_decode["kernel"]
    assert case["supported"] is True
    expected = reference_attention(case["q"], case["kv"], case["table"], case["lens"], case["page_size"])
    got = case[f"splits_{splits}"]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(got[-1]) == 0  # the empty sequence


def test_model_decode_through_kernel_matches_reference(interpreted_decode: dict) -> None:
    case = interpreted_decode["model"]
    torch.testing.assert_close(case["eager_kernel"], case["reference"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(case["decode_forward"], case["reference"], atol=1e-4, rtol=1e-4)
    # the same K/V in the same slots (layer 2's K/V depend on layer 1's attention: equal up to rounding)
    torch.testing.assert_close(case["kernel_kv"], case["reference_kv"], atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(case["kernel_kv"]) == torch.count_nonzero(case["reference_kv"])


@pytest.mark.cuda
def test_cuda_graph_decode_matches_eager_decode() -> None:
    pytest.importorskip("triton")
    from hicache.engine import load_model
    from hicache.engine.cuda_graph import DecodeGraphs
    from hicache.engine.model import ForwardBatch

    torch.manual_seed(0)
    model, _ = load_model("random:tiny", torch.float32, torch.device("cuda"))
    page_size, pages = 16, 64
    kv = torch.zeros(model.kv_pool_shape(pages, page_size), device="cuda")
    graphs = DecodeGraphs(model, kv, page_size, max_batch=4, max_pages=16).capture()
    kv.zero_()  # capture's warm-up wrote slot 0
    lengths = [3, 17, 40, 1]
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(4)]
    for n, table in zip(lengths, tables):  # prefill eagerly
        pos = torch.arange(n, device="cuda")
        t = torch.tensor(table, device="cuda")
        batch = ForwardBatch(torch.randint(0, 512, (n,), device="cuda"), pos, t[pos // page_size] * page_size
                             + pos % page_size, [n], [n], [t[: -(-n // page_size)]])
        model(batch, kv, page_size)
    eager_kv = kv.clone()
    for _ in range(20):  # crosses page boundaries (16, 32, 48)
        for size in (4, 2):
            rows = range(size)
            ids = [int(x) for x in torch.randint(0, 512, (size,))]
            pos = [lengths[i] for i in rows]
            got = graphs.run(ids, pos, [tables[i] for i in rows]).clone()
            tab = [torch.tensor(tables[i][: p // page_size + 1], device="cuda") for i, p in zip(rows, pos)]
            slots = torch.tensor([tables[i][p // page_size] * page_size + p % page_size for i, p in zip(rows, pos)],
                                 device="cuda")
            expected = model(ForwardBatch(torch.tensor(ids, device="cuda"), torch.tensor(pos, device="cuda"), slots,
                                          [p + 1 for p in pos], [1] * size, tab), eager_kv, page_size)
            torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
            torch.testing.assert_close(kv, eager_kv, atol=1e-5, rtol=1e-5)
        for i in range(4):
            lengths[i] += 1 if i < 2 else 0
    assert graphs.replays == 40
