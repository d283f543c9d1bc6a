"""Decode step time on a GPU: the PyTorch reference, the paged Triton kernel (eager), and CUDA graphs.

Each decode step is timed from building its inputs to the sampled ids back on the host (greedy), the way
the engine runs it. Sequences own scattered pages (a random permutation), as in a serving pool. Also
times one layer's attention alone: gather + SDPA against the kernel, and reports the roofline of a step
(weights plus the KV read once, at the given HBM bandwidth).

"graph" is with the fused elementwise kernels (hicache.engine.kernels.fused), "unfused" the same graphs captured with
PyTorch's ops.

Usage: python3 bench/decode_bench.py --model random:llama-3.1-8b --batch-sizes 1,8,32 --contexts 1024,8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache.engine import ForwardBatch, load_model  # noqa: E402
from hicache.engine.attention import paged_attention, plan_attention  # noqa: E402
from hicache.engine.cuda_graph import DecodeGraphs  # noqa: E402
from hicache.engine.kernels import fused as fused_ops  # noqa: E402


def eager_step(model, kv, page_size: int, ids: list[int], positions: list[int], tables: list[list[int]]):
    """One decode step built as Engine._forward builds it (per-sequence page tables)."""
    dev = model.device
    slots = [t[p // page_size] * page_size + p % page_size for t, p in zip(tables, positions)]
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, device=dev),
        positions=torch.tensor(positions, device=dev),
        out_slots=torch.tensor(slots, device=dev),
        seq_lens=[p + 1 for p in positions],
        new_lens=[1] * len(ids),
        page_tables=[torch.tensor(t[: p // page_size + 1], device=dev) for t, p in zip(tables, positions)],
    )
    return model(batch, kv, page_size)


def time_steps(step, batch: int, context: int, steps: int) -> list[float]:
    ids = [7] * batch
    seconds = []
    for i in range(steps + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = step(ids, [context + i] * batch)
        ids = logits.argmax(-1).tolist()
        seconds.append(time.perf_counter() - start)
    return seconds[2:]  # two warm-up steps


def attention_only(model, kv, page_size: int, tables: list[list[int]], context: int, repeats: int = 20) -> dict:
    """Milliseconds of one layer's decode attention (K/V write included): reference vs kernel."""
    cfg = model.config
    batch = len(tables)
    dev = model.device
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, dtype=model.dtype, device=dev)
    k = torch.randn(batch, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype, device=dev)
    slots = torch.tensor([t[context // page_size] * page_size + context % page_size for t in tables], device=dev)
    page_tables = [torch.tensor(t[: context // page_size + 1], device=dev) for t in tables]
    positions = torch.full((batch,), context, device=dev)
    result = {}
    for name, use_kernel in (("reference", False), ("kernel", True)):
        plan = plan_attention(positions, [context + 1] * batch, [1] * batch, page_tables, page_size, use_kernel)
        paged_attention(q, k, k, kv[0], slots, plan)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            paged_attention(q, k, k, kv[0], slots, plan)
        torch.cuda.synchronize()
        result[name] = (time.perf_counter() - start) / repeats * 1000
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--hbm-gbps", type=float, default=4800.0, help="for the roofline (H200: 4.8 TB/s)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    device = torch.device("cuda")
    model, _ = load_model(args.model, getattr(torch, args.dtype), device)
    ps = args.page_size
    batches = [int(b) for b in args.batch_sizes.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    per_seq = -(-(max(contexts) + args.steps + 4) // ps)
    num_pages = max(batches) * per_seq
    kv = torch.empty(model.kv_pool_shape(num_pages, ps), dtype=model.dtype, device=device)
    graphs = DecodeGraphs(model, kv, ps, max(batches), per_seq).capture(batches)
    fused_ops.enabled = False  # the same graphs with PyTorch's elementwise ops (model.fused_elementwise false)
    unfused = DecodeGraphs(model, kv, ps, max(batches), per_seq).capture(batches)
    fused_ops.enabled = True
    kv.normal_()  # after capture: its warm-up writes slot 0
    order = torch.randperm(num_pages).tolist()  # scattered pages, as in a serving pool
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(max(batches))]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_token_bytes = model.config.kv_bytes_per_token(model.dtype)
    rows = []
    print(f"{'batch':>5} {'context':>7} | {'reference':>9} {'kernel':>7} {'graph':>7} {'unfused':>7} ms/step | "
          f"roofline | attention/layer ref, kernel ms")
    for context in contexts:
        for batch in batches:
            t = tables[:batch]
            def eager(ids, positions, t=t):
                return eager_step(model, kv, ps, ids, positions, t)

            times = {}
            model.decode_kernel = False
            times["reference"] = time_steps(eager, batch, context, args.steps)
            model.decode_kernel = True
            times["kernel"] = time_steps(eager, batch, context, args.steps)
            times["graph"] = time_steps(lambda ids, positions, t=t: graphs.run(ids, positions, t), batch, context,
                                        args.steps)
            times["graph_unfused"] = time_steps(lambda ids, positions, t=t: unfused.run(ids, positions, t), batch,
                                                context, args.steps)
            med = {k: statistics.median(v) * 1000 for k, v in times.items()}
            roof = (weight_bytes + batch * context * kv_token_bytes) / (args.hbm_gbps * 1e9) * 1000
            attn = attention_only(model, kv, ps, t, context)
            rows.append({"batch": batch, "context": context, "ms_per_step": med, "roofline_ms": roof,
                         "attention_layer_ms": attn})
            print(f"{batch:>5} {context:>7} | {med['reference']:>9.2f} {med['kernel']:>7.2f} {med['graph']:>7.2f} "
                  f"{med['graph_unfused']:>7.2f} | {roof:>8.2f} | {attn['reference']:.3f}, {attn['kernel']:.3f}")
    print(f"graphs captured in {graphs.capture_s:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "capture_s": graphs.capture_s}, indent=1))


if __name__ == "__main__":
    main()
