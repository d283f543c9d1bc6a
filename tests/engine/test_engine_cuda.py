"""The same model code on a CUDA device: HF parity in float32, and the big random presets in bfloat16."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from engine_helpers import hf_and_ours, hf_logits, make_batch, run_in_chunks

from hicache.engine import load_model

pytestmark = [
    pytest.mark.cuda,
]
PAGE_SIZE = 16


def test_cuda_matches_transformers_through_scattered_pages(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    torch.backends.cuda.matmul.allow_tf32 = False
    hf, ours = hf_and_ours(tmp_path, "llama3", device="cuda")
    tokens = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = hf_logits(hf, tokens)
    kv = torch.full(ours.kv_pool_shape(24, 4), float("nan"), device="cuda")
    pages = torch.arange(23, 11, -1, device="cuda")
    got = run_in_chunks(ours, kv, pages, tokens, [7, 1, 13, 16] + [1] * 8, page_size=4)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "qwen2.5-7b"])
def test_big_random_presets_run_in_bf16(preset: str) -> None:
    start = time.perf_counter()
    model, tokenizer = load_model(f"random:{preset}", torch.bfloat16, torch.device("cuda"))
    torch.cuda.synchronize()
    print(f"random:{preset} loaded in {time.perf_counter() - start:.1f} s")
    assert model.dtype == torch.bfloat16 and model.device.type == "cuda"
    kv = torch.zeros(model.kv_pool_shape(64, PAGE_SIZE), dtype=torch.bfloat16, device="cuda")
    tables = [torch.arange(i * 8, (i + 1) * 8, device="cuda") for i in range(4)]
    prompts = [tokenizer.encode("x" * n) for n in (100, 37, 64, 1)]
    prefill = model(make_batch(list(zip(prompts, [0] * 4, tables)), PAGE_SIZE, "cuda"), kv, PAGE_SIZE)
    assert prefill.shape == (4, model.config.vocab_size) and torch.isfinite(prefill).all()
    # batched decode agrees with decoding each sequence alone
    step = [([7], len(p), t) for p, t in zip(prompts, tables)]
    together = model(make_batch(step, PAGE_SIZE, "cuda"), kv, PAGE_SIZE)
    for i in range(4):
        alone = model(make_batch([step[i]], PAGE_SIZE, "cuda"), kv, PAGE_SIZE)
        torch.testing.assert_close(together[i], alone[0], atol=0.05, rtol=0.05)


@pytest.mark.parametrize("cached", [0, 200])
def test_bf16_prefill_attention_reads_grouped_kv_heads_in_place(cached: int) -> None:
    """bf16 prefill attention hands flash the 8 KV heads unrepeated (enable_gqa), with and without a cached prefix
    (bottom-right causal); it must agree with float32 attention over KV heads repeated to the 32 query heads."""
    from hicache.engine.attention import PrefillSeq, _attend_prefill, native_gqa

    gen = torch.Generator(device="cuda").manual_seed(3)
    heads, kv_heads, dim, page_size, new = 32, 8, 128, 16, 96
    total = cached + new
    pool = torch.randn(2, 64, page_size, kv_heads, dim, generator=gen, device="cuda")
    pages = torch.randperm(64, generator=gen, device="cuda")[: -(-total // page_size)]
    slots = (pages[:, None] * page_size + torch.arange(page_size, device="cuda")).reshape(-1)[:total]
    q = torch.randn(new, heads, dim, generator=gen, device="cuda")
    k, v = pool[0].view(-1, kv_heads, dim)[slots[cached:]], pool[1].view(-1, kv_heads, dim)[slots[cached:]]
    positions = torch.arange(cached, total, device="cuda")
    mask = None if cached == 0 else torch.arange(total, device="cuda")[None, :] <= positions[:, None]

    def attend(dtype: torch.dtype) -> torch.Tensor:
        flat = pool.to(dtype)
        return _attend_prefill(q.to(dtype), k.to(dtype), v.to(dtype), flat, flat[0].view(-1, kv_heads, dim),
                               flat[1].view(-1, kv_heads, dim), PrefillSeq(0, new, total, slots, mask))

    assert native_gqa(q.bfloat16()) and not native_gqa(q)
    # the float32 reference, by hand: each query head reads KV head h // 4, keys up to its own position
    keys = pool[0].view(-1, kv_heads, dim)[slots].repeat_interleave(4, dim=1)  # [total, heads, dim]
    values = pool[1].view(-1, kv_heads, dim)[slots].repeat_interleave(4, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) / dim**0.5
    visible = torch.arange(total, device="cuda")[None, :] <= positions[:, None]
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)
    torch.testing.assert_close(attend(torch.float32), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(attend(torch.bfloat16).float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("shape", ["plain", "packed", "tma", "tma-128", "defaults"])
@pytest.mark.parametrize(("cached", "new"), [(300, 200), (64, 1000), (7000, 1024), (20000, 64), (5000, 8)])
def test_bf16_prefix_kernel_matches_float32_attention(cached: int, new: int, shape: str) -> None:
    """The Triton prefix kernel in bf16, Llama-3.1-8B's head shapes and 64-token pages, against float32 attention
    by hand: block edges, a prefix that is not page-aligned, a multi-turn round's 1k tokens over 7k, and a few tokens
    over a long prefix (its keys split among programs, `prefix_splits_for`); with the
    plain launch shape, with a GQA group packed into 128 rows and two pages of keys a step, with pages loaded as TMA
    boxes (64 and 128 rows), and through the default shapes (TMA first on Hopper)."""
    pytest.importorskip("triton")
    from hicache.engine.kernels.prefill import CUDA_CONFIG, TMA_CONFIG, PrefixKernelConfig, paged_prefix_attention

    config = {"plain": CUDA_CONFIG, "packed": PrefixKernelConfig(128, 128, True, 8, 3),
              "tma": PrefixKernelConfig(64, 64, False, 4, 2, tma=True), "tma-128": TMA_CONFIG, "defaults": None}[shape]

    gen = torch.Generator(device="cuda").manual_seed(4)
    heads, kv_heads, dim, page_size = 32, 8, 128, 64
    total = cached + new
    num_pages = -(-total // page_size) + 5
    pool = torch.randn(2, num_pages, page_size, kv_heads, dim, generator=gen, device="cuda")
    table = torch.randperm(num_pages, generator=gen, device="cuda")[: -(-total // page_size)]
    slots = (table[:, None] * page_size + torch.arange(page_size, device="cuda")).reshape(-1)[:total]
    q = torch.randn(new, heads, dim, generator=gen, device="cuda")
    keys = pool[0].view(-1, kv_heads, dim)[slots].repeat_interleave(4, dim=1)
    values = pool[1].view(-1, kv_heads, dim)[slots].repeat_interleave(4, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) / dim**0.5
    positions = torch.arange(cached, total, device="cuda")
    visible = torch.arange(total, device="cuda")[None, :] <= positions[:, None]
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)
    half = pool.bfloat16()
    got = paged_prefix_attention(q.bfloat16(), half[0], half[1], table, total, config)
    assert got.dtype == torch.bfloat16 and got.shape == (new, heads, dim)
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)
