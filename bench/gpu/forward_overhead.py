"""The CPU cost of queueing one forward step against its GPU time, for the step shapes of the multi-turn host arm.

In the server's step log (`serve --step-log`) the host arm's small prefill steps took as long to queue on the CPU
(`enqueue_ms`) as the GPU took to run them (`gpu_ms`): such a step is bound by Python, not by the GPU. This bench
runs the same kind of step in isolation: SEQS prefill chunks of NEW tokens over CONTEXT cached tokens plus DECODES
decoding sequences at DCONTEXT tokens, through `LlamaModel.forward` (random weights of the real shapes, bf16). Per
shape:

- `enqueue_ms`: CPU time until `forward` returns, the GPU idle at the start (median of the repetitions); the
  inputs are on the device already, as the engine passes them, so nothing in the forward waits for the GPU;
- `gpu_ms`: CUDA events around the forward;
- `wall_ms`: until the logits are ready (host synchronised).

With --profile FILE, the enqueue of the first shape is also run under cProfile and its top functions (by own time)
written to FILE.

    python3 bench/gpu/forward_overhead.py [--shapes 1x1024@8192+8@6144 ...] [--reps 10] [--json OUT] [--profile F]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import re
import statistics
import time

import torch

from hicache.engine import load_model
from hicache.engine.model import ForwardBatch

SHAPES = ["1x1024@8192+8@6144", "1x1024@1024+8@2048", "3x1024@4096+6@4096", "7x1024@7168+0@0", "0x0@0+16@8192",
          "1x64@8192+0@0"]


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)@(\d+)\+(\d+)@(\d+)", text)
    if m is None:
        raise SystemExit(f"--shapes {text!r}: expected SEQSxNEW@CONTEXT+DECODES@DCONTEXT, e.g. 1x1024@8192+8@6144")
    return tuple(int(g) for g in m.groups())  # type: ignore[return-value]


def make_batch(shape: tuple[int, int, int, int, int], page_size: int, num_pages: int, vocab: int,
               gen: torch.Generator) -> ForwardBatch:
    seqs, new, context, decodes, dcontext = shape
    order = torch.randperm(num_pages, generator=gen, device="cuda")
    ids, positions, slots, tables, seq_lens, new_lens = [], [], [], [], [], []
    used = 0
    for n, ctx in [(1, dcontext)] * decodes + [(new, context)] * seqs:  # decodes first, as the engine plans them
        pages = -(-(ctx + n) // page_size)
        table = order[used : used + pages]
        used += pages
        pos = torch.arange(ctx, ctx + n, device="cuda")
        ids.append(torch.randint(0, vocab, (n,), generator=gen, device="cuda"))
        positions.append(pos)
        slots.append(table[pos // page_size] * page_size + pos % page_size)
        tables.append(table)
        seq_lens.append(ctx + n)
        new_lens.append(n)
    # decode rows and lengths, and the last row of each sequence, on the device as the engine passes them: built
    # from lists inside the forward they would be blocking copies that make the host wait for the GPU
    rows = torch.tensor([i for i, n in enumerate(new_lens) if n == 1], device="cpu")
    starts = torch.tensor([0] + new_lens, device="cpu").cumsum(0)
    decode_rows = starts[:-1][rows].cuda() if len(rows) else torch.zeros(0, dtype=torch.int64, device="cuda")
    decode_lens = torch.tensor([seq_lens[i] for i in rows.tolist()], dtype=torch.int64).cuda()
    return ForwardBatch(input_ids=torch.cat(ids), positions=torch.cat(positions), out_slots=torch.cat(slots),
                        seq_lens=seq_lens, new_lens=new_lens, page_tables=tables, decode_rows=decode_rows,
                        decode_lens=decode_lens, last_rows=(starts[1:] - 1).cuda())


def pages_for(shape: tuple[int, int, int, int, int], page_size: int) -> int:
    seqs, new, context, decodes, dcontext = shape
    return seqs * -(-(context + new) // page_size) + decodes * -(-(dcontext + 1) // page_size)


def measure(model, batch: ForwardBatch, kv: torch.Tensor, page_size: int, reps: int) -> dict:
    enqueue, gpu, wall = [], [], []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start = time.perf_counter()
        start_ev.record()
        model(batch, kv, page_size)
        end_ev.record()
        queued = time.perf_counter()
        end_ev.synchronize()
        done = time.perf_counter()
        if i:  # the first run warms the kernels
            enqueue.append((queued - start) * 1e3)
            gpu.append(start_ev.elapsed_time(end_ev))
            wall.append((done - start) * 1e3)
    return {"enqueue_ms": statistics.median(enqueue), "gpu_ms": statistics.median(gpu),
            "wall_ms": statistics.median(wall)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--shapes", nargs="+", default=SHAPES)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--profile", metavar="FILE")
    args = ap.parse_args()
    shapes = [parse_shape(s) for s in args.shapes]
    device = torch.device("cuda")
    model, _ = load_model(args.model, torch.bfloat16, device)
    model.prefill_kernel = True
    ps = args.page_size
    num_pages = max(pages_for(s, ps) for s in shapes) + 8
    kv = torch.randn(model.kv_pool_shape(num_pages, ps), dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for text, shape in zip(args.shapes, shapes):
        batch = make_batch(shape, ps, num_pages, model.config.vocab_size, gen)
        row = {"shape": text, **measure(model, batch, kv, ps, args.reps)}
        rows.append(row)
        print(f"{text:>22}: enqueue {row['enqueue_ms']:6.1f} ms, GPU {row['gpu_ms']:6.1f} ms, "
              f"wall {row['wall_ms']:6.1f} ms, enqueue / GPU {row['enqueue_ms'] / row['gpu_ms']:.2f}", flush=True)
        if args.profile and len(rows) == 1:
            torch.cuda.synchronize()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.reps):
                model(batch, kv, ps)
            profiler.disable()
            torch.cuda.synchronize()
            text_out = io.StringIO()
            pstats.Stats(profiler, stream=text_out).sort_stats("tottime").print_stats(30)
            with open(args.profile, "w") as f:
                f.write(f"cProfile of {args.reps} enqueues of {text}\n{text_out.getvalue()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
