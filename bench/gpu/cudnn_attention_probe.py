"""Would cuDNN's attention beat the Triton prefix kernel? One layer of prefill over a cached prefix, timed.

The Triton kernel (hicache.engine.kernels.prefill) reads the paged pool in place and reached 377 TFLOPS at 8k context
on the H200 (bench/RESULTS.md, 'Prefix attention kernel'); FA3-class kernels reach ~600. PyTorch's SDPA has a cuDNN
backend whose Hopper kernels are of that class, but it wants contiguous K/V and has no bottom-right causal mask. This
probe times, per context length (1,024 new tokens, Llama-3.1-8B heads, bf16, 64-token pages scattered over
the pool):
- `triton`: the default prefix kernel, in place;
- `gather`: only copying the sequence's K and V out of the pool (what every cuDNN variant below pays first);
- `cudnn_mask`: gather + one cuDNN call with an explicit bottom-right boolean mask;
- `cudnn_split`: gather + cuDNN over the prefix without a mask + cuDNN causal over the new tokens' own square,
  the two merged by their log-sum-exps (the exact result, as flash attention's own split does);
- `cudnn_full`: gather + cuDNN with no mask at all (wrong result; the speed such a kernel could reach);
- `flash_mask`: gather + SDPA's flash/efficient backends with the mask (hicache's SDPA fallback).
Each variant's output is compared with the Triton kernel's; a variant that fails prints why.

Usage (H200): python3 bench/gpu/cudnn_attention_probe.py [--contexts 1024,4096,8192] [--repeats 20] [--json F]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from prefix_attention_bench import timed  # this directory's bench (run as a script, it is on sys.path)
from torch.nn.attention import SDPBackend, sdpa_kernel

from hicache.engine.kernels.prefill import paged_prefix_attention


def cudnn_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN attention of q [1, H, Lq, D] over k, v [1, Hkv, Lk, D] (KV heads repeated when cuDNN wants equal
    counts): output [1, H, Lq, D] and log-sum-exp [1, H, Lq] (natural log)."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
    return out[0], out[1].reshape(q.shape[0], q.shape[1], q.shape[2])


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Two partial softmax-attention outputs over disjoint key sets -> the output over their union."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    return ((o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]).to(o1.dtype)


def case(context: int, new: int, repeats: int) -> list[dict]:
    heads, kv_heads, dim, page_size = 32, 8, 128, 64
    total = context + new
    pages = -(-total // page_size)
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = torch.randn(2, pages * 2, page_size, kv_heads, dim, generator=gen, device="cuda").bfloat16()
    table = torch.randperm(pages * 2, generator=gen, device="cuda")[:pages]
    q = torch.randn(new, heads, dim, generator=gen, device="cuda").bfloat16()
    mask = torch.arange(total, device="cuda")[None, :] <= torch.arange(context, total, device="cuda")[:, None]
    pairs = new * context + new * (new + 1) / 2
    flops = 4 * heads * dim * pairs

    def triton():
        return paged_prefix_attention(q, pool[0], pool[1], table, total)

    def gather():
        k = pool[0][table].reshape(-1, kv_heads, dim)[:total]
        v = pool[1][table].reshape(-1, kv_heads, dim)[:total]
        return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)

    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, new, D]

    def to_tokens(o: torch.Tensor) -> torch.Tensor:
        return o[0].transpose(0, 1)

    def expand(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(heads // kv_heads, dim=1)

    def cudnn_mask():
        k, v = gather()
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return to_tokens(F.scaled_dot_product_attention(qh, expand(k), expand(v), attn_mask=mask))

    def cudnn_split(repeat_kv: bool):
        def run():
            k, v = gather()
            if repeat_kv:
                k, v = expand(k), expand(v)
            o1, l1 = cudnn_lse(qh, k[:, :, :context], v[:, :, :context], False)
            o2, l2 = cudnn_lse(qh, k[:, :, context:], v[:, :, context:], True)
            return to_tokens(merge(o1, l1, o2, l2))
        return run

    def cudnn_full():
        k, v = gather()
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return to_tokens(F.scaled_dot_product_attention(qh, expand(k), expand(v)))

    def flash_mask():
        k, v = gather()
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return to_tokens(F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=True))

    expected = triton().float()
    rows = []
    variants = [("triton", triton), ("gather", gather), ("cudnn_mask", cudnn_mask),
                ("cudnn_split_gqa", cudnn_split(False)), ("cudnn_split_repeat", cudnn_split(True)),
                ("cudnn_full", cudnn_full), ("flash_mask", flash_mask)]
    for name, fn in variants:
        row = {"context": context, "new": new, "variant": name}
        try:
            row["ms"] = timed(fn, repeats)
            if name != "gather":
                row["tflops"] = flops / row["ms"] / 1e9
                row["max_diff"] = (fn().float() - expected).abs().max().item()
        except Exception as e:  # noqa: BLE001 - a probe: report what cannot run and go on
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        if "ms" not in row:
            text = row["error"]
        elif "tflops" in row:
            text = f"{row['ms']:7.3f} ms {row['tflops']:6.0f} TF  diff {row['max_diff']:.4f}"
        else:
            text = f"{row['ms']:7.3f} ms"
        print(f"{context:7d} {new:5d} {name:20s} {text}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,4096,8192")
    parser.add_argument("--new", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name())
    rows = [r for c in args.contexts.split(",") for r in case(int(c), args.new, args.repeats)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
