"""Speed of the engine model (CPU by default): prefill tokens/s for one long prompt, batched decode tokens/s.

Usage: .venv/bin/python bench/engine_cpu_bench.py [--model smollm2-135m-instruct] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache.engine import ForwardBatch, load_model  # noqa: E402
from hicache.engine.generate import allocate_kv  # noqa: E402

PAGE_SIZE = 16


def batch_for(
    tokens: list[list[int]], cached: list[int], pages_per_seq: int, device: torch.device
) -> ForwardBatch:
    """Sequence i owns pages [i * pages_per_seq, (i + 1) * pages_per_seq); tokens[i] follow cached[i]."""
    ids, positions, slots, tables = [], [], [], []
    for i, (new, start) in enumerate(zip(tokens, cached)):
        table = torch.arange(i * pages_per_seq, (i + 1) * pages_per_seq)  # CPU: int() below must not sync
        ids += new
        positions += range(start, start + len(new))
        span = range(start, start + len(new))
        slots += [int(table[p // PAGE_SIZE]) * PAGE_SIZE + p % PAGE_SIZE for p in span]
        tables.append(table[: -(-(start + len(new)) // PAGE_SIZE)].to(device))
    return ForwardBatch(
        input_ids=torch.tensor(ids, device=device),
        positions=torch.tensor(positions, device=device),
        out_slots=torch.tensor(slots, device=device),
        seq_lens=[c + len(t) for t, c in zip(tokens, cached)],
        new_lens=[len(t) for t in tokens],
        page_tables=tables,
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rates(work: int, seconds: list[float]) -> str:
    """Median and best rate: the dev box is shared, so the median resists other people's jobs."""
    per_second = sorted(work / s for s in seconds)
    return (
        f"median {statistics.median(per_second):.1f}, best {per_second[-1]:.1f} tokens/s (n={len(seconds)})"
    )


def bench_prefill(model, prompt_len: int, repeats: int) -> list[float]:
    """Seconds per full prefill of a `prompt_len`-token prompt."""
    pages = -(-prompt_len // PAGE_SIZE)
    kv = allocate_kv(model, pages, PAGE_SIZE)
    tokens = torch.randint(100, 20000, (prompt_len,)).tolist()
    model(batch_for([tokens], [0], pages, model.device), kv, PAGE_SIZE)  # warm-up
    seconds = []
    for _ in range(repeats):
        synchronize(model.device)
        start = time.perf_counter()
        model(batch_for([tokens], [0], pages, model.device), kv, PAGE_SIZE)
        synchronize(model.device)
        seconds.append(time.perf_counter() - start)
    return seconds


def bench_decode(model, batch_size: int, context: int, steps: int) -> list[float]:
    """Seconds per decode step of `batch_size` sequences with `context` tokens cached (batch built in)."""
    pages = -(-(context + steps + 1) // PAGE_SIZE)
    kv = allocate_kv(model, pages * batch_size, PAGE_SIZE)
    prompts = [torch.randint(100, 20000, (context,)).tolist() for _ in range(batch_size)]
    logits = model(batch_for(prompts, [0] * batch_size, pages, model.device), kv, PAGE_SIZE)
    lengths = [context] * batch_size
    next_ids = logits.argmax(-1).tolist()
    seconds = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        logits = model(batch_for([[t] for t in next_ids], lengths, pages, model.device), kv, PAGE_SIZE)
        next_ids = logits.argmax(-1).tolist()
        seconds.append(time.perf_counter() - start)
        lengths = [n + 1 for n in lengths]
    return seconds[1:]  # step 0 is warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--context", type=int, default=256, help="tokens already cached per decode sequence")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", default="1,8", help="decode batch sizes, comma separated")
    args = parser.parse_args()
    model, _ = load_model(args.model, getattr(torch, args.dtype), torch.device(args.device))
    torch.manual_seed(0)
    print(f"model={args.model} dtype={args.dtype} device={args.device} threads={torch.get_num_threads()}")
    prefill_seconds = bench_prefill(model, args.prompt_len, 5)
    print(f"prefill {args.prompt_len} tokens: {rates(args.prompt_len, prefill_seconds)}")
    for batch_size in map(int, args.batch_sizes.split(",")):
        seconds = bench_decode(model, batch_size, args.context, args.steps)
        print(f"decode batch {batch_size} (context {args.context}): {rates(batch_size, seconds)}")


if __name__ == "__main__":
    main()
