"""Engine prefill time per token versus a bare PyTorch stack of the same shapes and weights.

Both run the same weights in the same process: the engine through LlamaModel.forward on the paged
KV pool (writing K/V into pages, as serving does), the bare stack as plain layers with SDPA and no
KV cache. Reports microseconds per token and the ratio. Meant for CUDA (random:llama-3.1-8b, bf16);
on CPU use --model random:tiny to check that it runs.

    python bench/prefill_bench.py [--model random:llama-3.1-8b] [--tokens 2048 8192] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from hicache.engine.model import ForwardBatch, apply_rope
from hicache.engine.weights import load_model


def bare_forward(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The same computation as the model, as a plain PyTorch stack with causal SDPA (no paging)."""
    c = model.config
    positions = torch.arange(input_ids.numel(), device=input_ids.device)
    cos, sin = model._rope_cos_sin(positions, model.dtype)
    x = model.embed_tokens(input_ids)
    t = x.shape[0]
    for layer in model.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rope(a.q_proj(h).view(t, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(a.k_proj(h).view(t, c.num_kv_heads, c.head_dim), cos, sin)
        v = a.v_proj(h).view(t, c.num_kv_heads, c.head_dim)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=True, enable_gqa=True)
        x = x + a.o_proj(o.transpose(0, 1).reshape(t, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = model.norm(x[-1:])
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return F.linear(x, head).float()


def timed(fn, device: torch.device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, _ = load_model(args.model, dtype, device)
    ps = args.page_size
    results = []
    for n in args.tokens:
        pages = -(-n // ps)
        kv = torch.zeros(model.kv_pool_shape(pages, ps), dtype=dtype, device=device)
        ids = torch.randint(0, model.config.vocab_size, (n,), device=device)
        page_table = torch.randperm(pages, device=device)  # scattered pages, as in serving
        slots = (page_table[:, None] * ps + torch.arange(ps, device=device)).reshape(-1)[:n]
        batch = ForwardBatch(ids, torch.arange(n, device=device), slots, [n], [n], [page_table])
        with torch.inference_mode():
            engine_s = timed(lambda b=batch, kv=kv: model(b, kv, ps), device, args.reps)
            bare_s = timed(lambda ids=ids: bare_forward(model, ids), device, args.reps)
            diff = (model(batch, kv, ps) - bare_forward(model, ids)).abs().max().item()
        r = {"model": args.model, "tokens": n, "engine_us_per_token": engine_s / n * 1e6,
             "bare_us_per_token": bare_s / n * 1e6, "ratio": engine_s / bare_s, "max_logit_diff": diff,
             "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype)}
        results.append(r)
        print(f"{n:>6} tokens: engine {r['engine_us_per_token']:.2f} us/token, bare {r['bare_us_per_token']:.2f} "
              f"us/token, ratio {r['ratio']:.3f}, max logit diff {diff:.3g}")
        del kv
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
