"""Engine prefill time per token versus a bare PyTorch stack of the same shapes and weights.

Both run the same weights in the same process: the engine through LlamaModel.forward on the paged KV pool
(writing K/V into scattered pages, as serving does), the bare stack as plain eager PyTorch written here, not
with the engine's modules, so that engine speedups do not speed up the reference:

- 4-D [1, heads, T, head_dim] attention tensors, K/V repeated to the query heads, causal SDPA; on CUDA only
  the flash / memory-efficient backends are allowed, so a silent fallback to the quadratic math kernel
  raises instead;
- separate q/k/v and gate/up projections (row views of the engine's fused weights, no copies), F.rms_norm,
  HF's rotate-half RoPE, silu(gate) * up, out-of-place residual adds; no KV cache, no paging.

Reports microseconds per token and the ratio engine / bare. --profile runs torch.profiler over one engine and
one bare forward per token count and prints the top CUDA kernels by total time (on CPU: the top ops by self
CPU time), also written into the --json output. Meant for CUDA (random:llama-3.1-8b, bf16); on CPU use
--model random:tiny to check that it runs.

    python bench/prefill_bench.py [--model random:llama-3.1-8b] [--tokens 2048 8192] [--profile] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from hicache.engine.model import ForwardBatch, LlamaModel, rope_inv_freq
from hicache.engine.weights import load_model

BARE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


class BareStack:
    """A plain PyTorch Llama forward over the weights of a loaded LlamaModel (last-token logits only)."""

    def __init__(self, model: LlamaModel) -> None:
        c = self.config = model.config
        self.layers: list[dict[str, Tensor | None]] = []
        q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv_proj is not None:  # fused by the loader: split back into row views
                wq, wk, wv = attn.qkv_proj.weight.split([q_rows, kv_rows, kv_rows])
                b = attn.qkv_proj.bias
                bq, bk, bv = b.split([q_rows, kv_rows, kv_rows]) if b is not None else (None, None, None)
            else:
                wq, wk, wv = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
                bq, bk, bv = attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias
            if mlp.gate_up_proj is not None:
                wg, wu = mlp.gate_up_proj.weight.chunk(2)
            else:
                wg, wu = mlp.gate_proj.weight, mlp.up_proj.weight
            self.layers.append({
                "norm1": layer.input_layernorm.weight, "wq": wq, "wk": wk, "wv": wv, "bq": bq, "bk": bk, "bv": bv,
                "wo": attn.o_proj.weight, "norm2": layer.post_attention_layernorm.weight, "wg": wg, "wu": wu,
                "wd": mlp.down_proj.weight,
            })  # fmt: skip
        self.embed = model.embed_tokens.weight
        self.final_norm = model.norm.weight
        self.head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        self.inv_freq = rope_inv_freq(c).to(self.embed.device)

    def rms_norm(self, x: Tensor, weight: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)

    @staticmethod
    def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def forward(self, input_ids: Tensor) -> Tensor:
        c = self.config
        t = input_ids.numel()
        group = c.num_heads // c.num_kv_heads
        positions = torch.arange(t, device=input_ids.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim], broadcast as [1, 1, T, head_dim]
        cos, sin = angles.cos().to(self.embed.dtype), angles.sin().to(self.embed.dtype)
        x = F.embedding(input_ids, self.embed)
        backends = sdpa_kernel(BARE_SDPA_BACKENDS) if x.is_cuda else nullcontext()
        with backends:
            for w in self.layers:
                h = self.rms_norm(x, w["norm1"])
                q = F.linear(h, w["wq"], w["bq"]).view(1, t, c.num_heads, c.head_dim).transpose(1, 2)
                k = F.linear(h, w["wk"], w["bk"]).view(1, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
                v = F.linear(h, w["wv"], w["bv"]).view(1, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
                q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
                if group > 1:
                    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [1, heads, T, head_dim]
                x = x + F.linear(o.transpose(1, 2).reshape(t, c.num_heads * c.head_dim), w["wo"])
                h = self.rms_norm(x, w["norm2"])
                x = x + F.linear(F.silu(F.linear(h, w["wg"])) * F.linear(h, w["wu"]), w["wd"])
        x = self.rms_norm(x[-1:], self.final_norm)
        return F.linear(x, self.head).float()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int) -> float:
    fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def kernel_category(name: str) -> str:
    """Rough class of a CUDA kernel (or, on CPU, an aten op) by its name."""
    lower = name.lower()
    cpu_matmul = lower.removeprefix("aten::").rstrip("_") in ("mm", "addmm", "bmm", "baddbmm")
    if cpu_matmul or any(s in lower for s in ("gemm", "nvjet", "cutlass", "xmma", "gemv", "cublas")):
        return "gemm"
    if any(s in lower for s in ("flash", "fmha", "attention", "attn")):
        return "attention"
    if "memcpy" in lower or "memset" in lower:
        return "memcpy/memset"
    return "other"


def profile_forward(fn, device: torch.device, top: int) -> dict[str, Any]:
    """Profile one call of fn: CUDA kernels by total time on CUDA, ops by self CPU time on CPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    wall = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    wall = time.perf_counter() - wall
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    if device.type == "cuda":
        kind = "cuda kernels, total device time"
        for event in prof.events():
            if event.device_type == DeviceType.CUDA:
                totals[event.name] += event.time_range.elapsed_us()
                calls[event.name] += 1
    else:
        kind = "cpu ops, self cpu time"
        for avg in prof.key_averages():
            totals[avg.key] += avg.self_cpu_time_total
            calls[avg.key] += avg.count
    total_us = sum(totals.values())
    categories: dict[str, float] = defaultdict(float)
    for name, us in totals.items():
        categories[kernel_category(name)] += us
    rows = sorted(totals, key=totals.get, reverse=True)[:top]
    return {
        "kind": kind,
        "profiled_wall_ms": wall * 1e3,
        "total_us": total_us,
        "count": sum(calls.values()),
        "categories_us": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
        "top": [
            {"name": name[:200], "calls": calls[name], "total_us": totals[name],
             "percent": 100 * totals[name] / max(total_us, 1e-9)}
            for name in rows
        ],
    }  # fmt: skip


