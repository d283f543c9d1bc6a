"""One whole prefill step over cached prefixes, as the multi-turn host arm runs it: wall time per forward by path.

A step of SEQS sequences, each NEW new tokens over CONTEXT cached tokens already in the paged pool (random
K/V; pages shuffled), through `LlamaModel.forward` (random weights of the real shapes, bf16). Timed from launch
to the logits being ready (host synchronised), so the CPU cost of launching (Triton's TMA descriptors are built
on the host per call) counts, as it does in serving. Paths:

- `tma`: the default launch shapes (TMA first on Hopper with 64-token pages);
- `plain`: the same kernel without TMA (TMA_CONFIG marked unavailable for the run);
- `sdpa`: gather + PyTorch SDPA (`model.prefill_kernel = False`);
- `unfused`: `tma` with PyTorch's elementwise ops instead of `hicache.engine.kernels.fused` (`model.fused_elementwise`
  false); the other paths use the fused kernels.

    python3 bench/gpu/prefix_forward_bench.py [--seqs 6] [--new 1024] [--contexts 4096 8192] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hicache.engine import load_model
from hicache.engine.kernels import fused as fused_ops
from hicache.engine.kernels import prefill as prefill_kernel
from hicache.engine.model import ForwardBatch

PATHS = ("tma", "plain", "sdpa", "unfused")


def step_batch(seqs: int, new: int, context: int, page_size: int, num_pages: int, vocab: int,
               gen: torch.Generator) -> ForwardBatch:
    per_seq = -(-(context + new) // page_size)
    order = torch.randperm(num_pages, generator=gen, device="cuda")
    ids, positions, slots, tables = [], [], [], []
    for s in range(seqs):
        table = order[s * per_seq : (s + 1) * per_seq]
        pos = torch.arange(context, context + new, device="cuda")
        ids.append(torch.randint(0, vocab, (new,), generator=gen, device="cuda"))
        positions.append(pos)
        slots.append(table[pos // page_size] * page_size + pos % page_size)
        tables.append(table)
    return ForwardBatch(input_ids=torch.cat(ids), positions=torch.cat(positions), out_slots=torch.cat(slots),
                        seq_lens=[context + new] * seqs, new_lens=[new] * seqs, page_tables=tables)


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--seqs", type=int, default=6)
    ap.add_argument("--new", type=int, default=1024)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda")
    model, _ = load_model(args.model, torch.bfloat16, device)
    ps = args.page_size
    per_seq = -(-(max(args.contexts) + args.new) // ps)
    num_pages = per_seq * args.seqs + 8
    kv = torch.randn(model.kv_pool_shape(num_pages, ps), dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for context in args.contexts:
        batch = step_batch(args.seqs, args.new, context, ps, num_pages, model.config.vocab_size, gen)
        tokens = args.seqs * args.new
        row = {"seqs": args.seqs, "new": args.new, "context": context}
        for path in PATHS:
            saved = dict(prefill_kernel._unavailable)
            fused_ops.enabled = path != "unfused"
            model.prefill_kernel = path != "sdpa"
            if path == "plain":
                prefill_kernel._unavailable[prefill_kernel.TMA_CONFIG] = "bench: plain shape"
            first = prefill_kernel.default_configs(device, kv[0, 0], kv[0, 1])
            row[f"{path}_shape"] = str(first[0]) if path != "sdpa" and first else "sdpa"
            with torch.inference_mode():
                ms = timed(lambda batch=batch: model(batch, kv, ps), args.reps)
            row[f"{path}_ms"] = ms
            row[f"{path}_us_per_token"] = ms * 1e3 / tokens
            prefill_kernel._unavailable.clear()
            prefill_kernel._unavailable.update(saved)
        model.prefill_kernel = True
        fused_ops.enabled = True
        rows.append(row)
        print(f"{args.seqs} x {args.new} new over {context}: " + ", ".join(
            f"{p} {row[f'{p}_ms']:.1f} ms ({row[f'{p}_us_per_token']:.1f} us/token)" for p in PATHS)
            + f"; tma/plain {row['tma_ms'] / row['plain_ms']:.3f}, tma/unfused {row['tma_ms'] / row['unfused_ms']:.3f}"
            f"; first shape {row['tma_shape']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
