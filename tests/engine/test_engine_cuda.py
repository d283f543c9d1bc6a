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
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
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
