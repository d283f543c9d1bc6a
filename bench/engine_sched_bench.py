"""End-to-end engine speed on the embedded SmolLM2 (or any model): prefill and batched decode tokens/s.

Runs through Engine.step (scheduler, paged KV pool, controller, sampling, detokenization), so it
includes every per-step overhead a served request pays. Usage:
    .venv/bin/python bench/engine_sched_bench.py [--model smollm2-135m-instruct] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch

from hicache.config import Config, override
from hicache.engine.builder import build_engine
from hicache.engine.params import SamplingParams


def timed_steps(engine) -> tuple[float, int, float, int]:
    """Step to idle: (prefill seconds, prefill tokens, decode-only seconds, decode tokens)."""
    pre_s = dec_s = 0.0
    pre_n = dec_n = 0
    while engine.has_unfinished():
        s = engine.scheduler
        decode_only = not s.waiting and all(len(r.token_ids) - r.computed == 1 for r in s.running)
        before = dict(engine.counters)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if decode_only:
            dec_s += elapsed
            dec_n += engine.counters["decode_tokens"] - before["decode_tokens"]
        else:
            pre_s += elapsed
            pre_n += engine.counters["prefill_tokens"] - before["prefill_tokens"]
    return pre_s, pre_n, dec_s, dec_n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    args = ap.parse_args()
    cfg = override(Config(), {"model.name": args.model, "model.device": args.device,
                              "cache.device": {"size_tokens": 16384}, "cache.host": {"size_tokens": 0}})
    engine = build_engine(cfg)
    vocab = min(engine.model.config.vocab_size, 30000)
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(100, vocab, (n,), generator=gen).tolist()

    print(f"model {args.model} on {args.device}, dtype {engine.model.dtype}, torch threads {torch.get_num_threads()}")
    print(f"calibrated prefill: {engine.cache.controller.cost.prefill_tokens_per_s:.0f} tokens/s")
    engine.add_request("warm", prompt(64), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    timed_steps(engine)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request("prefill", prompt(args.prompt_tokens), one)
    pre_s, pre_n, _, _ = timed_steps(engine)
    print(f"prefill {pre_n} tokens (1 request): {pre_n / pre_s:.0f} tokens/s")
    for batch in (1, 8):
        params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"d{batch}-{i}", prompt(64), params)
        _, _, dec_s, dec_n = timed_steps(engine)
        print(f"decode batch {batch}: {dec_n / dec_s:.1f} tokens/s ({dec_s / (dec_n / batch) * 1000:.1f} ms/step)")
    engine.close()


if __name__ == "__main__":
    main()