def print_profile(label: str, tokens: int, p: dict[str, Any]) -> None:
    cats = ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in p["categories_us"].items())
    print(f"  {label} @ {tokens} tokens: {p['kind']}: {p['total_us'] / 1e3:.2f} ms over {p['count']} "
          f"({p['total_us'] / tokens:.2f} us/token; {cats})")
    for row in p["top"]:
        print(f"    {row['total_us'] / 1e3:9.3f} ms {row['percent']:5.1f}% {row['calls']:6d}x  {row['name'][:110]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                    help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--profile", action="store_true", help="profile one engine and one bare forward per size")
    ap.add_argument("--top", type=int, default=15, help="rows per profile")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model, _ = load_model(args.model, dtype, device)
    bare = BareStack(model)
    ps = args.page_size
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{args.model} {str(dtype).removeprefix('torch.')} on {device_name}, torch {torch.__version__}")
    results = []
    for n in args.tokens:
        pages = -(-n // ps)
        kv = torch.zeros(model.kv_pool_shape(pages, ps), dtype=dtype, device=device)
        ids = torch.randint(0, model.config.vocab_size, (n,), device=device)
        page_table = torch.randperm(pages, device=device)  # scattered pages, as in serving
        slots = (page_table[:, None] * ps + torch.arange(ps, device=device)).reshape(-1)[:n]
        batch = ForwardBatch(ids, torch.arange(n, device=device), slots, [n], [n], [page_table])

        def engine_forward(b=batch, kv=kv):
            return model(b, kv, ps)

        def bare_forward(ids=ids):
            return bare.forward(ids)

        with torch.inference_mode():
            engine_s = timed(engine_forward, device, args.reps)
            bare_s = timed(bare_forward, device, args.reps)
            engine_logits, bare_logits = engine_forward(), bare_forward()
            diff = (engine_logits - bare_logits).abs().max().item()
            scale = bare_logits.abs().max().item()
            profiles = None
            if args.profile:
                profiles = {"engine": profile_forward(engine_forward, device, args.top),
                            "bare": profile_forward(bare_forward, device, args.top)}
        r = {"model": args.model, "tokens": n, "engine_us_per_token": engine_s / n * 1e6,
             "bare_us_per_token": bare_s / n * 1e6, "ratio": engine_s / bare_s, "max_logit_diff": diff,
             "max_abs_logit": scale, "device": device_name, "dtype": str(dtype), "torch": torch.__version__}
        if profiles is not None:
            r["profile"] = profiles
        results.append(r)
        print(f"{n:>6} tokens: engine {r['engine_us_per_token']:.2f} us/token, bare {r['bare_us_per_token']:.2f} "
              f"us/token, ratio {r['ratio']:.3f}, max logit diff {diff:.3g} (max |logit| {scale:.3g})")
        if profiles is not None:
            print_profile("engine", n, profiles["engine"])
            print_profile("bare", n, profiles["bare"])
        del kv
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
